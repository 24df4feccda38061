"""The few-row verify kernels (engine/runtime/verify_kernels.py): every row count gives torch's
linear to fp32 rounding, one-row steps and stock reads stay torch's own bit for bit, a weight changed
in place is read anew, and a patched model still copies (the oneDNN weight lives beside it)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from engine.runtime import verify_kernels


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 200, bias=False))


def _reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    a, _, b = model
    return F.linear(torch.relu(F.linear(x, a.weight, a.bias)), b.weight)


@pytest.mark.parametrize("rows", range(1, verify_kernels.MAX_ROWS + 3))
def test_every_row_count_reads_what_torch_linear_reads(rows):
    model = _model()
    assert verify_kernels.make_verify_fast(model) == 2
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
    verify_kernels.make_verify_fast(model)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model(x.clone()))  # same rows, same kernel, same rounding


def test_a_weight_changed_in_place_is_read_anew_and_the_model_still_copies():
    model = _model()
    verify_kernels.make_verify_fast(model)
    x = torch.randn(1, 6, 64)  # above MM_ROWS: oneDNN's reordered weight where it is available
    with torch.no_grad():
        model(x)
        model[2].weight.mul_(2.0)
        torch.testing.assert_close(model(x), _reference(model, x), atol=1e-5, rtol=1e-5)
        twin = copy.deepcopy(model)  # no opaque tensor inside the module to trip the copy
        torch.testing.assert_close(twin(x), model(x), atol=1e-5, rtol=1e-5)


def test_only_fp32_cpu_models_are_patched():
    assert verify_kernels.make_verify_fast(_model().to(torch.bfloat16)) == 0


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
    verify_kernels.make_verify_fast(model)
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
