"""`fixed:k` (constant γ) and `ar` (γ = 0: plain autoregressive decoding)."""
from __future__ import annotations

from engine.decode.policies.base import BasePolicy
from engine.decode.records import K_MAX, Action, DecodeState


class FixedPolicy(BasePolicy):
    proposers = ("draft",)  # `fixed:k@p` drafts with p instead

    def __init__(self, k: int, name: str | None = None) -> None:
        if not 0 <= k <= K_MAX:
            raise ValueError(f"fixed:k needs 0 ≤ k ≤ {K_MAX}, got {k}")
        self.k = k
        self.name = name or ("ar" if k == 0 else f"fixed:{k}")

    def choose(self, state: DecodeState) -> Action:
        return Action(k=self.k, proposer=self.drafter)
