"""Batch-invariant verification: a k-token verify forward computed exactly as k one-token decode
steps would compute it, so speculative greedy output equals plain greedy output token for token.

Two places break that on this CPU at bf16 (measured on SmolLM2-135M, torch 2.13):
- attention: HF's SDPA path takes one kernel for a single query (grouped-query attention inside
  SDPA, no mask) and another for several queries over a cache (K/V repeated, explicit mask);
- some matmul shapes: a one-row bf16 `linear` with K = 1536 (the MLP's down projection) rounds
  differently from the same row inside a 2–9 row `linear`; K = 576 shapes agree.
At bf16 a one-ULP change flips the argmax between tied logits, which are common at 8 bits of
mantissa. So while verifying (and only then), attention runs one query row at a time through
HF's own one-query path, and each linear shape that a load-time probe finds row-variant runs one
row at a time. Prefill, decode steps and the draft's forwards are untouched HF code."""
from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Iterator

import torch
import torch.nn.functional as F

NAME = "speclab_sdpa"
PROBE_ROWS, PROBE_TRIALS = 9, 4  # a verify forward has at most K_MAX + 1 = 9 rows
_VERIFYING = contextvars.ContextVar("speclab_verifying", default=False)


@contextlib.contextmanager
def verifying() -> Iterator[None]:
    token = _VERIFYING.set(True)
    try:
        yield
    finally:
        _VERIFYING.reset(token)


def _row_mask(mask: torch.Tensor | None, i: int, n: int) -> torch.Tensor | None:
    """Row i of the mask over the first n keys; None when it hides nothing (what one-token
    decoding passes), so the one-query SDPA path is the same one plain decoding takes."""
    if mask is None:
        return None
    row = mask[:, :, i : i + 1, :n]
    hides_nothing = bool(row.all()) if row.dtype == torch.bool else bool((row == 0).all())
    return None if hides_nothing else row


def rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """query: [B, H, q, D]; key/value: [B, Hkv, past + q, D] → ([B, q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = query.shape[2], key.shape[2]
    if not _VERIFYING.get() or q_len == 1 or kv_len == q_len:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    past = kv_len - q_len
    rows = []
    for i in range(q_len):
        n = past + i + 1  # row i sees the past and the verify tokens up to itself
        # Fresh contiguous K/V, as the one-token step reads them from the cache.
        out, _ = sdpa_attention_forward(
            module, query[:, :, i : i + 1], key[:, :, :n].contiguous(), value[:, :, :n].contiguous(),
            _row_mask(attention_mask, i, n), **kwargs,
        )
        rows.append(out)
    return torch.cat(rows, dim=1), None


def register() -> str:
    """The attention implementation name to load models with (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, rowwise_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # SDPA's masks: SDPA's kernel choices
    return NAME


def _rowwise_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _VERIFYING.get() or x.numel() == x.shape[-1]:
        return F.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])  # [B·S, in]
    out = torch.cat([F.linear(rows[r : r + 1].clone(), self.weight, self.bias) for r in range(len(rows))])
    return out.reshape(*x.shape[:-1], -1)


def _row_variant(linear: torch.nn.Linear) -> bool:
    """Does one row alone round differently from the same row among others?"""
    gen = torch.Generator(device=linear.weight.device).manual_seed(0)
    w, b = linear.weight, linear.bias
    for _ in range(PROBE_TRIALS):
        x = torch.randn(PROBE_ROWS, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        full = F.linear(x, w, b)
        if any(not torch.equal(F.linear(x[r : r + 1].clone(), w, b)[0], full[r]) for r in range(PROBE_ROWS)):
            return True
    return False


@torch.inference_mode()
def make_verify_exact(model: torch.nn.Module) -> int:
    """Patches the row-variant linears of `model` (plain nn.Linear only; quantized layers are
    left alone, see DESIGN.md) to run row by row while verifying. Returns how many."""
    verdict: dict[tuple, bool] = {}
    patched = 0
    for m in model.modules():
        if type(m) is not torch.nn.Linear:
            continue
        shape = (tuple(m.weight.shape), m.weight.dtype, m.bias is not None, m.weight.device)
        if shape not in verdict:
            verdict[shape] = _row_variant(m)
        if verdict[shape]:
            m.forward = types.MethodType(_rowwise_linear, m)
            patched += 1
    return patched
