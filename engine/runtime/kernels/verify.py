"""Few-row linears for the target's verify reads on CPUs, each linear's kernel chosen per row count
by a probe on the machine it runs on (runtime/kernels/probe.py).

A verify forward reads k + 1 ≤ 9 rows. Speculation pays only if that costs little more than a
one-token step, as on a GPU, where both are bound by reading the weights once. On CPUs torch's
`linear` (MKL's sgemm, transposed weight) may take a path for 2–9 rows that is far worse than one
row, and which path reads the weight once differs from CPU to CPU. The candidates:
- `stock`: torch's own `linear`;
- `mm`: `mm(W, xᵀ)ᵀ`, the weight as the left operand, the rows as the right one's columns;
- `onednn`: oneDNN's inner product over a weight reordered once into its blocked layout.
Which one a read takes depends only on the linear's shape and the read's row count, so the same
rows in the same read always round alike; a one-row step stays torch's own `linear` (plain
decoding is HF generate, bit for bit). At fp32 a verify read differs from one-token steps by ~1e-6
whatever the kernel (models.py leaves fp32 verify unpinned); the tiers whose verify must be
batch-invariant (bf16/fp16 exact, invariance.py) and lossy KV reads (invariance.row_invariant_reads)
keep their own paths: this module patches only fp32 targets on CPU in fast mode
(`kernel_probe.make_verify_fast`; an exact CPU target reads every row through the row-invariant
kernels of runtime/kernels/rowdot.py instead), and make_reads_row_invariant wraps what it leaves. $SPECLAB_KERNELS names one candidate to use
everywhere instead of the probe's choice (for a bench or a test; default `probe`)."""
from __future__ import annotations

import contextlib
import contextvars
import os
import types
import weakref
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

MAX_ROWS = 9  # K_MAX + 1: a verify read; longer reads (prefill, catch-up) are GEMMs MKL does well
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


def _stock(self: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, self.weight)


def _mm(self: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    # [out, in] @ [in, M] → [M, out], copied row-major: a transposed view would reach attention
    # as a query whose last dimension is strided, which sends SDPA to its math path (K/V copied
    # per head, the whole context scaled).
    return torch.mm(self.weight, rows.t()).t().contiguous()


# linear → (its weight's version, the weight in oneDNN's blocked layout): beside the module, not in
# it, so that copying or saving a model never meets an opaque tensor; a weight changed in place
# (a new version) is reordered again.
_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[int, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _onednn(self: torch.nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    version, packed = _PACKED.get(self, (-1, None))
    if version != self.weight._version:  # reordered at the first read: one copy per linear
        packed = self.weight.detach().to_mkldnn()
        _PACKED[self] = (self.weight._version, packed)
    return torch._C._nn.mkldnn_linear(rows.contiguous().to_mkldnn(), packed, None).to_dense()


# rows [M, in] → [M, out], no bias (added by the caller)
KERNELS: dict[str, Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]] = {
    "stock": _stock, "mm": _mm, "onednn": _onednn}

# A patched linear's kernel per row count (index m: an m-row read), from the machine's probe: an
# attribute of the module, so that a copy of the model reads as the model does.
CHOSEN = "speclab_kernels"


def drop_packed(linears: list[torch.nn.Linear]) -> None:
    """Forgets the oneDNN copies of `linears`' weights (a probe's; a chosen read makes its own)."""
    for lin in linears:
        _PACKED.pop(lin, None)


def _verify_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    m = x.numel() // x.shape[-1]
    if m == 1 or m > MAX_ROWS or torch.is_grad_enabled() or _STOCK.get():
        return F.linear(x, self.weight, self.bias)
    name = getattr(self, CHOSEN)[m]
    if name == "stock":
        return F.linear(x, self.weight, self.bias)
    out = KERNELS[name](self, x.reshape(m, x.shape[-1]))  # [M, out]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], -1)


def applies(model: torch.nn.Module) -> bool:
    """fp32 weights on a CPU: where few-row reads can take another kernel without leaving the
    tier's exactness (fp32 verify is not pinned to one-token steps)."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32


def forced() -> str:
    """$SPECLAB_KERNELS: `probe` (the default) or one candidate for every read."""
    name = os.environ.get("SPECLAB_KERNELS", "probe") or "probe"
    if name != "probe" and name not in KERNELS:
        raise ValueError(f"SPECLAB_KERNELS is {name!r}: use probe or one of {', '.join(KERNELS)}")
    return name


def patch(linear: torch.nn.Linear, kernels: tuple[str, ...]) -> None:
    """Gives `linear` (a plain nn.Linear of a target) `kernels[m]` for an m-row verify read."""
    assert type(linear) is torch.nn.Linear and all(k in KERNELS for k in kernels), kernels
    setattr(linear, CHOSEN, kernels)
    linear.forward = types.MethodType(_verify_linear, linear)


def patched(model: torch.nn.Module) -> int:
    """How many of `model`'s linears read verifies through a chosen kernel."""
    return sum(1 for m in model.modules() if hasattr(m, CHOSEN))
