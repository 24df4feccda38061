"""KV tiers: how the target's cache stores each token's keys and values, and what attention reads.

A lossy tier is what attention reads during generation, so it changes outputs. Each token's KV
is quantized on its own, per (token, KV head) over the head dimension: how many tokens a forward
wrote at once (a verify of k drafted tokens, a prefill, one plain step) cannot change a token's
stored values, so speculative output at a tier equals plain decoding at that tier, and replay
stays exact.

- `native`: the model's own dtype (fp32, bf16), stored as computed.
- `fp8`: e4m3 codes times a power-of-two scale per (token, head), the exponent in one int8. A
  power of two makes dequantization exact in any float dtype, and e4m3's relative precision is
  the same over its whole normal range (2^-6 … 448), so the only job of the scale is to keep the
  token's largest value under 448 without wasting the top binade: a per-token scale follows
  outlier tokens (the attention sink's keys are ~10× the rest) that one static scale per layer
  would either clip or push every other token into e4m3's subnormals. Cost: 8 bits per 64
  values (0.125 bit a value), and the codec codes the exponent against the predictor's.
- `int8`: symmetric integers in [-127, 127] times a bf16 scale amax/127 per (token, head), the
  usual layout of int8 KV caches (KIVI, vLLM's per-token quantization); 16 bits per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.base.names import KV_TIERS, check_kv_tier  # noqa: F401 - KV_TIERS: re-exported

FP8_MAX = 448.0  # largest finite e4m3fn value
INT8_MAX = 127


@dataclass(frozen=True)
class Quantized:
    """One tier's stored form of a [..., S, D] block: codes [..., S, D] and a scale [..., S, 1]
    (a power-of-two exponent for fp8, a bf16 factor for int8, None for native)."""

    codes: torch.Tensor
    scale: torch.Tensor | None


def _fp8_exponent(x: torch.Tensor) -> torch.Tensor:
    # The smallest e with amax / 2^e ≤ 448; all-zero rows get the lowest exponent that still
    # leaves their zeros exact (any e would).
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [..., S, 1]
    e = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-126, 127)
    e = torch.where(amax > 0, e, torch.full_like(e, -126))
    return e.to(torch.int8)


def quantize(x: torch.Tensor, tier: str) -> Quantized:
    """x: [..., S, D] keys or values as the model computed them."""
    if tier == "native":
        return Quantized(x, None)
    if not torch.isfinite(x).all():
        raise ValueError("KV holds NaN or inf: a lossy tier cannot store it")
    limit = torch.finfo(x.dtype).max  # what x's dtype holds: a dequantized value must stay under it
    if tier == "fp8":
        e = _fp8_exponent(x)
        y = torch.ldexp(x.float(), -e.float())  # exact: a power of two
        # ldexp by the ceil exponent keeps |y| ≤ 448; the clamp only guards rounding at the edge.
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # A value within an e4m3 step of the dtype's largest finite one can round up past it
        # (fp32's max → 256 × 2^120 = 2^128): it takes the code one step nearer zero instead,
        # below |x|. Codes are sign and magnitude, so that is the byte minus one.
        over = torch.ldexp(codes.float(), e.float()).abs() > limit
        if over.any():
            bits = codes.view(torch.uint8)
            codes = torch.where(over, bits - 1, bits).view(torch.float8_e4m3fn)
        return Quantized(codes, e)
    if tier == "int8":
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        scale = (amax / INT8_MAX).to(torch.bfloat16)
        # The same edge: a scale rounded up can put 127 × scale past the dtype's largest value;
        # there it takes the bf16 one step down (127 × scale < amax), and the codes saturate.
        over = scale.float() * INT8_MAX > limit
        if over.any():
            scale = torch.where(over, scale.view(torch.int16) - 1, scale.view(torch.int16)).view(torch.bfloat16)
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(amax))
        q = torch.round(x.float() / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Quantized(q, scale)
    check_kv_tier(tier)  # unknown: a ValueError in one line
    raise AssertionError(f"KV tier {tier} has no branch here")


def dequantize(q: Quantized, tier: str, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads: the stored block in the model's dtype."""
    if tier == "native":
        return q.codes.to(dtype)
    if tier == "fp8":
        return torch.ldexp(q.codes.float(), q.scale.float()).to(dtype)
    if tier == "int8":
        return (q.codes.float() * q.scale.float()).to(dtype)
    check_kv_tier(tier)  # unknown: a ValueError in one line
    raise AssertionError(f"KV tier {tier} has no branch here")


def fake_quantize(x: torch.Tensor, tier: str) -> torch.Tensor:
    """x as attention reads it at `tier` (quantize, then dequantize to x's dtype)."""
    return x if tier == "native" else dequantize(quantize(x, tier), tier, x.dtype)


def bytes_per_token(tier: str, layers: int, kv_heads: int, head_dim: int, native_bytes: int) -> float:
    """Stored bytes of one token's keys and values at `tier`."""
    per_head = {"native": native_bytes * head_dim, "fp8": head_dim + 1, "int8": head_dim + 2}
    if tier not in per_head:
        check_kv_tier(tier)  # unknown: a ValueError in one line
    return 2 * layers * kv_heads * per_head[tier]


def check_tier(tier: str) -> str:
    """`tier` if it is a KV tier; a one-line ValueError naming the known ones otherwise."""
    return check_kv_tier(tier)
