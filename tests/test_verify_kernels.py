"""The few-row verify kernels (engine/runtime/kernels/verify.py) and the probe that chooses them
per machine (engine/runtime/kernels/probe.py): every kernel at every row count gives torch's linear
to fp32 rounding, one-row steps and stock reads stay torch's own bit for bit, a weight changed in
place is read anew, a patched model still copies (the oneDNN weight lives beside it), and the
probe's choice is cached per machine, never slower than stock where it measured, and a cache from
another machine is not read."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

from engine.runtime.kernels import probe as kernel_probe
from engine.runtime.kernels import verify as verify_kernels


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 200, bias=False))


def _reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    a, _, b = model
    return F.linear(torch.relu(F.linear(x, a.weight, a.bias)), b.weight)


@pytest.mark.parametrize("kernel", ["probe", *verify_kernels.KERNELS])
@pytest.mark.parametrize("rows", range(1, verify_kernels.MAX_ROWS + 3))
def test_every_row_count_reads_what_torch_linear_reads(rows, kernel, monkeypatch):
    monkeypatch.setenv("SPECLAB_KERNELS", kernel)
    model = _model()
    assert kernel_probe.make_verify_fast(model) and verify_kernels.patched(model) == 2
    x = torch.randn(1, rows, 64)  # [B, S, D]: a verify read of `rows` positions
    with torch.no_grad():
        got, want = model(x), _reference(model, x)
        with verify_kernels.stock_kernels():
            stock = model(x)
    assert got.shape == want.shape == (1, rows, 200)
    assert got.is_contiguous()  # row-major, as torch's: a strided query sends SDPA to its math path
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(stock, want)  # HF's peers in the benches read through torch's own linear
    if rows == 1 or rows > verify_kernels.MAX_ROWS:  # one-token steps and prefills are untouched
        assert torch.equal(got, want)


def test_a_read_depends_only_on_its_row_count():
    model = _model()
    kernel_probe.make_verify_fast(model)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model(x.clone()))  # same rows, same kernel, same rounding


@pytest.mark.parametrize("kernel", list(verify_kernels.KERNELS))
def test_a_weight_changed_in_place_is_read_anew_and_the_model_still_copies(kernel, monkeypatch):
    monkeypatch.setenv("SPECLAB_KERNELS", kernel)
    model = _model()
    kernel_probe.make_verify_fast(model)
    x = torch.randn(1, 6, 64)  # oneDNN reads its reordered weight: it must be made again
    with torch.no_grad():
        model(x)
        model[2].weight.mul_(2.0)
        torch.testing.assert_close(model(x), _reference(model, x), atol=1e-5, rtol=1e-5)
        twin = copy.deepcopy(model)  # no opaque tensor inside the module to trip the copy
        torch.testing.assert_close(twin(x), model(x), atol=1e-5, rtol=1e-5)


def test_only_fp32_cpu_models_are_patched():
    model = _model().to(torch.bfloat16)
    assert kernel_probe.make_verify_fast(model) == "" and verify_kernels.patched(model) == 0


def test_a_bad_kernel_name_is_one_line(monkeypatch):
    monkeypatch.setenv("SPECLAB_KERNELS", "fastest")
    with pytest.raises(ValueError, match="SPECLAB_KERNELS is 'fastest': use probe or one of stock, mm, onednn"):
        kernel_probe.make_verify_fast(_model())


def test_the_probe_is_cached_per_machine_and_never_slower_than_stock(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECLAB_KERNEL_DIR", str(tmp_path))
    model = _model()
    kernel_set = kernel_probe.make_verify_fast(model)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and "choosing verify kernels" not in capsys.readouterr().err
    table = json.loads(files[0].read_text())
    assert table["machine"]["cpu"] == kernel_probe.cpu_name() and table["machine"]["torch"] == torch.__version__
    assert set(table["choice"]) == {"96×64", "200×96"}
    rows = kernel_probe.KernelTable(kernel_probe.Machine(**table["machine"]), table["choice"], table["ms"]).rows()
    assert len(rows) == 2 * len(kernel_probe.ROWS) and all(r["vs_stock"] <= 1.0 for r in rows)
    assert all(r["kernel"] == "stock" or r["vs_stock"] < 1 - kernel_probe.MARGIN for r in rows)
    # A second load reads the cache: no probe, the same kernel set.
    monkeypatch.setattr(kernel_probe, "probe_shape", lambda *a: pytest.fail("probed again"))
    assert kernel_probe.make_verify_fast(_model()) == kernel_set


@pytest.mark.parametrize("damage", ["other machine", "damaged"])
def test_a_cache_from_another_machine_or_damaged_is_not_read(tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("SPECLAB_KERNEL_DIR", str(tmp_path))
    kernel_probe.make_verify_fast(_model())
    path = next(tmp_path.glob("*.json"))
    table = json.loads(path.read_text())
    if damage == "other machine":  # a file copied from another CPU under this machine's name
        table["machine"]["cpu"] = "AMD EPYC 7B13"
        table["choice"] = {s: ["mm"] * len(c) for s, c in table["choice"].items()}
        path.write_text(json.dumps(table))
    else:
        path.write_text(path.read_text()[:40])
    capsys.readouterr()
    model = _model()
    kernel_probe.make_verify_fast(model)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: kernel probe cache {path}")
    assert ("AMD EPYC 7B13" in err[0]) == (damage == "other machine")
    again = json.loads(path.read_text())  # probed anew for this machine and written in its place
    assert again["machine"]["cpu"] == kernel_probe.cpu_name()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batched_verify_reads_grouped_kv_heads_bit_for_bit_as_hf(tmp_path, monkeypatch, dtype):
    """A verify of k + 1 rows over a cache runs SDPA on the KV heads as stored (no copy per query
    head, `invariance._grouped_verify`): the logits are HF's path's bit for bit; HF's peers
    (stock kernels), prefills and one-token steps keep HF's path."""
    from transformers import AutoModelForCausalLM

    from engine.runtime import invariance
    from engine.runtime.forward import crop_to, forward_logits
    from tiny import save_tiny_llama

    path = save_tiny_llama(tmp_path / "m", seed=5, layers=2, hidden=64)  # 4 query heads over 2 KV heads
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=invariance.register()).eval()
    kernel_probe.make_verify_fast(model)
    calls = []
    grouped = invariance._grouped_verify
    monkeypatch.setattr(invariance, "_grouped_verify", lambda *a: calls.append(a[1].shape[2]) or grouped(*a))
    ids = torch.randint(5, 80, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        _, cache = forward_logits(model, ids[:30], None, 1)  # the prefill: HF's causal path
        assert calls == []
        for k in (1, 4, 8):
            mine, _ = forward_logits(model, ids[30 : 31 + k], cache, k + 1)
            crop_to(cache, 30)
            with monkeypatch.context() as m:
                m.setattr(invariance, "_grouped_verify_serves", lambda mask, kwargs: False)
                hf, _ = forward_logits(model, ids[30 : 31 + k], cache, k + 1)
            crop_to(cache, 30)
            assert torch.equal(mine, hf), k
        assert calls == [2, 2, 5, 5, 9, 9]  # each layer, each verify
        with verify_kernels.stock_kernels():
            forward_logits(model, ids[30:35], cache, 5)
        crop_to(cache, 30)
        forward_logits(model, ids[30:31], cache, 1)
    assert calls == [2, 2, 5, 5, 9, 9]
