"""Fast few-row linears for the target's verify reads on CPUs.

A verify forward reads k + 1 ≤ 9 rows. Speculation pays only if that costs little more than a
one-token step, as on a GPU, where both are bound by reading the weights once. On CPUs torch's
`linear` (MKL's sgemm, transposed weight) takes a path for 2–9 rows that is far worse than one
row: measured on the embedded fp32 target (2-core AMD EPYC, torch 2.13), a 3-row read cost 2.0× a
one-row step, the LM head alone (49,152 × 576) 38 ms for 3 rows against 12 ms for one
(bench decode prints the verify/step ratio per k, `bench/decode.py`). Two other kernels read the
weight once at these shapes:
- `mm(W, xᵀ)ᵀ`: the weight as the left operand, the rows as the right one's columns; best for
  2–4 rows (the 3-row LM head: 7.7 ms);
- oneDNN's inner product over a weight reordered once into its blocked layout: best from 5 rows.
Which one a read takes depends only on its row count, so the same rows in the same read always
round alike; a one-row step stays HF's own `linear` (plain decoding is HF generate, bit for bit).
At fp32 a verify read differs from one-token steps by ~1e-6 whatever the kernel (models.py
leaves fp32 verify unpinned); the tiers whose verify must be batch-invariant (bf16/fp16 exact,
invariance.py) and lossy KV reads (invariance.row_invariant_reads) keep their own paths: this
module patches only fp32 targets on CPU, and make_reads_row_invariant wraps what it leaves."""
from __future__ import annotations

import contextlib
import contextvars
import types
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F

MAX_ROWS = 9  # K_MAX + 1: a verify read; longer reads (prefill, catch-up) are GEMMs MKL does well
MM_ROWS = 4  # up to this many rows mm(W, xᵀ) wins; above it oneDNN's blocked weight does
_STOCK = contextvars.ContextVar("speclab_stock_kernels", default=False)


@contextlib.contextmanager
def stock_kernels() -> Iterator[None]:
    """HF's own linears inside (benchmarks run their HF peers, generate and assisted, as shipped)."""
    token = _STOCK.set(True)
    try:
        yield
    finally:
        _STOCK.reset(token)


def stock() -> bool:
    """Inside `stock_kernels()`: HF's peers run, as shipped."""
    return _STOCK.get()


def _mm(self: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    # [out, in] @ [in, M] → [M, out], copied row-major: a transposed view would reach attention
    # as a query whose last dimension is strided, which sends SDPA to its math path (K/V copied
    # per head, the whole context scaled): a 2-token verify at 3,000 tokens of context then cost
    # 1.5 plain steps where it costs ~1.0 with the query contiguous.
    return torch.mm(self.weight, rows.t()).t().contiguous()


# linear → (its weight's version, the weight in oneDNN's blocked layout): beside the module, not in
# it, so that copying or saving a model never meets an opaque tensor; a weight changed in place
# (a new version) is reordered again.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[int, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _onednn(self: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    version, packed = _PACKED.get(self, (-1, None))
    if version != self.weight._version:  # reordered at the first long verify: one copy per linear
        packed = self.weight.detach().to_mkldnn()
        _PACKED[self] = (self.weight._version, packed)
    return torch._C._nn.mkldnn_linear(rows.contiguous().to_mkldnn(), packed, None).to_dense()


def _kernel_for(m: int):
    return _mm if m <= MM_ROWS or not torch.backends.mkldnn.is_available() else _onednn


def _verify_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    m = x.numel() // x.shape[-1]
    if m == 1 or m > MAX_ROWS or torch.is_grad_enabled() or _STOCK.get():
        return F.linear(x, self.weight, self.bias)
    out = _kernel_for(m)(self, x.reshape(m, x.shape[-1]))  # [M, out]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], -1)


def applies(model: torch.nn.Module) -> bool:
    """fp32 weights on a CPU: where the few-row kernels above were measured to win."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32


def make_verify_fast(model: torch.nn.Module) -> int:
    """Gives every plain nn.Linear of `model` (a target) the few-row kernels; returns how many
    (0 where `applies` says no, or for quantized layers, which are not plain nn.Linear)."""
    if not applies(model):
        return 0
    patched = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and "forward" not in m.__dict__:
            m.forward = types.MethodType(_verify_linear, m)
            patched += 1
    return patched
