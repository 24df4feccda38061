"""`rakv`: RAKV-ASD's draft-length rule (docs/architecture.md, "Policies and controllers"), over
every proposer the run has. An EWMA of per-token acceptance α per proposer and the measured
cost table (that proposer's ms per drafted token, the verify of k) give, for every
(proposer, k) with k in {0, 1, 2, 4, 6, 8} (an n-gram match's continuation caps k; no match, no
n-gram draft), the expected cost per token; the cheapest wins, so plain decoding (k = 0) is
chosen whenever speculation would not pay, and a proposer is passed over whenever its saving
over the tokens left would not repay its catch-up read (the draft model's prompt, before a
request's first draft).
Before the prefill it takes or declines the prefix cache's offer by the measured prefill costs
(`take_reuse`)."""
from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from engine.decode.acceptance import expected_tokens
from engine.decode.costs import CostTable
from engine.decode.policies.base import BasePolicy
from engine.decode.policies.payoff import (
    catchup_pays,
    grid_for,
    lookahead_of,
    priced,
    probe_due,
    probe_pays,
    reuse_that_pays,
)
from engine.decode.records import K_MAX, AcceptanceEWMA, Action, DecodeState
from engine.decode.tree import geometric_ranks, rank_counts, static_choices

# rakv's prior α0 counts as this many trials beside the EWMA's own: one accepted probe alone
# (α = 1/1) would otherwise send it to k = 8, a gamble that costs ~5 plain steps when it fails.
PRIOR_TRIALS = 4.0
# The prior α0 where nothing better is known; `python -m engine` passes the pair's per-token
# acceptance measured by stored runs instead (service.policy_context), `rakv:α0` sets it.
ALPHA0 = 0.6
# Priors of the proposers other than the draft model (which takes α0), per token. An n-gram
# proposal is a copy of an earlier continuation: right or wrong from its first token as often
# as not, and free to draft, so 0.5 lets a match be tried; with no accepted token the prior's
# weight (PRIOR_TRIALS against an EWMA of at most 5 trials) keeps α ≥ 0.22, below what one
# verified token costs against a plain step at bf16 (48.7 / 38.9 ms: α > 0.25), so a text
# that never repeats itself stops being tried. The suffix proposer's path is a copy too (of the
# most frequent continuation), cut where its own estimate falls below 0.3: the same prior. A
# feature-level head starts where a draft does.
PRIORS = {"ngram": 0.5, "suffix": 0.5, "eagle": ALPHA0}
# The token-tree node budgets weighed beside the draft's chains where the run grows trees
# (DecodeState.tree_width): a tree pays where its verify of N + 1 rows costs little more than a
# chain's and the draft is often right at its second or third guess.
TREE_NODES = (4, 8, 16)


def default_prior(proposer: str) -> float:
    """rakv's prior for `proposer` where no stored run measured it."""
    return PRIORS.get(proposer, ALPHA0)


def proposers_for(policy, state: DecodeState) -> tuple[str, ...]:
    """The run's proposers this policy may draft with (its spec's `@proposer` restricts them),
    less those that can propose nothing now (an n-gram proposer without a match), those its
    cost table does not price (`unpriced`) and those retired for losing (`retired`), in the
    run's order."""
    allowed = getattr(policy, "proposers", None)
    missing = unpriced(policy.costs, state)
    out = retired(policy, state)
    names = tuple(p for p in state.proposers if (allowed is None or p in allowed) and p not in missing and p not in out)
    return tuple(p for p in names if lookahead_of(state, p) > 0)


# A proposer whose drafts have cost this run more than RETIRE_STEPS plain steps beyond what they
# saved (in the cost table's time, so replay retires it at the same step) is not tried again in
# the run: whatever the policy's hopes, its losses stay bounded (~2% of a 100-token run). Only
# after MIN_DRAFTS drafts: one unlucky γ-4 miss alone costs about a plain step.
RETIRE_STEPS = 2.0
MIN_DRAFTS = 4


def retired(policy, state: DecodeState) -> dict[str, float]:
    """Proposer → ms its drafts lost this run, for those retired (see RETIRE_STEPS). The ledger
    is kept on the policy and extended by the steps recorded since (O(1) a step)."""
    costs = getattr(policy, "costs", None)
    if costs is None:
        return {}
    seen, ledger = getattr(policy, "_ledger", (0, {}))
    if seen > len(state.history):  # a new run
        seen, ledger = 0, {}
    missing = unpriced(costs, state)
    for r in state.history[max(seen, 1):]:
        if r.k_drafted and r.proposer and r.proposer not in missing:
            saved = r.emitted * costs.step_ms(0, r.context_len) - priced(costs, r)
            n, total = ledger.get(r.proposer, (0, 0.0))
            ledger[r.proposer] = (n + 1, total + saved)
    policy._ledger = (len(state.history), ledger)
    bound = RETIRE_STEPS * costs.step_ms(0, state.context_len)
    return {p: -total for p, (n, total) in ledger.items() if n >= MIN_DRAFTS and total < -bound}


def retired_why(policy, state: DecodeState) -> str:
    """The retirements, for a choice's `why` ("" when none)."""
    out = retired(policy, state)
    return "; ".join(f"{p} retired: its drafts lost {ms:.0f} ms this run" for p, ms in out.items())


def unpriced(costs: CostTable, state: DecodeState) -> tuple[str, ...]:
    """The run's proposers the cost table has no drafting costs for: a table measured before
    proposers had names prices the draft model alone. It keeps working for what it prices; the
    others are not weighed (the `why` says so) until `python -m engine costs` measures them."""
    priced = getattr(costs, "proposers", None)  # None: a table that prices every proposer
    return () if priced is None else tuple(p for p in state.proposers if p not in priced)


def acceptance(state: DecodeState, proposer: str) -> tuple[float | None, float]:
    """(α EWMA or None before it drafted, the decayed trials behind it) of one proposer, kept
    by the engine over the steps it drafted. With one proposer that is the run's own EWMA, which
    states made by hand (tests, callers of `choose`) set alone."""
    if len(state.proposers) == 1:
        return state.alpha_ewma, state.alpha_trials
    return state.alphas.get(proposer, (None, 0.0))


def blended(ewma: float | None, trials: float, prior: float) -> float:
    """The EWMA shrunk to `prior` (weighed as PRIOR_TRIALS trials)."""
    n = trials if ewma is not None else 0.0
    return ((ewma or 0.0) * n + prior * PRIOR_TRIALS) / (n + PRIOR_TRIALS)


def choose_probe(costs: CostTable, state: DecodeState, names: tuple[str, ...], winner: str | None,
                 prior: Callable[[str], float], winner_ms: float = math.inf) -> tuple[Action, str] | None:
    """A one-token probe for a proposer whose wait is over (`probe_due`), and why; None: no
    probe. `winner` is the proposer the cost rule would draft with (None: plain decoding), at
    `winner_ms` per expected token; a probe bets on `prior(proposer)`. With one proposer, as a
    lone draft always did: a due probe that would not repay the catch-up read decodes plainly.
    With several, each waits on its own, the cheapest probe goes first, and a probe takes the
    place of another proposer's draft that pays only where it promises more, its one token at
    its prior costing less per expected token (else it would throw that step's expected tokens
    away): a proposer that keeps winning at a small margin (a head right one time in ten, where
    a 2-row verify costs a plain step) must not keep one that looked bad once from ever being
    tried again."""
    several = len(state.proposers) > 1

    def outbids(p: str) -> bool:
        return winner in (None, p) or costs.step_ms(1, state.context_len, p) / (1.0 + prior(p)) < winner_ms

    due = [p for p in names if (not several or outbids(p)) and probe_due(state, costs, p if several else None)]
    refused = []
    for p in sorted(due, key=lambda p: costs.step_ms(1, state.context_len, p)):
        if probe_pays(costs, state, prior(p), p):
            who = f"{p} has not drafted" if several else "plain"
            return Action(k=1, proposer=p), f"probe {p}: {who} for a while, draft 1 token to re-measure its acceptance"
        refused.append(p)
    if not refused or (several and winner is not None):  # no probe due, or the cost rule's draft stands
        return None
    return (Action(k=0, proposer=idle(state)),
            f"plain: a probe of {', '.join(refused)} would not pay here (no γ beats a plain step at its prior "
            "acceptance at this context, or it would not repay its catch-up read)")


def idle(state: DecodeState) -> str:
    """The proposer a plain step names (it drafts nothing): one the run has."""
    return state.proposers[0]


def and_also(text: str) -> str:
    """`text` as one more clause of a `why` ("" stays "")."""
    return f"; {text}" if text else ""


def assumed(costs: CostTable | None) -> str:
    """What a choice assumed, as a last clause of its `why`: probed costs, until a table is measured."""
    return "; costs probed, no measured table yet" if costs is not None and costs.source == "probe" else ""


class RakvPolicy(BasePolicy):
    def __init__(self, costs: CostTable, alpha0: float = ALPHA0, name: str | None = None,
                 priors: Mapping[str, float] | None = None, proposers: tuple[str, ...] | None = None) -> None:
        if not 0.0 <= alpha0 < 1.0:
            raise ValueError(f"rakv:α0 needs 0 ≤ α0 < 1, got {alpha0}")
        self.costs, self.alpha0 = costs, alpha0
        self.name = name or ("rakv" if alpha0 == ALPHA0 else f"rakv:{alpha0:g}")
        # The other proposers' priors: the pair's measured acceptance where stored runs have it
        # (capped as α0 is: a prior of 1 would draft 8 whatever the EWMA says). The draft's is α0,
        # which is already the measured one unless the user typed `rakv:α0`, whose word wins.
        self.priors = {**PRIORS, **{p: min(a, 0.99) for p, a in (priors or {}).items()}, "draft": alpha0}
        if proposers is not None:  # the spec's `@proposer`; otherwise whatever the parser sets (None: all)
            self.proposers = proposers
        self._last: dict[str, tuple] = {}  # per proposer: (inputs, (k, ms/token)); plain streaks repeat them
        self._ranks: list[AcceptanceEWMA] = []  # per sibling rank ≥ 1: how often a reached node's rank-r child stood

    def prior(self, proposer: str) -> float:
        return self.priors.get(proposer, self.alpha0)

    def choose(self, state: DecodeState) -> Action:
        action = self._choose(state)
        self.why += assumed(self.costs)
        return action

    def _choose(self, state: DecodeState) -> Action:
        names = proposers_for(self, state)
        alphas = {p: blended(*acceptance(state, p), self.prior(p)) for p in names}
        plain_ms = self.costs.step_ms(0, state.context_len)
        best = {p: self._best(state, p, alphas[p]) for p in names}  # (k, ms/token) each
        chain = best.get("draft")
        tree = self._best_tree(state, alphas["draft"]) if "draft" in names else None
        if tree is not None and tree[1] < chain[1]:  # a token tree beats the draft's best chain (or plain)
            best["draft"] = tree[:2]
        else:
            tree = None
        ranked = sorted((p for p in names if best[p][0]), key=lambda p: best[p][1])  # stable: run order on ties
        winner = ranked[0] if ranked else None
        probe = choose_probe(self.costs, state, names, winner, self.prior, best[winner][1] if winner else math.inf)
        if probe is not None:
            action, self.why = probe
            return action
        skipped = []  # drafts whose saving would not repay their proposer's catch-up read
        while ranked and not catchup_pays(self.costs, state, best[ranked[0]][1], ranked[0]):
            p = ranked.pop(0)
            skipped.append(f"{p} γ {best[p][0]} would save {plain_ms - best[p][1]:.1f} ms/token, "
                           "not enough to repay its catch-up")
        if not ranked:
            self.why = f"plain: {'; '.join(skipped)}" if skipped else self._plain_why(state, alphas, plain_ms)
            return Action(k=0, proposer=idle(state))
        winner = ranked[0]
        k, ms = best[winner]
        if winner == "draft" and tree is not None:
            chained = f"{chain[1]:.1f} for a chain of {chain[0]}, " if chain[0] else ""
            self.why = (f"draft tree {k}×{state.tree_width}: α ≈ {alphas[winner]:.2f}, E ≈ {tree[2]:.2f} tokens a "
                        f"verify, {ms:.1f} ms/token vs {chained}{plain_ms:.1f} plain"
                        + (f" ({'; '.join(skipped)})" if skipped else "") + and_also(retired_why(self, state)))
            return Action(k=k, proposer=winner, width=state.tree_width)
        self.why = (f"{winner} γ {k}: α ≈ {alphas[winner]:.2f}, {ms:.1f} ms/token vs {plain_ms:.1f} plain"
                    + (f" ({'; '.join(skipped)})" if skipped else "") + and_also(retired_why(self, state)))
        return Action(k=k, proposer=winner)

    def _best_tree(self, state: DecodeState, alpha: float) -> tuple[int, float, float] | None:
        """The draft's cheapest token tree per expected token, (nodes, ms/token, E[tokens]), where
        the run grows trees; None where it does not or none fits. E[tokens] is the static tree's
        (tree.static_choices: the N best rank paths under the per-rank acceptance q, q_0 = α, q_r
        the run's own EWMA shrunk to the prior α(1 − α)^r), one more for the target's own token;
        the price, the draft's reads a level (its depth + 1) and the verify of N + 1 rows, from the
        table's tree figures: a table without them (older ones, llama.cpp's) prices no tree."""
        width = state.tree_width
        if width < 2 or "draft" not in state.proposers or not self.costs.prices_trees:
            return None
        prior = geometric_ranks(alpha, width)
        q = [alpha] + [blended(self._rank(r).alpha, self._rank(r).trials, prior[r]) for r in range(1, width)]
        best = None
        for budget in TREE_NODES:
            nodes = min(budget, state.remaining - 1)
            if nodes < 2:
                continue
            choices = static_choices(q, nodes, width, K_MAX)
            tokens = 1.0 + sum(math.prod(q[r] for r in path) for path in choices)
            levels = min(max(map(len, choices)) + 1, nodes, K_MAX)
            ms = self.costs.tree_step_ms(nodes, levels, state.context_len) / tokens
            if best is None or ms < best[1]:
                best = (nodes, ms, tokens)
        return best

    def _rank(self, r: int) -> AcceptanceEWMA:
        while len(self._ranks) < r:
            self._ranks.append(AcceptanceEWMA())
        return self._ranks[r - 1]

    def observe(self, record) -> None:
        """A token tree's step: how often each sibling rank's child stood where the walk reached it."""
        if record.tree_parents:
            width = max(record.tree_parents.count(p) for p in set(record.tree_parents))  # its widest node's children
            took, had, _ = rank_counts([(record.tree_parents, record.draft_ids, record.token_ids[: record.accepted])],
                                       width)
            for r in range(1, width):
                self._rank(r).add(took[r], had[r])

    def _best(self, state: DecodeState, proposer: str, alpha: float) -> tuple[int, float]:
        """The cheapest k per expected token for one proposer (k = 0 first: ties stay plain)."""
        ks = grid_for(state, proposer)
        key = (alpha, self.costs.band(state.context_len), ks)
        last = self._last.get(proposer)
        if not (last and last[0] == key):
            ks_arr = np.array(ks)
            ms = np.array([self.costs.step_ms(int(k), state.context_len, proposer) for k in ks])
            per_token = ms / expected_tokens(alpha, ks_arr)
            i = int(np.argmin(per_token))
            self._last[proposer] = last = (key, (int(ks_arr[i]), float(per_token[i])))
        return last[1]

    def _plain_why(self, state: DecodeState, alphas: dict[str, float], plain_ms: float) -> str:
        seen = ", ".join(f"{p} {a:.2f}" for p, a in alphas.items()) if len(state.proposers) > 1 else (
            f"{next(iter(alphas.values())):.2f}" if alphas else "")
        blind = [p for p in state.proposers if lookahead_of(state, p) <= 0]
        missing = unpriced(self.costs, state)
        return ("plain: " + (f"α ≈ {seen}: " if seen else "") + f"no γ beats plain decoding ({plain_ms:.1f} ms/token)"
                + (f"; {', '.join(blind)}: nothing to propose" if blind else "")
                + (f"; {', '.join(missing)}: no costs measured" if missing else "") + and_also(retired_why(self, state)))

    def reset(self) -> None:
        self._last, self._ledger, self._ranks = {}, (0, {}), []

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        return reuse_that_pays(self.costs, offered, n_prompt)
