"""`speckv`: the SpecKV controller, fixed (docs/architecture.md, "Policies and controllers"). A small MLP predicts the
acceptance rate of a γ-token draft from the draft's uncertainty, the target's compression (and,
fitted on our traces or runs, its KV tier) and γ;
the policy picks the γ with the most expected tokens per measured millisecond.

What differs from the paper, and why: the uncertainty features are those of the previous
drafting step (the paper reads them from the very tokens it is choosing γ for, which are not
known yet); k = 0 is a candidate; the objective weighs cost, the draft's catch-up read included;
the prediction is scaled by what this generation's own drafts were accepted at (FEEDBACK_PRIOR)
and averaged with the rate the draft's measured per-token acceptance in the run gives (rakv's);
the predictor was fitted on the draft model's signals, so it speaks for the draft alone: the
other proposers of a run (an n-gram lookup, a feature-level head) are weighed as `rakv` weighs
them, by their own acceptance EWMA, and the (proposer, γ) with the most expected tokens per
millisecond wins. The paper's own rule, `â·γ + 1` over γ ∈ {2, 4, 6, 8} with no cost, stays
available as `speckv-paper` for comparison (the draft model only)."""
from __future__ import annotations

import math

import numpy as np

from engine.decode.acceptance import (
    PAPER_CANDIDATES,
    Predictor,
    expected_tokens,
    feature_rows,
    signals_before,
    tokens_from_rate,
)
from engine.decode.costs import CostTable
from engine.decode.policies.base import BasePolicy
from engine.decode.policies.payoff import PROBE_ALPHA, catchup_pays, drafted_by, reuse_that_pays
from engine.decode.policies.rakv import (
    ALPHA0,
    PRIORS,
    acceptance,
    and_also,
    assumed,
    blended,
    choose_probe,
    grid_for,
    idle,
    proposers_for,
    retired_why,
)
from engine.decode.records import Action, DecodeState, StepRecord

# The MLP is fitted on other prompts, and the policy drafts where it predicts the most: on texts
# unlike its training set it overestimates there (held-out prompts at bf16 in `bench controllers
# live` showed it). So its rates are scaled by this generation's
# (accepted + FEEDBACK_PRIOR) / (predicted + FEEDBACK_PRIOR) over the drafts it chose (probes are
# not its choice): the prior counts as that many tokens accepted as predicted, so a first 2-token
# draft predicted at 0.6 and rejected moves the scale to 4 / 5.2, not to zero.
FEEDBACK_PRIOR = 4.0


class SpeckvPolicy(BasePolicy):
    def __init__(self, predictor: Predictor, costs: CostTable | None, objective: str = "tps",
                 name: str = "speckv", proposers: tuple[str, ...] | None = None,
                 priors: dict[str, float] | None = None) -> None:
        if objective not in _OBJECTIVES:
            raise ValueError(f"speckv objective must be one of {', '.join(_OBJECTIVES)}, got {objective!r}")
        if objective == "tps" and costs is None:
            raise ValueError("policy speckv weighs measured costs: run `python -m engine costs` for this pair and tier")
        self.predictor, self.costs, self.objective, self.name = predictor, costs, objective, name
        if proposers is not None:  # the spec's `@proposer`; otherwise whatever the parser sets (None: all)
            self.proposers = proposers
        # The other proposers' per-token acceptance before they draft: the pair's measured one, else rakv's.
        self.priors = {**PRIORS, **{p: min(a, 0.99) for p, a in (priors or {}).items()}}
        self.last_expected: float | None = None  # E[tokens] of its choice (replay shows the gap)
        self._last: dict[str, tuple] = {}  # per proposer: (inputs, (k, E, ms, rate)); plain streaks repeat them
        self._feedback = [0.0, 0.0]  # this generation's [accepted, predicted] drafted tokens
        self._rate: float | None = None  # the MLP's rate for the chosen draft length (None: a probe, another proposer)

    def choose(self, state: DecodeState) -> Action:
        action = self._choose(state)
        self.why += assumed(self.costs)
        return action

    def _choose(self, state: DecodeState) -> Action:
        if self.objective == "paper":
            k, self.last_expected, _ = self._paper(state)
            self.why = f"draft γ {k}: predicted {self.last_expected:.2f} tokens/step (the paper's rule, no cost)"
            self._rate = None
            return Action(k=k, proposer="draft" if "draft" in state.proposers else idle(state))
        names = proposers_for(self, state)
        best = {p: self._best(state, p) for p in names}  # (k, E[tokens], step ms, MLP rate or None) each
        ranked = sorted((p for p in names if best[p][0]), key=lambda p: best[p][2] / best[p][1])  # run order on ties
        winner = ranked[0] if ranked else None
        probe = choose_probe(self.costs, state, names, winner, self._prior,
                             best[winner][2] / best[winner][1] if winner else math.inf)
        if probe is not None:
            self.last_expected, self._rate = None, None
            action, self.why = probe
            return action
        skipped = []  # drafts that would not repay their proposer's catch-up read
        while ranked and not catchup_pays(self.costs, state, best[ranked[0]][2] / best[ranked[0]][1], ranked[0]):
            p = ranked.pop(0)
            skipped.append(f"{p} γ {best[p][0]} would not repay its catch-up read")
        plain_ms = self.costs.step_ms(0, state.context_len)
        if not ranked:
            self.last_expected, self._rate = 1.0, None
            self.why = (f"plain: {'; '.join(skipped)}" if skipped else "plain: predicted acceptance too low") + and_also(
                retired_why(self, state))
            return Action(k=0, proposer=idle(state))
        winner = ranked[0]
        k, e, ms, self._rate = best[winner]
        self.last_expected = e
        self.why = (f"{winner} γ {k}: predicted {e:.2f} tokens/step, {ms / e:.1f} ms/token vs {plain_ms:.1f} plain"
                    + (f" ({'; '.join(skipped)})" if skipped else "") + and_also(retired_why(self, state)))
        return Action(k=k, proposer=winner)

    def observe(self, record: StepRecord) -> None:
        # Only the drafts the MLP chose (not probes, not other proposers' drafts) test its rates.
        if self.objective == "tps" and self._rate is not None and drafted_by(record) == "draft":
            self._feedback[0] += record.accepted
            self._feedback[1] += self._rate * record.k_drafted

    def reset(self) -> None:
        self._last, self._feedback, self._rate, self._ledger = {}, [0.0, 0.0], None, (0, {})

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        return reuse_that_pays(self.costs, offered, n_prompt) if self.costs else offered

    def _prior(self, proposer: str) -> float:
        """What a probe bets on: the draft's typical acceptance, another proposer's prior."""
        return PROBE_ALPHA if proposer == "draft" else self.priors.get(proposer, PROBE_ALPHA)

    def _scale(self) -> float:
        """Accepted / predicted over this generation's drafts, shrunk to 1 (FEEDBACK_PRIOR)."""
        accepted, predicted = self._feedback
        return (accepted + FEEDBACK_PRIOR) / (predicted + FEEDBACK_PRIOR)

    def _best(self, state: DecodeState, proposer: str) -> tuple[int, float, float, float | None]:
        """One proposer's (k, E[tokens], step ms, the MLP's rate for the draft) with the most
        expected tokens per ms, k = 0 first (ties stay plain)."""
        grid = grid_for(state, proposer)
        bucket = self.costs.band(state.context_len)
        if proposer == "draft":
            # Same features (the draft's last drafting step), context bucket, candidates, feedback and
            # measured acceptance: same choice.
            drafted = _last_drafted(state, "draft")
            alpha = blended(*acceptance(state, "draft"), self.priors.get("draft", ALPHA0))
            key = (id(drafted), state.target_tier, state.kv_tier, bucket, grid, self._scale(), alpha)
        else:
            alpha = blended(*acceptance(state, proposer), self._prior(proposer))
            key = (alpha, bucket, grid)
        last = self._last.get(proposer)
        if last and last[0] == key:
            return last[1]
        ks = np.array(grid)
        if proposer == "draft":
            ks, rate = self._rates(state, grid, drafted)
            # The MLP's rate (its bias on this text corrected by feedback) averaged with the rate the
            # draft's measured acceptance in this run gives, as rakv weighs it: fitted on other
            # prompts, the MLP alone under-rated the draft on chat and held it out of whole runs
            # in favour of a head right one time in ten (bench draft, bf16 fast: 0.957× the best
            # fixed policy); the average replays 8% faster over the 40 held-out prompts there.
            measured = (expected_tokens(alpha, ks) - 1.0) / np.maximum(ks, 1)  # accepted / k; 0 at k = 0
            e = tokens_from_rate(ks, 0.5 * np.minimum(rate * self._scale(), 1.0) + 0.5 * measured)
        else:
            rate, e = None, expected_tokens(alpha, ks)  # a per-token α: the truncated geometric
        ms = np.array([self.costs.step_ms(int(k), state.context_len, proposer) for k in ks])
        i = int(np.argmax(e / ms))
        self._last[proposer] = (key, (int(ks[i]), float(e[i]), float(ms[i]), None if rate is None else float(rate[i])))
        return self._last[proposer][1]

    def _paper(self, state: DecodeState) -> tuple[int, float, float]:
        ks, rate = self._rates(state, PAPER_CANDIDATES, _last_drafted(state, "draft"))
        e = tokens_from_rate(ks, rate)  # SpecKV: â·γ + 1, cost ignored
        best = int(np.argmax(e))
        return int(ks[best]), float(e[best]), float(rate[best])

    def _rates(self, state: DecodeState, grid: tuple[int, ...], drafted: StepRecord | None
               ) -> tuple[np.ndarray, np.ndarray]:
        """(candidates, the MLP's predicted rate = accepted / k of each; see tokens_from_rate).
        Row k = 0 only fills the batch: a plain step yields exactly one token."""
        ks = np.array(grid)
        x = feature_rows(signals_before(state, self.predictor.defaults, drafted), state.target_tier, grid,
                         state.kv_tier, self.predictor.features)
        return ks, self.predictor.predict(x)


def _last_drafted(state: DecodeState, proposer: str) -> StepRecord | None:
    """The newest step `proposer` drafted (with signals), or None: the MLP reads the draft
    model's own uncertainty, not an n-gram copy's (entropy 0, confidence 1 whatever follows)."""
    return next((r for r in reversed(state.history)
                 if drafted_by(r) == proposer and r.mean_entropy is not None), None)


_OBJECTIVES = ("tps", "paper")
