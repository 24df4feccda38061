"""Per-position draft signals: entropy in bits and confidence (max probability)."""
from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of each row of `probs` ([..., V] → [...])."""
    # xlogy gives 0·log 0 = 0, so truncated (top-p) distributions need no epsilon.
    return -torch.special.xlogy(probs, probs).sum(-1) / _LN2


def confidence(probs: torch.Tensor) -> torch.Tensor:
    return probs.max(-1).values


def summarize(entropies: list[float], confidences: list[float]) -> dict[str, float | None]:
    """The four per-step features of SpecKV (mean H, max H, mean c, min c); None when empty."""
    if not entropies:
        return dict(mean_entropy=None, max_entropy=None, mean_confidence=None, min_confidence=None)
    return dict(
        mean_entropy=sum(entropies) / len(entropies),
        max_entropy=max(entropies),
        mean_confidence=sum(confidences) / len(confidences),
        min_confidence=min(confidences),
    )
