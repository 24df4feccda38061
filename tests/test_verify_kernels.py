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
