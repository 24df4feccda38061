"""torch's int8 weight-only kernel (`_weight_int8pack_mm`: bf16 rows times int8 columns, one bf16
scale per output row), which a SpecLab draft reads its int8-stored matrices through on CPUs.

A draft step reads every weight once, so on a CPU it is bound by memory, and int8 halves what it
reads (`bench draft`'s draft_cost_ratio: docs/architecture.md); the kernel rounds every row alike
whatever the row count (probed at load, invariance.make_row_invariant). Its fp32 form was slower
here than bf16's own matmul: bf16 only. Two traps, both guarded here: its vector loads crash on an
operand that does not start at a 64-byte boundary, and it sums wrongly when the input width is
not a multiple of 16."""
from __future__ import annotations

import torch


def serves(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether a matrix of input width `width` at `dtype` on `device` may go through the kernel."""
    return device.type == "cpu" and dtype == torch.bfloat16 and width % 16 == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous at a 64-byte boundary, copied if it is not (a view at an offset, a
    safetensors file's tensor)."""
    return t if t.is_contiguous() and t.data_ptr() % 64 == 0 else t.clone(memory_format=torch.contiguous_format)


def pack(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 matrix [out, in], scales [out] at `dtype`): what `matmul` reads."""
    return aligned(q), scale.to(dtype)


def matmul(rows: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """rows [M, in] → [M, out]: rows · int8ᵀ · scale."""
    return torch.ops.aten._weight_int8pack_mm(aligned(rows), *packed)
