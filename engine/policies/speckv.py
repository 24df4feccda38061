"""`speckv`: the SpecKV controller, fixed (docs/architecture.md, "Policies and controllers"). A small MLP predicts the
acceptance rate of a γ-token draft from the draft's uncertainty, the target's compression (and,
fitted on our traces or runs, its KV tier) and γ;
the policy picks the γ with the most expected tokens per measured millisecond.

What differs from the paper, and why: the uncertainty features are those of the previous
drafting step (the paper reads them from the very tokens it is choosing γ for, which are not
known yet); k = 0 is a candidate; the objective weighs cost, the draft's catch-up read included;
the prediction is scaled by what this generation's own drafts were accepted at (FEEDBACK_PRIOR). The paper's own rule, `â·γ + 1`
over γ ∈ {2, 4, 6, 8} with no cost, stays available as `speckv-paper` for comparison."""
from __future__ import annotations

import numpy as np

from engine.predictor import (PAPER_CANDIDATES, Predictor, candidates, feature_rows, last_drafting, signals_before,
                              tokens_from_rate)
from engine.costs import CostTable
from engine.policies.base import PROBE_ALPHA, BasePolicy, catchup_pays, probe_due, probe_pays, reuse_that_pays
from engine.records import Action, DecodeState, StepRecord


# The MLP is fitted on other prompts, and the policy drafts where it predicts the most: on texts
# unlike its training set it overestimates there (held-out prompts at bf16 in `bench controllers
# live` showed it). So its rates are scaled by this generation's
# (accepted + FEEDBACK_PRIOR) / (predicted + FEEDBACK_PRIOR) over the drafts it chose (probes are
# not its choice): the prior counts as that many tokens accepted as predicted, so a first 2-token
# draft predicted at 0.6 and rejected moves the scale to 4 / 5.2, not to zero.
FEEDBACK_PRIOR = 4.0


class SpeckvPolicy(BasePolicy):
    def __init__(self, predictor: Predictor, costs: CostTable | None, objective: str = "tps",
                 name: str = "speckv") -> None:
        if objective not in _OBJECTIVES:
            raise ValueError(f"speckv objective must be one of {', '.join(_OBJECTIVES)}, got {objective!r}")
        if objective == "tps" and costs is None:
            raise ValueError("policy speckv weighs measured costs: run `python -m engine costs` for this pair and tier")
        self.predictor, self.costs, self.objective, self.name = predictor, costs, objective, name
        self.last_expected: float | None = None  # the predictor's E[tokens] for its choice (replay shows the gap)
        self._last: tuple = ()  # (inputs, (k, E, rate)) of the last decision: plain streaks repeat it
        self._feedback = [0.0, 0.0]  # this generation's [accepted, predicted] drafted tokens
        self._rate: float | None = None  # the MLP's rate for the chosen draft length (None: a probe)

    def choose(self, state: DecodeState) -> Action:
        if self.objective == "tps" and probe_due(state, self.costs):
            self.last_expected, self._rate = None, None
            pays = probe_pays(self.costs, state, PROBE_ALPHA)
            self.why = "probe: draft 1 token to re-measure acceptance" if pays else "plain: a probe would not repay its catch-up"
            return Action(k=1 if pays else 0)
        k, self.last_expected, rate = _OBJECTIVES[self.objective](self, state)
        self.why = f"predicted {self.last_expected:.2f} tokens/step at γ {k}" if k else "predicted acceptance too low: plain"
        if k and self.objective == "tps" and not catchup_pays(
                self.costs, state, self.costs.step_ms(k, state.context_len) / self.last_expected):
            k, self.last_expected = 0, 1.0
            self.why = "plain: drafting would not repay the draft's catch-up read"
        self._rate = rate if k else None
        return Action(k=k)

    def observe(self, record: StepRecord) -> None:
        if self.objective == "tps" and self._rate is not None and record.k_drafted:  # not probes
            self._feedback[0] += record.accepted
            self._feedback[1] += self._rate * record.k_drafted

    def reset(self) -> None:
        self._last, self._feedback, self._rate = (), [0.0, 0.0], None

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        return reuse_that_pays(self.costs, offered, n_prompt) if self.costs else offered

    def _scale(self) -> float:
        """Accepted / predicted over this generation's drafts, shrunk to 1 (FEEDBACK_PRIOR)."""
        accepted, predicted = self._feedback
        return (accepted + FEEDBACK_PRIOR) / (predicted + FEEDBACK_PRIOR)

    def _tps(self, state: DecodeState) -> tuple[int, float, float]:
        grid, scale = candidates(state), self._scale()
        # Same features (the last drafting step), context bucket, candidates and feedback: same choice.
        drafted = last_drafting(state)
        key = (id(drafted), state.target_tier, state.kv_tier, self.costs.bucket_of(state.context_len), grid, scale)
        if self._last and self._last[0] == key:
            return self._last[1]
        ks, rate = self._rates(state, grid, drafted)
        e = tokens_from_rate(ks, np.minimum(rate * scale, 1.0))
        ms = np.array([self.costs.step_ms(int(k), state.context_len) for k in ks])
        best = int(np.argmax(e / ms))
        self._last = (key, (int(ks[best]), float(e[best]), float(rate[best])))
        return self._last[1]

    def _paper(self, state: DecodeState) -> tuple[int, float, float]:
        ks, rate = self._rates(state, PAPER_CANDIDATES)
        e = tokens_from_rate(ks, rate)  # SpecKV: â·γ + 1, cost ignored
        best = int(np.argmax(e))
        return int(ks[best]), float(e[best]), float(rate[best])

    def _rates(self, state: DecodeState, grid: tuple[int, ...], drafted=None) -> tuple[np.ndarray, np.ndarray]:
        """(candidates, the MLP's predicted rate = accepted / k of each; see tokens_from_rate).
        Row k = 0 only fills the batch: a plain step yields exactly one token."""
        ks = np.array(grid)
        x = feature_rows(signals_before(state, self.predictor.defaults, drafted), state.target_tier, grid,
                         state.kv_tier, self.predictor.features)
        return ks, self.predictor.predict(x)


_OBJECTIVES = {"tps": SpeckvPolicy._tps, "paper": SpeckvPolicy._paper}
