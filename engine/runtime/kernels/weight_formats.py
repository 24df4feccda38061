"""The weight formats the row-invariant kernels read (csrc/rowdot.cpp): fp32, bf16 (row-major, or in
AMX tiles), int8 with one scale per output row, and 4 bits per group of 32 inputs with a scale and
a minimum (llama.cpp's Q4_1 layout). Each packs a float weight and unpacks to the fp32 weight the
kernel multiplies by, so a test can check the kernel against torch's linear on the same numbers."""
from __future__ import annotations

import torch

GROUP = 32  # inputs per 4-bit scale and minimum (llama.cpp's Q4_1 block)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, K] → (q int8 [O, K], scale fp32 [O]): symmetric, one scale per output row."""
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, K] → (packed uint8 [O, K/2], scale_min fp32 [O, K/32, 2]): per group of 32 inputs
    w ≈ q · scale + min with q in 0…15; byte j of a group holds q[j] (low nibble) and q[j + 16]."""
    o, k = w.shape
    g = w.reshape(o, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)  # [O, G, 32]
    packed = (q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)).reshape(o, k // 2).contiguous()
    return packed, torch.stack([scale, lo], -1).contiguous()


TILE_ROWS, TILE_K = 16, 32  # an AMX tile of a weight: 16 output rows × 32 inputs at bf16 (1 KB)


def tiled(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [O, K] in the AMX kernel's order [O/16, K/32, 16, 32]: each tile contiguous,
    a block of 16 output rows tile after tile along K, so a read streams it in order."""
    o, k = w.shape
    return w.view(o // TILE_ROWS, TILE_ROWS, k // TILE_K, TILE_K).permute(0, 2, 1, 3).contiguous()


def untiled(t: torch.Tensor) -> torch.Tensor:
    """`tiled`'s inverse: the weight [O, K]."""
    blocks, steps = t.shape[:2]
    return t.permute(0, 2, 1, 3).reshape(blocks * TILE_ROWS, steps * TILE_K)


def dequantize(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The fp32 weight [O, K] a format's tensors stand for (what the kernel multiplies by)."""
    if fmt in ("fp32", "bf16"):
        return (untiled(tensors[0]) if tensors[0].dim() == 4 else tensors[0]).float()
    if fmt == "int8":
        q, scale = tensors
        return q.float() * scale[:, None]
    packed, sm = tensors
    o = packed.shape[0]
    nib = packed.reshape(o, -1, GROUP // 2)
    q = torch.cat([nib & 15, nib >> 4], -1).float()  # [O, G, 32]
    return (q * sm[..., :1] + sm[..., 1:]).reshape(o, -1)
