"""Exact what-if replay (DESIGN.md, "Acceptance traces and exact what-if replay").

Under greedy decoding the emitted tokens do not depend on γ, so a trace (L(p) and the draft's
proposals at every position p of the target's output) says what any step would have done: at p
the policy picks k, min(L(p), k) drafted tokens are accepted, one target token follows, and the
run moves on. The very Policy objects the engine runs make the choices here, seeing the same
DecodeState and StepRecords, so a replay reproduces the live run's steps one for one. A cost
table turns steps into milliseconds. No model is loaded."""
from __future__ import annotations

from dataclasses import dataclass

from engine import signals
from engine.costs import CostTable
from engine.policies import Policy
from engine.records import AcceptanceEWMA, Action, DecodeState, DraftToken, StepRecord


@dataclass
class Replay:
    policy: str
    prompt: str
    task: str | None
    target_tier: str
    steps: list[StepRecord]  # step 0 (the prefill) first, as a live run records them
    n_tokens: int
    decode_ms: float | None  # Σ step costs after the prefill (None without a cost table)
    predicted_tokens: float | None = None  # Σ of the controller's own E[tokens] (SpecKV's self-score)
    realized_tokens_scored: int | None = None  # tokens of the steps it scored, for the gap

    @property
    def n_steps(self) -> int:
        return len(self.steps) - 1

    @property
    def tokens_per_step(self) -> float:
        return (self.n_tokens - 1) / self.n_steps if self.n_steps else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """Decode tokens (after the prefill's first) per second of modelled step costs."""
        return (self.n_tokens - 1) / (self.decode_ms / 1e3) if self.decode_ms else None

    def outcome(self) -> list[tuple[int, int, int, int]]:
        """(k chosen, k drafted, accepted, emitted) per decode step: what must match a live run."""
        return [(r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in self.steps[1:]]


def replay(policy: Policy, trace: dict, positions: list[dict], costs: CostTable | None = None,
           kv_tier: str = "native") -> Replay:
    """`trace`: a `traces` row (token_ids, prompt_ids, max_new_tokens, target_tier, prompt, task);
    `positions`: its `trace_positions` rows, for positions 1..N-1 in order."""
    out, n_prompt = list(trace["token_ids"]), len(trace["prompt_ids"])
    at = {int(r["position"]): r for r in positions}
    assert all(p in at for p in range(1, len(out))), "trace positions are incomplete"
    tier, budget = trace["target_tier"], int(trace["max_new_tokens"])
    policy.reset()
    acc = AcceptanceEWMA()
    records = [_record(0, 0, Action(0), [], out[:1], 0, n_prompt, tier, kv_tier, 0.0)]
    pos, ms, predicted, scored = 1, 0.0, 0.0, 0
    while pos < len(out):
        remaining = budget - pos
        state = DecodeState(step=len(records), position=pos, context_len=n_prompt + pos, remaining=remaining,
                            target_tier=tier, kv_tier=kv_tier, history=records, alpha_ewma=acc.alpha,
                            alpha_trials=acc.trials)
        action = policy.choose(state)
        k = min(action.k, remaining - 1)  # as the engine caps it: the bonus token needs a slot
        drafted = _draft(policy, state, at[pos], k)
        n = min(int(at[pos]["accept_len"]), len(drafted))
        new = out[pos: pos + n + 1]  # the output ends at EOS or at the budget: slicing cuts there
        cost = costs.step_ms(len(drafted), n_prompt + pos) if costs else 0.0
        ms += cost
        guess = getattr(policy, "last_expected", None)
        if guess is not None:
            predicted, scored = predicted + guess, scored + len(new)
        acc.update(n, len(drafted))
        rec = _record(len(records), pos, action, drafted, new, min(n, len(new)), n_prompt + pos, tier, kv_tier, cost)
        policy.observe(rec)
        records.append(rec)
        pos += len(new)
    return Replay(getattr(policy, "name", "?"), trace.get("prompt", ""), trace.get("task"), tier, records,
                  len(out), ms if costs else None, predicted if scored else None, scored or None)


def _draft(policy: Policy, state: DecodeState, at: dict, k: int) -> list[DraftToken]:
    drafted = []
    for j in range(k):
        drafted.append(DraftToken(int(at["draft_ids"][j]), float(at["entropies"][j]), float(at["confidences"][j])))
        if j + 1 < k and not policy.keep_drafting(state, j, drafted[-1]):
            break
    return drafted


def _record(step, position, action, drafted, new, accepted, context_len, tier, kv_tier, cost) -> StepRecord:
    ents = [d.entropy for d in drafted]
    confs = [d.confidence for d in drafted]
    return StepRecord(
        step=step, position=position, k_chosen=action.k, k_drafted=len(drafted), accepted=accepted,
        emitted=len(new), token_ids=list(new), **signals.summarize(ents, confs), entropies=ents,
        confidences=confs, draft_ms=0.0, verify_ms=cost, decide_ms=0.0, context_len=context_len,
        target_tier=tier, kv_tier=kv_tier, reuse=action.reuse,
    )


def summarize(replays: list[Replay], by: str = "task") -> list[dict]:
    """One row per (tier, policy, task or prompt) plus "all": tokens, steps, modelled tokens/s."""
    if by not in ("task", "prompt"):
        raise ValueError(f"summarize by task or prompt, not {by!r}")
    groups: dict[tuple, list[Replay]] = {}
    for r in replays:
        for key in ((r.task or "-") if by == "task" else r.prompt, "all"):
            groups.setdefault((r.target_tier, r.policy, key), []).append(r)
    rows = []
    for (tier, pol, task), rs in sorted(groups.items()):
        tokens = sum(r.n_tokens - 1 for r in rs)
        steps = sum(r.n_steps for r in rs)
        ms = sum(r.decode_ms or 0.0 for r in rs)
        pred = [r for r in rs if r.predicted_tokens is not None]
        realized = sum(r.realized_tokens_scored for r in pred)
        rows.append(dict(
            target_tier=tier, policy=pol, **{by: task}, prompts=len(rs), tokens=tokens, steps=steps,
            tokens_per_step=tokens / steps if steps else 0.0,
            tokens_per_s=tokens / (ms / 1e3) if ms else None,
            # SpecKV scores its policy with its own predictor; the gap says how far that drifts.
            self_scored_gap=(sum(r.predicted_tokens for r in pred) / realized - 1.0) if realized else None,
        ))
    return rows
