"""`threshold:c`: draft up to K_MAX, stop once a drafted token's confidence falls below c
(HF's `assistant_confidence_threshold`, llama.cpp's `--draft-p-min`)."""
from __future__ import annotations

from engine.decode.policies.base import BasePolicy
from engine.decode.records import K_MAX, Action, DecodeState, DraftToken


class ThresholdPolicy(BasePolicy):
    proposers = ("draft",)  # its signals are the draft model's; `@p` drafts with p instead

    def __init__(self, c: float = 0.4) -> None:
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"threshold:c needs 0 ≤ c ≤ 1, got {c}")
        self.c = c
        self.name = f"threshold:{c:g}"

    def choose(self, state: DecodeState) -> Action:
        return Action(k=K_MAX, proposer=self.drafter)

    def keep_drafting(self, state: DecodeState, j: int, token: DraftToken) -> bool:
        # The unsure token itself is kept (as HF does): it still has a chance to be accepted.
        return token.confidence >= self.c
