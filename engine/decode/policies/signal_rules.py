"""`rules`: the preset from the SpecKV seed notes, applied to the previous step's signals
(known before drafting, so nothing leaks from the tokens about to be drafted)."""
from __future__ import annotations

from engine.decode.policies.base import BasePolicy
from engine.decode.records import Action, DecodeState

UNSURE_MIN_CONF, UNSURE_MAX_H = 0.3, 2.5  # c_min < 0.3 or H_max > 2.5 → short draft
SURE_MEAN_CONF, SURE_MEAN_H = 0.8, 1.0  # mean c > 0.8 and mean H < 1.0 → long draft
K_SHORT, K_MID, K_LONG = 2, 4, 8


class RulesPolicy(BasePolicy):
    name = "rules"
    proposers = ("draft",)  # its signals are the draft model's; `@p` drafts with p instead

    def choose(self, state: DecodeState) -> Action:
        last = next((r for r in reversed(state.history) if r.k_drafted > 0), None)
        if last is None:
            return Action(k=K_MID, proposer=self.drafter)
        if last.min_confidence < UNSURE_MIN_CONF or last.max_entropy > UNSURE_MAX_H:
            return Action(k=K_SHORT, proposer=self.drafter)
        if last.mean_confidence > SURE_MEAN_CONF and last.mean_entropy < SURE_MEAN_H:
            return Action(k=K_LONG, proposer=self.drafter)
        return Action(k=K_MID, proposer=self.drafter)
