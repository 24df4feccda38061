"""The row-invariant kernels (engine/runtime/kernels/rowdot.py): every row of a read rounds as that row
read alone, at every weight format and for attention, over random shapes; a target on them
decodes speculatively exactly as it decodes plainly, at every CPU tier; and where they cannot
run, one line says why."""
import pytest
import torch
import torch.nn.functional as F

from engine.runtime.kernels import rowdot

pytestmark = pytest.mark.skipif(rowdot.unavailable() is not None, reason=f"{rowdot.unavailable()}")
ROWS = (1, 2, 3, 4, 5, 7, 9, 70)  # plain steps, verifies of γ = 1…8, a prefill


def _linear(out: int, inp: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(inp, out, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05)
    return lin


@pytest.mark.parametrize("fmt", [*rowdot.FORMATS, "bf16 vector"])  # bf16 vector: AMX off (tiles where it is on)
@pytest.mark.parametrize("out,inp", [(64, 64), (192, 576), (577, 128), (96, 1536)])
def test_every_row_rounds_as_it_does_alone(fmt, out, inp, monkeypatch):
    if fmt == "bf16 vector":
        monkeypatch.setenv("SPECLAB_AMX", "off")
        fmt = "bf16"
    lin = _linear(out, inp, seed=out + inp)
    row_lin = rowdot.RowLinear(lin, fmt)
    assert (row_lin.tensors[0].dim() == 4) == (fmt == "bf16" and out % 16 == 0 and rowdot.amx())
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, inp, generator=gen).to(dtype)
            full = row_lin(x)
            alone = torch.cat([row_lin(x[i : i + 1].clone()) for i in range(m)])
            assert torch.equal(full, alone), (fmt, out, inp, m)
            # and the rows of a 3-D read ([1, S, in], as HF passes them) are the same rows
            assert torch.equal(row_lin(x[None])[0], full)
            ref = F.linear(x.float(), rowdot.dequantize(fmt, row_lin.tensors))
            tol = 2e-2 if fmt == "bf16" else 1e-5
            assert torch.allclose(full.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), (fmt, m)


def test_amx_tiles_hold_the_weight(monkeypatch):
    w = _linear(96, 128, seed=5).weight.detach().bfloat16()
    t = rowdot.tiled(w)
    assert t.shape == (6, 4, 16, 32) and torch.equal(t[1, 2], w[16:32, 64:96]) and torch.equal(rowdot.untiled(t), w)
    row_lin = rowdot.RowLinear(torch.nn.Linear(128, 96, bias=False).requires_grad_(False), "bf16")
    assert torch.equal(row_lin.weight, rowdot.untiled(row_lin.tensors[0]) if rowdot.amx() else row_lin.tensors[0])
    monkeypatch.setenv("SPECLAB_AMX", "off")  # the vector path
    assert not rowdot.amx() and rowdot.RowLinear(torch.nn.Linear(128, 96, bias=False), "bf16").tensors[0].dim() == 2


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_stay_close_to_the_float_ones(fmt):
    w = _linear(256, 576, seed=3).weight.detach()
    back = rowdot.dequantize(fmt, (rowdot.quantize_int8 if fmt == "int8" else rowdot.quantize_int4)(w))
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < (0.01 if fmt == "int8" else 0.1), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,past", [(9, 3, 0), (9, 3, 117), (4, 4, 40), (2, 1, 1)])
def test_attention_rows_round_as_one_query_steps(dtype, heads, kv_heads, past):
    gen = torch.Generator().manual_seed(heads + past)
    s = 9
    q = torch.randn(1, heads, s, 64, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, past + s, 64, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, past + s, 64, generator=gen).to(dtype)
    full, _ = rowdot.attention(None, q, k, v, scaling=0.125)  # [1, S, H, D]
    for i in range(s):
        n = past + i + 1
        one, _ = rowdot.attention(None, q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scaling=0.125)
        assert torch.equal(one[0, 0], full[0, i]), (i, dtype)
    mask = torch.ones(s, past + s, dtype=torch.bool).tril(past)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125,
                                         enable_gqa=heads != kv_heads).transpose(1, 2)
    assert torch.allclose(full.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory):
    """A tiny random Llama whose widths the kernels read (hidden 256, head size 64) and a noisy copy."""
    from tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("wide")
    target = save_tiny_llama(root / "target", seed=0, hidden=256)
    draft = save_tiny_llama(root / "draft", seed=1, base=target, noise=0.1)
    return target, draft


@pytest.mark.parametrize("tier", ["fp32", "bf16", "int8", "int4"])
def test_speculative_output_equals_plain_decoding_at_every_cpu_tier(wide_dirs, tier):
    from engine.decode.policies import make_policy
    from engine.lab.generation import GenConfig, Generation
    from engine.runtime.models import load_pair

    pair = load_pair(str(wide_dirs[0]), str(wide_dirs[1]), target_tier=tier, device="cpu")
    assert pair.exact_verify and pair.kernel_set.startswith(f"rowdot-{tier}-")
    assert pair.kernel_set.endswith("-amx") == (tier == "bf16" and rowdot.amx())  # tiles round bf16 their own way
    assert pair.fast_verify_linears == rowdot.converted(pair.target)[0] > 0
    ids = pair.tokenizer("the cache holds the keys of every token", add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode():  # HF generate over the same model: the reference
        ref = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40,
                                   do_sample=False)[0, len(ids):].tolist()
    for policy in ("ar", "fixed:1", "fixed:4", "fixed:8", "fixed:3@ngram"):
        g = Generation(pair, ids, make_policy(policy), GenConfig(max_new_tokens=40)).run()
        assert g.token_ids == ref, (tier, policy)  # token for token, no margin excused


def test_verify_logits_equal_plain_steps_bit_for_bit(wide_dirs):
    from engine.runtime.forward import crop_to, forward_logits
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), "fp32", torch.device("cpu"))
    rowdot.convert(model, "fp32")
    ids = list(range(5, 45))
    with torch.inference_mode():
        _, cache = forward_logits(model, ids, None, 1)
        steps = []
        for t in (7, 8, 9, 10, 11):
            logits, cache = forward_logits(model, [t], cache, 1)
            steps.append(logits)
        crop_to(cache, len(ids))
        verify, _ = forward_logits(model, [7, 8, 9, 10, 11], cache, 5)
    assert torch.equal(torch.cat(steps), verify)
    with torch.inference_mode():  # a whole prefill equals a prefix read then the rest (prefix reuse)
        whole, _ = forward_logits(model, ids, None, 1)
        _, c2 = forward_logits(model, ids[:23], None, 1)
        split, _ = forward_logits(model, ids[23:], c2, 1)
    assert torch.equal(whole, split)


def test_where_the_kernels_cannot_run_one_line_says_why(monkeypatch, wide_dirs):
    from engine.runtime import models

    monkeypatch.setenv("SPECLAB_ROWDOT", "off")
    rowdot._load.cache_clear()
    try:
        with pytest.raises(ValueError, match="tier int4 on this CPU needs SpecLab's row-invariant kernels: turned off") as e:
            models.load_model(str(wide_dirs[0]), "int4", torch.device("cpu"))
        assert "\n" not in str(e.value)
        pair = models.load_pair(str(wide_dirs[0]), str(wide_dirs[1]), target_tier="fp32", device="cpu")
        assert rowdot.converted(pair.target)[0] == 0 and not pair.kernel_set.startswith("rowdot")
    finally:
        monkeypatch.delenv("SPECLAB_ROWDOT")
        rowdot._load.cache_clear()
    with pytest.raises(ValueError, match="int4 is a CPU tier"):
        models._quantization("int4", torch.device("cuda"))


def test_int_tiers_refuse_a_model_whose_widths_the_kernels_cannot_read(tiny_dirs):
    from engine.runtime.models import load_model, load_pair

    with pytest.raises(ValueError, match=r"tier int4 on a CPU reads through SpecLab's int4 kernels, which cannot read "
                                         r"this model \(input widths \[32\] are not multiples of 64\)"):
        load_model(str(tiny_dirs[0]), "int4", torch.device("cpu"))
    pair = load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), target_tier="fp32", device="cpu")
    assert rowdot.converted(pair.target)[0] == 0  # converted whole or not at all: here not


def test_a_damaged_build_is_built_again(tmp_path):
    """A library file cut short (a build killed by hand) is compiled again at the next load, in a
    fresh process (a process keeps the library it loaded)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECLAB_KERNEL_DIR=str(tmp_path))
    code = ("from engine.runtime.kernels import rowdot; assert rowdot.unavailable() is None, rowdot.unavailable(); "
            "import torch; print(rowdot.attention(None, *[torch.ones(1, 1, 2, 64)] * 3)[0].shape)")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    (lib,) = tmp_path.glob("rowdot-*.so")
    lib.write_bytes(b"not a library")
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "torch.Size([1, 2, 1, 64])" in again.stdout, again.stderr
    assert lib.stat().st_size > 10_000


def test_kernels_command_times_the_row_invariant_kernels_against_stock(wide_dirs):
    import json
    import subprocess
    import sys

    from engine.runtime.kernels.probe import cpu_name

    cmd = [sys.executable, "-m", "engine", "kernels", "--target", str(wide_dirs[0]), "--draft", str(wide_dirs[1]),
           "--tiers", "fp32,int8"]
    out = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300, check=True).stdout)
    for rep, tier in zip(out, ("fp32", "int8")):
        assert rep["cpu"] == cpu_name() and rep["kernel_set"].startswith(f"rowdot-{tier}-")
        assert {r["rows"] for r in rep["rows"]} == set(range(1, 10)) and all(r["kernel"] == "rowdot" for r in rep["rows"])
        assert all(r["rowdot_ms"] > 0 and r["stock_ms"] > 0 and r["vs_stock"] > 0 for r in rep["rows"])
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "a forward's linears: 1 rows" in text and "× stock" in text


@pytest.mark.parametrize("tier", ["fp32", "bf16", "int8", "int4"])
def test_the_lean_target_read_is_hf_forward_bit_for_bit(wide_dirs, tier):
    """A converted target reads without HF's module machinery (lean_body.TargetBody): its logits
    and cache equal HF's forward over the same model, prefill, plain step and verify alike, and
    hooks on the final norm (the EAGLE head's feature tap) still see every read."""
    from engine.runtime.forward import TARGET_BODY, forward_logits
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), tier, torch.device("cpu"))
    if tier in ("fp32", "bf16"):
        rowdot.convert(model, tier)
    lean = getattr(model, TARGET_BODY)
    seen = []
    model.get_decoder().norm.register_forward_hook(lambda mod, args, out: seen.append(out.shape[1]))
    reads = [(list(range(5, 45)), 3), ([7], 1), ([8, 9, 10, 11, 12], 5)]
    outs = {}
    with torch.inference_mode():
        for name in ("hf", "lean"):
            if name == "hf":
                delattr(model, TARGET_BODY)
            else:
                setattr(model, TARGET_BODY, lean)
            cache, outs[name] = None, []
            for ids, keep in reads:
                logits, cache = forward_logits(model, ids, cache, keep)
                outs[name].append(logits)
            outs[name].append(torch.cat([layer.keys[..., : cache.get_seq_length(), :] for layer in cache.layers]))
    assert all(torch.equal(a, b) for a, b in zip(outs["hf"], outs["lean"]))
    assert seen == [40, 1, 5] * 2


def test_the_build_here_proves_itself_row_invariant_at_load():
    """Each build checks its own rows at load (a compiler that contracted or vectorized one row
    count otherwise would be refused, torch's kernels then used): here it passes."""
    assert rowdot._not_row_invariant() is None


@pytest.mark.parametrize("tier,tol", [("fp32", 1e-4), ("bf16", 0.15)])
def test_the_kernels_modules_compute_what_hfs_torch_modules_do(wide_dirs, tier, tol):
    """A converted Llama's norms, SwiGLU and rotary run the kernels' own steps (row_llama.py):
    their logits agree with HF's torch modules over the same weights to the dtype's rounding (so
    the bit-for-bit checks above compare two correct reads, not two equal wrong ones), and a
    verify-length read's rows equal the same rows read one by one."""
    from engine.runtime import row_llama
    from engine.runtime.forward import TARGET_BODY, forward_logits
    from engine.runtime.kernels.verify import stock_kernels
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), tier, torch.device("cpu"))
    rowdot.convert(model, tier)
    assert getattr(model, TARGET_BODY, None) is not None and row_llama.refuses(model) is None
    assert type(model.get_decoder().layers[0].mlp).__name__ == "RowMLP"
    ids = list(range(3, 40))
    with torch.inference_mode():
        ours, _ = forward_logits(model, ids, None, len(ids))
        with stock_kernels():
            hf, _ = forward_logits(model, ids, None, len(ids))
        cache, rows = None, []
        for i in ids:
            out, cache = forward_logits(model, [i], cache, 1)
            rows.append(out)
    assert torch.equal(torch.cat(rows), ours)
    assert (ours - hf).abs().max() <= tol * hf.abs().max(), (ours - hf).abs().max()


def test_a_model_the_fused_read_does_not_replicate_keeps_hfs_modules(wide_dirs):
    from engine.runtime import row_llama
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), "fp32", torch.device("cpu"))
    model.config.hidden_act = "gelu"
    assert row_llama.refuses(model) == "a Llama with another activation or biases"
    assert not row_llama.install(model)
    assert type(model.get_decoder().layers[0].mlp).__name__ == "LlamaMLP"


def test_a_build_that_crashes_in_its_trial_run_costs_one_line(tmp_path):
    """A new build is loaded and checked in a child process first: one that dies there (here a
    stand-in that kills its process on load) is refused with one line and its verdict kept, and
    this process goes on."""
    import subprocess

    lib = tmp_path / "rowdot-test.so"
    src = tmp_path / "crash.cpp"
    src.write_text("#include <csignal>\n__attribute__((constructor)) static void die() { std::raise(SIGSEGV); }\n")
    subprocess.run([rowdot._compiler(), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=120)
    why = rowdot._tried(lib, rowdot._compiler())
    assert why == "the kernels built here crashed in a trial run (SIGSEGV): torch's kernels instead"
    assert lib.with_suffix(".verdict").read_text() == why  # the next process reads it, tries nothing
    assert rowdot._tried(lib, "no-such-compiler") == why


@pytest.mark.parametrize("draft_tier", ["fp32", "bf16"])
def test_a_cpu_draft_reads_through_the_kernels_row_invariantly(wide_dirs, draft_tier):
    """A plain Llama draft on a CPU is put on the kernels with its target (rowdot.convert_draft):
    its fused body read equals HF's forward over it bit for bit, and any split of a catch-up read
    reaches the same state and cache (what replay needs), without a probe."""
    from engine.runtime import invariance
    from engine.runtime.forward import BODY, forward_last_state
    from engine.runtime.kv.cache import new_cache
    from engine.runtime.models import load_pair

    pair = load_pair(str(wide_dirs[0]), str(wide_dirs[1]), target_tier="fp32", draft_tier=draft_tier, device="cpu")
    assert pair.draft_row_invariant and rowdot.converted(pair.draft) == (14, draft_tier)  # 2 layers × 7; head kept
    assert invariance._reads_agree(pair.draft)
    body = getattr(pair.draft, BODY)
    ids = list(range(3, 30))
    with torch.inference_mode():
        outs = []
        for lean in (True, False):
            setattr(pair.draft, BODY, body) if lean else delattr(pair.draft, BODY)
            cache = new_cache(pair.draft)
            first, cache = forward_last_state(pair.draft, ids[:20], cache)
            second, cache = forward_last_state(pair.draft, ids[20:], cache)
            outs.append((first, second, cache.layers[0].keys.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("tier", ["fp32", "bf16", "int8"])
def test_the_lean_tree_read_is_hfs_masked_read_bit_for_bit(wide_dirs, tier):
    """A token tree's read on the fused body (row_llama.TargetBody, each row over its context and
    its path) equals HF's module-by-module read of the tree under the 4-D mask, logits and cache,
    for a tree of 18 nodes (past one tile of rows, up to the streamed reads' limit)."""
    from engine.decode.tree import DraftTree
    from engine.runtime.forward import TARGET_BODY, forward_tree_logits
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), tier, torch.device("cpu"))
    if tier in ("fp32", "bf16"):
        rowdot.convert(model, tier)
    tree = DraftTree.bushy([20 + i for i in range(18)])  # two children a node, breadth first
    def read(cache, start: int) -> list[torch.Tensor]:
        logits, _ = forward_tree_logits(model, [7] + tree.tokens, cache, tree.mask(), tree.positions(start))
        return [logits] + [layer.keys[..., : cache.get_seq_length(), :].clone() for layer in cache.layers]

    outs = _fused_and_hf(model, TARGET_BODY, read)
    assert all(torch.equal(a, b) for a, b in zip(outs["hf"], outs["lean"]))


def _fused_and_hf(model, attr: str, read) -> dict[str, list[torch.Tensor]]:
    """read(cache, start) after a 40-token context, on the fused body (`attr`) and on HF's
    modules (the attribute taken away, then put back), the cache cropped back after each."""
    from engine.runtime.forward import crop_to, forward_logits
    from engine.runtime.kv.cache import new_cache

    lean, outs = getattr(model, attr), {}
    with torch.inference_mode():
        _, cache = forward_logits(model, list(range(5, 45)), new_cache(model), 1)
        start = cache.get_seq_length()
        try:
            for name in ("lean", "hf"):
                if name == "hf":
                    delattr(model, attr)
                outs[name] = read(cache, start)
                crop_to(cache, start)
        finally:
            setattr(model, attr, lean)
    return outs


def test_a_tree_level_read_after_cached_levels_is_hfs_masked_read(wide_dirs):
    """A draft grows a tree level by level, earlier levels kept in its cache ([S, T] masks, T > S):
    the fused body's states equal HF's masked read of the same rows, bit for bit."""
    from engine.runtime import row_llama
    from engine.runtime.forward import BODY, forward_tree_states
    from engine.runtime.models import load_model

    model = load_model(str(wide_dirs[0]), "fp32", torch.device("cpu"))
    rowdot.convert(model, "fp32")
    assert row_llama.install(model, draft=True)
    # level 0: the root; level 1: two children of the root; level 2: a child of each, over the cache
    reads = [([7], [[True]], [0]), ([20, 21], [[True, True, False], [True, False, True]], [1, 1]),
             ([30, 31], [[True, True, False, True, False], [True, False, True, False, True]], [2, 2])]

    def read(cache, start: int) -> list[torch.Tensor]:
        return [h for ids, allowed, depth in reads for h in forward_tree_states(
            model, ids, cache, allowed, [start + d for d in depth], list(range(len(ids))))]

    outs = _fused_and_hf(model, BODY, read)
    assert len(outs["lean"]) == 5 and all(torch.equal(a, b) for a, b in zip(outs["hf"], outs["lean"]))
