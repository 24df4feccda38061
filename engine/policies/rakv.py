"""`rakv`: RAKV-ASD's draft-length rule (DESIGN.md, "Controllers"). An EWMA of per-token
acceptance α (the engine keeps it) and the measured cost table give, for every k in
{0, 1, 2, 4, 6, 8}, the expected cost per token; the cheapest wins, so plain decoding (k = 0)
is chosen whenever speculation would not pay. Prefix reuse (the `reuse` half of its action)
arrives with the cross-request KV cache; until then reuse is 0."""
from __future__ import annotations

import numpy as np

from engine.controllers import candidates, expected_tokens
from engine.costs import CostTable
from engine.policies.base import PROBE_AFTER, BasePolicy, ar_streak
from engine.records import Action, DecodeState


class RakvPolicy(BasePolicy):
    def __init__(self, costs: CostTable, alpha0: float = 0.6) -> None:
        if not 0.0 <= alpha0 < 1.0:
            raise ValueError(f"rakv:α0 needs 0 ≤ α0 < 1, got {alpha0}")
        self.costs, self.alpha0 = costs, alpha0
        self.name = "rakv" if alpha0 == 0.6 else f"rakv:{alpha0:g}"

    def choose(self, state: DecodeState) -> Action:
        if ar_streak(state) >= PROBE_AFTER:
            return Action(k=1)
        alpha = self.alpha0 if state.alpha_ewma is None else state.alpha_ewma
        ks = np.array(candidates(state))
        ms_per_token = np.array([self.costs.step_ms(int(k), state.context_len) for k in ks]) / expected_tokens(alpha, ks)
        return Action(k=int(ks[int(np.argmin(ms_per_token))]))
