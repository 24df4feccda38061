"""The embedded SmolLM2-135M-Instruct pair's tiers: greedy at a lossy KV tier equals plain
decoding at that tier, its real KV through offload and coding is bit-exact, and at the
bitsandbytes weight tiers every token is the argmax of the forward that verified it."""
import pytest
import torch

from engine.decode.policies import make_policy
from engine.lab import divergence
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.runtime.models import load_pair
from realmodel import PROMPTS, hf_greedy
from tiny import synthetic_context

KV_NEW = 40  # the KV-tier check's length: its counts of prompts that leave native's output were measured over 40

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning:bitsandbytes")]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def pair(request):
    return load_pair(target_tier=request.param, device="cpu")


@pytest.fixture(scope="module", params=["nf4"])
def quant_pair(request):  # bitsandbytes' layers (int8 on a CPU reads through SpecLab's kernels: below)
    return load_pair(target_tier=request.param, device="cpu")


@pytest.fixture(scope="module", params=["int8", "int4"])
def kernel_pair(request):
    from engine.runtime.kernels import rowdot

    if (why := rowdot.unavailable()) is not None:
        pytest.skip(why)
    return load_pair(target_tier=request.param, device="cpu")


def test_cpu_kernel_tiers_decode_as_hf_generate_token_for_token(kernel_pair):
    """int8 and int4 on a CPU (runtime/kernels/rowdot.py): every policy's greedy output is HF generate's
    over the same model, prefix reuse off and on, with no near tie excused."""
    from engine.runtime.prefix.cache import PrefixCache

    pair = kernel_pair
    assert pair.exact_verify and pair.kernel_set.startswith(f"rowdot-{pair.target_tier}-")
    cache = PrefixCache()
    for _, prompt in PROMPTS[:2]:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        ref = hf_greedy(pair, ids, 32)
        for policy in ("ar", "fixed:4", "fixed:4@ngram", "fixed:2@suffix"):
            for prefix in (None, cache):
                g = Generation(pair, ids, make_policy(policy), GenConfig(max_new_tokens=32), prefix).run()
                assert g.token_ids == ref, (pair.target_tier, policy, prefix is not None)


def test_quantized_tiers_are_exact_wrt_their_verify_logits(quant_pair, monkeypatch):
    """Every emitted token is the argmax of the target forward that verified it."""
    argmaxes: list[list[int]] = []
    forward = quant_pair.target.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        argmaxes.append(out.logits[0, :, : quant_pair.vocab_size].argmax(-1).tolist())
        return out

    monkeypatch.setattr(quant_pair.target, "forward", spy)
    for _, prompt in PROMPTS[:2]:
        argmaxes.clear()
        ids = encode_prompt(quant_pair.tokenizer, prompt, chat=True)
        g = Generation(quant_pair, ids, make_policy("fixed:4"), GenConfig(max_new_tokens=32)).run()
        assert len(argmaxes) == len(g.records)  # one target forward per step, prefill included
        assert g.records[0].token_ids == argmaxes[0][-1:]
        for rec, row in zip(g.records[1:], argmaxes[1:]):
            assert rec.token_ids == row[: rec.emitted], rec.step


def test_quantized_divergence_is_measured(quant_pair):
    d = divergence.measure(quant_pair, [p for _, p in PROMPTS[:2]], "fixed:4", 32)
    assert d.tier == quant_pair.target_tier and d.prompts == 2
    assert d.identical_fraction == sum(f is None for f in d.first_divergence) / 2
    assert all(f is None or 0 <= f <= 32 for f in d.first_divergence + d.reuse_first_divergence)
    print(f"{d.tier}: identical {d.identical_fraction:.0%}, first divergence {d.first_divergence}; "
          f"with reuse {d.reuse_identical_fraction:.0%} {d.reuse_first_divergence}")


_NATIVE: dict[str, list[int]] = {}  # task -> the fp32 target's greedy output at the native KV tier, read row-invariant


@pytest.mark.parametrize("kv_tier", ["fp8", "int8"])
def test_greedy_at_a_kv_tier_equals_plain_decoding_at_that_tier(pair, kv_tier):
    """The embedded pair at fp32, whose verify is not batch-invariant: at a lossy KV tier the
    target reads row-invariant, so `fixed:4` and the adaptive policies (HF's `heuristic`, the
    cost-aware `rakv`) emit exactly what `ar` emits at that tier (before the target read
    row-invariant, fixed:4 at fp8 left it on the math prompt at token 29, a 0.17 logit margin).
    And the tier is applied: its output leaves native's (read the same way) on some prompts."""
    from engine.runtime import invariance

    if pair.target_tier != "fp32":
        pytest.skip("the KV-tier exactness check runs on the fp32 target")
    assert pair.target_row_invariant
    differs = []
    for task, prompt in PROMPTS:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        plain = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=KV_NEW, kv_tier=kv_tier)).run()
        for policy in ("fixed:4", "heuristic", "rakv"):
            g = Generation(pair, ids, make_policy(policy, synthetic_context()),
                           GenConfig(max_new_tokens=KV_NEW, kv_tier=kv_tier)).run()
            assert g.token_ids == plain.token_ids, (kv_tier, policy, task, divergence.first_difference(plain.token_ids, g.token_ids))
        if task not in _NATIVE:  # the same for every KV tier: made once
            with invariance.row_invariant_reads():
                _NATIVE[task] = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=KV_NEW)).run().token_ids
        differs.append(_NATIVE[task] != plain.token_ids)
        assert plain.kv_bytes_per_token == {"fp8": 2 * 30 * 3 * 65, "int8": 2 * 30 * 3 * 66}[kv_tier]
    # Measured over the first 40 tokens: fp8 leaves native on all four prompts, int8 on one (code).
    assert sum(differs) >= {"fp8": 3, "int8": 1}[kv_tier], differs


PER_ROW_WINDOWS = 64


def test_kv_codec_round_trips_real_kv_and_a_paused_generation_resumes_exactly(pair, tmp_path, monkeypatch):
    """The embedded target's own KV (a held-out ShareGPT context at each KV tier) through offload
    and windowed restore, raw and coded against q8_0, is bit-exact for every W; a bf16 generation
    paused and restored from coded windows emits what the uninterrupted one does."""
    from engine.runtime.forward import forward_logits
    from engine.runtime.kv import offload as O
    from engine.runtime.kv.cache import new_cache
    from engine.runtime.kv.calibration import codec_kit, conversation_ids
    from engine.runtime.kv.tiers import KV_TIERS
    from engine.runtime.prefix.cache import kv_of

    if pair.target_tier != "bf16":
        pytest.skip("the codec check runs on the bf16 target")
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))  # a fresh fit, not a cached file
    ids = conversation_ids(pair.tokenizer, 300, "heldout")
    # Fitted on 256 calibration tokens: at 512 the three tiers' fits took 83 of the test's 208 s;
    # at 256 the coded windows stay at 0.22-0.30 of raw (the bound below is 1/2).
    kit = codec_kit(pair.target, "q8_0", tokenizer=pair.tokenizer,
                    calibration_ids=conversation_ids(pair.tokenizer, 256, "calibration"))
    for tier in KV_TIERS:
        with torch.inference_mode():
            _, cache = forward_logits(pair.target, ids, new_cache(pair.target, tier), 1)
        for window in (1 if tier == "native" else 64, 128, len(ids)):
            # A window per position on the first PER_ROW_WINDOWS tokens: all 300 took 47 of the test's 105 s.
            n = PER_ROW_WINDOWS if window == 1 else len(ids)
            kv = kv_of(cache, n)
            want = O.tier_kv(kv, tier)
            for coded in (False, True):
                def coding() -> tuple:  # a μ stream reads once: each side gets a fresh one
                    return (kit.codec(tier), kit.mu(tier)) if coded else ()

                slow = O.SlowTier()
                off = O.offload(kv, ids[:n], tier, slow, "real", window, *coding())
                assert O.tier_kv(O.restore(off, slow, *coding()), tier).equals(want), (tier, window, coded)
                if coded:
                    assert off.stored_bytes < off.raw_bytes / 2, (tier, window, off.stored_bytes, off.raw_bytes)
    prompt = encode_prompt(pair.tokenizer, PROMPTS[2][1], chat=True)
    whole = Generation(pair, prompt, make_policy("fixed:4"), GenConfig(max_new_tokens=24)).run()
    paused = Generation(pair, prompt, make_policy("fixed:4"), GenConfig(max_new_tokens=24))
    for i, _ in enumerate(paused):
        if i in (1, 4):
            paused.offload(O.SlowTier(tmp_path / f"slow{i}"), window=32, kit=kit)
    assert paused.token_ids == whole.token_ids
