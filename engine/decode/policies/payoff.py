"""When drafting pays, judged from a measured cost table: the cost-aware policies' (`rakv`, `speckv`)
shared reasoning about probes after plain steps, the draft's catch-up read and prefix reuse. Every
judgement reads the table's times, never the wall clock, so what-if replay stays exact."""
from __future__ import annotations

from engine.decode.acceptance import candidates, expected_tokens
from engine.decode.costs import CostTable
from engine.decode.records import K_MAX, UNBOUNDED, DecodeState, StepRecord
from engine.decode.tree import tree_levels

# Plain (k = 0) steps teach an adaptive policy nothing about acceptance, so after PROBE_AFTER of
# them in a row `speckv` and `rakv` draft one token to refresh what they know. A probe costs a
# little when speculation does not pay (a tier where the target is cheap, a text the draft gets
# wrong), so each drafting run that bought nothing doubles the wait, up to PROBE_MAX.
PROBE_AFTER = 8
PROBE_MAX = 64
PROBE_ALPHA = 0.6  # the per-token acceptance a probe bets on, where a policy has no prior of its own


def drafted_by(rec: StepRecord) -> str:
    """The proposer that drafted a step, "" when nothing was drafted. Records from before
    proposers had names (and hand-made ones) drafted with the draft model."""
    return (getattr(rec, "proposer", "") or "draft") if rec.k_drafted else ""


def priced(costs: CostTable, rec: StepRecord) -> float:
    """A recorded step in the table's time: a chain's step_ms, a token tree's draft levels and verify."""
    if getattr(rec, "tree_parents", None):
        return costs.tree_step_ms(rec.k_drafted, tree_levels(rec.tree_parents, rec.k_drafted, K_MAX), rec.context_len)
    return costs.step_ms(rec.k_drafted, rec.context_len, drafted_by(rec) or "draft")


def _plain(rec: StepRecord, proposer: str | None = None) -> bool:
    """A step that taught nothing about acceptance: plain decoding, or (for one `proposer`'s
    probes) a step that proposer did not draft, another one's included."""
    if proposer is None:
        return rec.step > 0 and rec.k_chosen == 0
    return rec.step > 0 and drafted_by(rec) != proposer


def _paid(run: list[StepRecord], costs: CostTable) -> bool:
    """Whether a drafting run between plain steps beat plain decoding after its first step (the
    one that found it: a probe, or the opening guess). Judged by outcome in the cost table's time,
    not by the policy's hopes: a probe whose token was accepted and that led to one unlucky k = 2
    step bought nothing, and judging by "the policy went on drafting" would reset the wait to
    PROBE_AFTER after it, again and again on a tier where drafting barely pays. The table's time,
    not the measured one, keeps replay exact."""
    bought = run[1:]
    ms = sum(priced(costs, r) for r in bought)
    plain_ms = sum(r.emitted * costs.step_ms(0, r.context_len) for r in bought)
    return bool(bought) and plain_ms > ms


def reuse_that_pays(costs: CostTable, offered: int, n_prompt: int) -> int:
    """The reuse half of RAKV-ASD's joint choice: take the prefix cache's `offered` positions
    when the measured prefill with them (fill those, read the rest) beats reading the whole
    prompt; without prefill costs in the table, take them (a hit never reads more than a miss)."""
    cold, reused = costs.prefill_cost(n_prompt, 0), costs.prefill_cost(n_prompt - offered, offered)
    return offered if cold is None or reused < cold else 0


def catchup_pays(costs: CostTable, state: DecodeState, ms_per_token: float, proposer: str = "draft") -> bool:
    """Whether drafting with `proposer` at an expected `ms_per_token` for the rest of the run
    saves more than its catch-up read costs (the draft model's: the whole prompt before a
    request's first draft, less what the prefix cache hands it, then what was emitted since it
    last drafted): reuse thus shifts what drafting must earn back, the other half of RAKV-ASD's
    joint choice. Without catch-up measurements (an n-gram lookup has no read), it does."""
    unread = state.draft_unread if proposer == "draft" else state.unread.get(proposer, (0, 0))
    cost = costs.catchup_cost(*unread, state.context_len, proposer) if any(unread) else None
    if not cost:
        return True
    return (costs.step_ms(0, state.context_len) - ms_per_token) * state.remaining > cost


def grid_for(state: DecodeState, proposer: str) -> tuple[int, ...]:
    """The draft lengths to weigh for one proposer: the candidates that fit the budget, capped
    by how far it can propose now (a 3-token n-gram continuation turns 4, 6 and 8 into 3)."""
    cap = lookahead_of(state, proposer)
    return tuple(sorted({min(k, cap) for k in candidates(state)}))


def lookahead_of(state: DecodeState, proposer: str) -> int:
    """How far `proposer` can propose now (UNBOUNDED: a model, or a state that does not say)."""
    return state.lookahead.get(proposer, UNBOUNDED)


def drafting_pays(costs: CostTable, state: DecodeState, alpha: float, proposer: str = "draft") -> bool:
    """Whether, at per-token acceptance `alpha`, some draft length that fits (and that the
    proposer can propose now) costs less per expected token than a plain step at this context."""
    ks = [k for k in grid_for(state, proposer) if k > 0]
    plain = costs.step_ms(0, state.context_len)
    return any(costs.step_ms(k, state.context_len, proposer) < plain * float(expected_tokens(alpha, k)) for k in ks)


def probe_pays(costs: CostTable, state: DecodeState, alpha: float, proposer: str = "draft") -> bool:
    """A probe (one drafted token) bets that acceptance is back at `alpha`. It is worth taking
    only if drafting at that acceptance would pay at this context at all (on a long prompt a
    verify of several rows costs ~2 plain steps here: a probe there only loses, whatever it
    finds) and would repay the proposer's catch-up read (`catchup_pays`)."""
    return (drafting_pays(costs, state, alpha, proposer)
            and catchup_pays(costs, state, costs.step_ms(1, state.context_len, proposer) / (1.0 + alpha), proposer))


def probe_due(state: DecodeState, costs: CostTable, proposer: str | None = None) -> bool:
    """Whether this step should draft one token to probe acceptance (see PROBE_AFTER). With a
    `proposer`, that one's acceptance: its wait counts the steps it did not draft (plain ones
    and other proposers'), and its own drafting runs double or reset the wait, so a proposer
    that looked bad is retried as a lone draft would be, while another one drafts meanwhile."""
    hist, i = state.history, len(state.history) - 1
    streak = 0
    while i >= 0 and _plain(hist[i], proposer):
        streak, i = streak + 1, i - 1
        if streak >= PROBE_MAX:  # due whatever came before: no need to walk a long run's whole history
            return True
    wait = PROBE_AFTER
    # Walking back: … plain, drafting run hist[j+1 .. i], plain × streak; each run that did not
    # pay doubles the wait, the newest one that did ends the walk. At the prefill (hist[0]) the
    # walk ends; a generation that opened with plain decoding counts as one run that bought
    # nothing: the policy's verdict on the typical signals (speckv's defaults, rakv's prior α0)
    # is the first evidence that drafting rarely pays on this tier.
    while wait < PROBE_MAX and i >= 0:
        j = i
        while j >= 1 and not _plain(hist[j], proposer):
            j -= 1
        if _paid(hist[j + 1 : i + 1], costs):
            break
        wait *= 2
        if j == 0:
            break
        i = j
        while i >= 0 and _plain(hist[i], proposer):
            i -= 1
    return streak >= min(wait, PROBE_MAX)
