"""The KV codec, offload and windowed restore: bit-exact round trips for every tier × coding × W,
edge values, refusal of corrupt or mismatched data, and generations that resume from a restored
cache exactly as if never paused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.runtime.kv import codec as C
from engine.runtime.kv import offload as O
from engine.runtime.kv import pipeline as PL
from engine.runtime.kv import proxy as P
from engine.runtime.kv.calibration import codec_kit, load_codec
from engine.runtime.kv.tiers import KV_TIERS, quantize
from tiny import synthetic_context

GRID_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _stats(L=2, H=2, D=8, sigma=0.05, seed=0) -> C.Stats:
    rng = np.random.default_rng(seed)
    s = sigma * np.exp(rng.normal(0, 1, (2, L, H, 1, D)))
    z = np.zeros_like(s)
    return C.Stats("test", "q8_0", z, z, s, C.build_tables(C.Shape()))


def _edge_block(dtype: torch.dtype, S=24, L=2, H=2, D=8, seed=0) -> torch.Tensor:
    """[2, L, H, S, D] values with zeros of both signs, subnormals, the smallest normals and the
    largest finite values among ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, H, S, D, generator=g)
    fi = torch.finfo(dtype)
    edge = torch.tensor([0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, -fi.tiny / 8, fi.max, -fi.max,
                         fi.smallest_normal * 3, 1.0, -2.0, fi.eps], dtype=torch.float64)
    flat = x.view(-1)
    flat[: edge.numel()] = edge.float() if dtype != torch.float64 else edge
    flat[100: 100 + edge.numel()] = edge.float()
    return x.to(dtype)


def _stored(block: torch.Tensor, tier: str) -> O.KV:
    """A [2, L, H, S, D] block as a cache's stored form at `tier`."""
    return [(quantize(block[0, i][None], tier), quantize(block[1, i][None], tier)) if tier != "native"
            else (block[0, i][None], block[1, i][None]) for i in range(block.shape[1])]


def _mu_like(kv: C.TierKV, seed: int = 1, noise: float = 0.05) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = np.nan_to_num(kv.values(), posinf=0, neginf=0)
    return (v + rng.normal(0, noise, v.shape)).astype(np.float32)


@pytest.mark.parametrize("tier,dtype", [("native", torch.bfloat16), ("native", torch.float16),
                                        ("native", torch.float32), ("fp8", torch.bfloat16),
                                        ("int8", torch.float32), ("fp8", torch.float32)])
def test_edge_values_round_trip_bit_exactly(tier, dtype):
    block = _edge_block(dtype)
    kv = O.tier_kv(_stored(block, tier), tier)
    codec = C.KVCodec(_stats())
    for mu in (_mu_like(kv), np.zeros(kv.codes.shape, np.float32), _mu_like(kv, noise=50.0)):
        blob = codec.encode_window(kv, mu)
        back, used = codec.decode_window(blob, mu, tier, kv.grid)
        assert used == len(blob) and back.equals(kv)
    raw = C.encode_raw_window(kv)
    assert C.decode_raw_window(C.WindowHead.read(raw, tier, kv.grid), tier, kv.grid, kv.codes.shape).equals(kv)
    # The stored form comes back as the cache had it, bit for bit.
    again = O.tier_kv(O.stored_form(kv), tier)
    assert again.equals(kv)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_are_refused_by_the_codec(bad):
    block = _edge_block(torch.bfloat16)
    block[0, 0, 0, 3, 2] = bad
    kv = O.tier_kv(_stored(block, "native"), "native")
    with pytest.raises(ValueError, match="NaN or inf"):
        C.KVCodec(_stats()).encode_window(kv, np.zeros(kv.codes.shape, np.float32))


def test_corrupt_mismatched_and_truncated_windows_are_refused():
    kv = O.tier_kv(_stored(_edge_block(torch.bfloat16), "native"), "native")
    codec = C.KVCodec(_stats())
    mu = _mu_like(kv)
    blob = codec.encode_window(kv, mu)
    flipped = bytearray(blob)
    flipped[C.WINDOW_HEADER.size + 5] ^= 0x10
    with pytest.raises(C.CodecError, match="checksum"):
        codec.decode_window(bytes(flipped), mu, "native", "bf16")
    with pytest.raises(C.CodecError, match="truncated|checksum"):
        codec.decode_window(blob[:-3], mu, "native", "bf16")
    off_by_an_ulp = mu.copy()
    off_by_an_ulp.view(np.uint32)[0, 0, 0, 0, 0] ^= 1
    with pytest.raises(C.CodecError, match="μ differs"):
        codec.decode_window(blob, off_by_an_ulp, "native", "bf16")
    with pytest.raises(C.CodecError, match="tier/grid"):
        codec.decode_window(blob, mu, "fp8", "e4m3")


@pytest.fixture(scope="module")
def kit(tiny_pair, tmp_path_factory, monkeypatch_module):
    """A q8_0 codec for the tiny target, fitted on templated text (cached in a temp dir)."""
    monkeypatch_module.setenv("SPECLAB_CACHE", str(tmp_path_factory.mktemp("cache")))
    ids = encode_prompt(tiny_pair.tokenizer, "The quick brown fox jumps over the lazy dog. " * 12, chat=False)
    return codec_kit(tiny_pair.target, "q8_0", calibration_ids=ids)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _target_stored(pair, ids: list[int], tier: str) -> O.KV:
    from engine.runtime.forward import forward_logits
    from engine.runtime.kv.cache import new_cache
    from engine.runtime.prefix.cache import kv_of

    with torch.inference_mode():
        _, cache = forward_logits(pair.target, ids, new_cache(pair.target, tier), 1)
    return kv_of(cache, len(ids))


@pytest.mark.parametrize("tier", KV_TIERS)
@pytest.mark.parametrize("coded", [False, True])
def test_offload_and_windowed_restore_are_exact_for_every_tier_coding_and_window(tiny_pair, kit, tier, coded, tmp_path):
    ids = encode_prompt(tiny_pair.tokenizer, "Offload me, then bring me back exactly: 0123456789.", chat=True)
    kv = _target_stored(tiny_pair, ids, tier)
    want = O.tier_kv(kv, tier)
    for window in (1, 7, 16, len(ids)):
        for slow in (O.SlowTier(), O.SlowTier(tmp_path / f"{tier}-{window}", PL.Link(100.0, 0.01))):
            args = (kit.codec(tier), kit.mu(tier)) if coded else ()
            off = O.offload(kv, ids, tier, slow, "ctx", window, *args)
            assert len(off.sizes) == -(-len(ids) // window)
            timing = O.Timing()
            back = O.restore(off, slow, *((kit.codec(tier), kit.mu(tier)) if coded else ()), timing=timing)
            assert O.tier_kv(back, tier).equals(want), (tier, coded, window)
            assert len(timing.decode) == len(off.sizes)
    if coded and tier == "native":  # coding pays even on a random tiny model's fp32 cache
        assert off.stored_bytes < off.raw_bytes


def test_restore_refuses_a_corrupt_window_another_predictor_and_another_codec(tiny_pair, tiny_dirs, kit):
    ids = encode_prompt(tiny_pair.tokenizer, "A context of a few windows to be restored.", chat=True)
    kv = _target_stored(tiny_pair, ids, "fp8")
    slow = O.SlowTier()
    off = O.offload(kv, ids, "fp8", slow, "c", 8, kit.codec("fp8"), kit.mu("fp8"))
    # A flipped byte in the last window: the restore raises, and returns nothing half done.
    last = off.part(len(off.sizes) - 1)
    blob = bytearray(slow.get(last))
    blob[-1] ^= 0xFF
    slow.put(last, bytes(blob))
    with pytest.raises(C.CodecError, match="checksum"):
        O.restore(off, slow, kit.codec("fp8"), kit.mu("fp8"))
    # A predictor of another tier (the bitsandbytes int8 target), or one whose weights moved by a
    # hair, gives another μ: refused before any number is decoded.
    off = O.offload(kv, ids, "fp8", slow, "d", 8, kit.codec("fp8"), kit.mu("fp8"))
    nudged = P.predictor_of(tiny_pair.target, "q8_0")
    with torch.no_grad():
        next(m for m in nudged.modules() if isinstance(m, torch.nn.Linear)).weight.mul_(1.001)
    for other in (P.predictor_of(tiny_pair.target, "int8", str(tiny_dirs[0])), nudged):
        with pytest.raises(C.CodecError, match="μ differs"):
            O.restore(off, slow, kit.codec("fp8"), O.MuStream(other, "fp8"))
    stats = kit.codec("fp8").stats
    foreign = C.KVCodec(C.Stats(stats.fingerprint, "int8", stats.alpha, stats.beta, stats.sigma * 2, stats.tables))
    with pytest.raises(C.CodecError, match="another codec"):
        O.restore(off, slow, foreign, kit.mu("fp8"))
    with pytest.raises(ValueError, match="needs its codec"):
        O.restore(off, slow)


def test_bad_windows_tiers_and_codec_files_are_one_line_errors(tiny_pair, kit, tiny_dirs, tmp_path):
    ids = encode_prompt(tiny_pair.tokenizer, "short", chat=False)
    kv = _target_stored(tiny_pair, ids, "native")
    slow = O.SlowTier(tmp_path / "slow")
    for window in (0, len(ids) + 1):
        with pytest.raises(ValueError, match="window W must be between 1 and"):
            O.offload(kv, ids, "native", slow, "w", window)
    with pytest.raises(ValueError, match="unknown KV tier"):
        O.offload(kv, ids, "fp4", slow, "w", 1)
    assert not any(slow.folder.iterdir())  # nothing written by a refused call
    path = tmp_path / "codec.npz"
    kit.codec("native").stats.save(path)
    assert load_codec(path, tiny_pair.target, "native").stats.digest == kit.codec("native").stats.digest
    with pytest.raises(ValueError, match="codec for the native KV tier, not fp8"):
        load_codec(path, tiny_pair.target, "fp8")
    from engine.runtime.models import load_model

    other = load_model(str(tiny_dirs[1]), "fp32", torch.device("cpu"))  # the draft: another model
    with pytest.raises(ValueError, match="KV codec for another target"):
        load_codec(path, other)
    (tmp_path / "junk.npz").write_bytes(b"not a codec")
    with pytest.raises(ValueError, match="not a SpecLab KV codec file"):
        load_codec(tmp_path / "junk.npz", tiny_pair.target)


def test_pipelined_model_and_breakeven():
    # Transfer-bound: the makespan is the link's time plus the last decode.
    assert PL.pipelined_seconds([1, 1, 1], [0.1] * 3, [0.2] * 3) == pytest.approx(3.2)
    # Compute-bound: μ and decode of every window, plus the first transfer.
    assert PL.pipelined_seconds([0.1] * 3, [1] * 3, [1] * 3) == pytest.approx(6.0)
    b = PL.breakeven_gbit_s([1000] * 4, [4000] * 4, [1e-6] * 4, [1e-6] * 4)
    link = PL.Link(b)
    coded = PL.pipelined_seconds([link.seconds(1000)] * 4, [1e-6] * 4, [1e-6] * 4)
    assert coded == pytest.approx(4 * link.seconds(4000), rel=1e-3)  # equal restore times at the break-even
    assert PL.breakeven_gbit_s([1] * 2, [2] * 2, [0.0] * 2, [0.0] * 2) == float("inf")  # free compute: coding always wins


POLICIES = ["ar", "fixed:3", "heuristic", "threshold:0.4", "rules", "rakv", "speckv"]


@pytest.mark.parametrize("kv_tier", KV_TIERS)
def test_generation_resumed_from_an_offloaded_cache_equals_an_uninterrupted_one(tiny_pair, kit, kv_tier):
    ids = encode_prompt(tiny_pair.tokenizer, "Tell me a story about a cat.", chat=True)
    ctx = synthetic_context()
    for policy in POLICIES:
        cfg = GenConfig(max_new_tokens=40, kv_tier=kv_tier)
        whole = Generation(tiny_pair, ids, make_policy(policy, ctx), cfg).run()
        paused = Generation(tiny_pair, ids, make_policy(policy, ctx), cfg)
        for i, _ in enumerate(paused):
            if i % 3 == 0:  # every third step: out to the slow tier, coded on odd steps
                paused.offload(O.SlowTier(), window=5, kit=kit if i % 2 else None)
        assert paused.token_ids == whole.token_ids, (policy, kv_tier)
        assert paused._verifier.restore_timing is not None
