"""`speckv`: the SpecKV controller, fixed (DESIGN.md, "Controllers"). A small MLP predicts the
acceptance rate of a γ-token draft from the draft's uncertainty, the target's compression and γ;
the policy picks the γ with the most expected tokens per measured millisecond.

What differs from the paper, and why: the uncertainty features are those of the previous
drafting step (the paper reads them from the very tokens it is choosing γ for, which are not
known yet); k = 0 is a candidate; the objective weighs cost. The paper's own rule, `â·γ + 1`
over γ ∈ {2, 4, 6, 8} with no cost, stays available as `speckv-paper` for comparison."""
from __future__ import annotations

import numpy as np

from engine.controllers import PAPER_CANDIDATES, Predictor, candidates, feature_rows, last_drafting, signals_before
from engine.costs import CostTable
from engine.policies.base import BasePolicy, probe_due
from engine.records import Action, DecodeState


class SpeckvPolicy(BasePolicy):
    def __init__(self, predictor: Predictor, costs: CostTable | None, objective: str = "tps",
                 name: str = "speckv") -> None:
        if objective not in _OBJECTIVES:
            raise ValueError(f"speckv objective must be one of {', '.join(_OBJECTIVES)}, got {objective!r}")
        if objective == "tps" and costs is None:
            raise ValueError("policy speckv weighs measured costs: run `python -m engine costs` for this pair and tier")
        self.predictor, self.costs, self.objective, self.name = predictor, costs, objective, name
        self.last_expected: float | None = None  # the predictor's E[tokens] for its choice (replay shows the gap)
        self._last: tuple = ()  # (inputs, k, E) of the last decision: plain streaks repeat it

    def choose(self, state: DecodeState) -> Action:
        if self.objective == "tps" and probe_due(state):
            self.last_expected = None
            return Action(k=1)
        k, self.last_expected = _OBJECTIVES[self.objective](self, state)
        return Action(k=k)

    def reset(self) -> None:
        self._last = ()

    def _tps(self, state: DecodeState) -> tuple[int, float]:
        grid = candidates(state)
        # Same features (the last drafting step), context bucket and candidates: same choice.
        drafted = last_drafting(state)
        key = (id(drafted), state.target_tier, self.costs.bucket_of(state.context_len), grid)
        if self._last and self._last[0] == key:
            return self._last[1], self._last[2]
        ks, e = self._expected(state, grid, drafted)
        ms = np.array([self.costs.step_ms(int(k), state.context_len) for k in ks])
        best = int(np.argmax(e / ms))
        self._last = (key, int(ks[best]), float(e[best]))
        return int(ks[best]), float(e[best])

    def _paper(self, state: DecodeState) -> tuple[int, float]:
        ks, e = self._expected(state, PAPER_CANDIDATES)  # SpecKV: â·γ + 1, cost ignored
        best = int(np.argmax(e))
        return int(ks[best]), float(e[best])

    def _expected(self, state: DecodeState, grid: tuple[int, ...], drafted=None) -> tuple[np.ndarray, np.ndarray]:
        """(candidates, E[tokens] of each): 1 + k·rate, where the MLP predicts rate = accepted / k.
        That is 1 + α + … + α^k (DESIGN.md) for the per-token α whose drafts keep that rate on
        average (α + … + α^k = k·rate); putting the rate itself in for α, as before, undercounts
        long drafts (α = 0.7 at k = 4: rate 0.44, 1.76 tokens instead of 2.77). Row k = 0 only
        fills the batch: a plain step yields exactly one token."""
        ks = np.array(grid)
        x = feature_rows(signals_before(state, self.predictor.defaults, drafted), state.target_tier, grid)
        return ks, 1.0 + ks * self.predictor.predict(x)


_OBJECTIVES = {"tps": SpeckvPolicy._tps, "paper": SpeckvPolicy._paper}
