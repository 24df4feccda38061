"""HF assisted generation's "heuristic" schedule: +2 after a fully accepted step, −1 otherwise."""
from __future__ import annotations

from engine.decode.policies.base import BasePolicy
from engine.decode.records import K_MAX, Action, DecodeState, StepRecord


class HeuristicPolicy(BasePolicy):
    proposers = ("draft",)  # its signals are the draft model's; `@p` drafts with p instead

    def __init__(self, k0: int = 4) -> None:
        if not 1 <= k0 <= K_MAX:
            raise ValueError(f"heuristic:k0 needs 1 ≤ k0 ≤ {K_MAX}, got {k0}")
        self.k0 = k0
        self.name = "heuristic" if k0 == 4 else f"heuristic:{k0}"
        self.k = k0

    def reset(self) -> None:
        self.k = self.k0

    def choose(self, state: DecodeState) -> Action:
        return Action(k=self.k, proposer=self.drafter)

    def observe(self, record: StepRecord) -> None:
        # The feedback sits beside the rule it feeds (as in transformers' candidate_generator):
        # only a step that drafted the full γ says anything about γ.
        if record.k_drafted < record.k_chosen or record.k_chosen == 0:
            return
        if record.accepted == record.k_drafted:
            self.k = min(K_MAX, self.k + 2)
        else:
            self.k = max(1, self.k - 1)
