"""Exact what-if replay: any policy over stored acceptance traces, through the same step loop
a live run takes (engine/decode/step.py) with trace-backed oracles (engine/oracles/trace.py). The very
Policy objects the engine runs make the choices, seeing the same DecodeState and StepRecords,
so a replay reproduces the live run's steps one for one; a cost table turns the steps into
milliseconds. No model is loaded, no torch imported."""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.decode.costs import CostTable
from engine.decode.policies import Policy
from engine.decode.records import PROPOSER_NAMES, StepRecord
from engine.decode.step import ModelledClock, Setting, decode
from engine.oracles.trace import TraceProposer, TraceVerifier


@dataclass
class Replay:
    policy: str
    prompt: str
    task: str | None
    target_tier: str
    kv_tier: str  # the target's KV tier the trace was made at
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


class _SelfScored:
    """The policy itself, noting after each choice its own expected tokens (`last_expected`,
    where it has one): SpecKV scores its policy with its own predictor, the replay shows the gap."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.guesses = policy, []

    def choose(self, state):
        action = self.policy.choose(state)
        self.guesses.append(getattr(self.policy, "last_expected", None))
        return action

    def __getattr__(self, name: str):
        return getattr(self.policy, name)


def proposals(positions: list[dict]) -> dict[str, dict[int, dict]]:
    """A trace's `trace_positions` rows by proposer, then position (rows without a proposer,
    made before proposers had names, are the draft model's)."""
    out: dict[str, dict[int, dict]] = {}
    for r in positions:
        name = r.get("proposer")
        out.setdefault(name if isinstance(name, str) and name else "draft", {})[int(r["position"])] = r
    return out


def replay_proposers(policy: Policy, traced: dict[str, dict[int, dict]], prompt: str = "") -> tuple[str, ...]:
    """The proposers a replay of `policy` runs, in the canonical order (as a live run builds
    them): those it names, else every traced one; ValueError in one line for one not traced."""
    wanted = getattr(policy, "proposers", None)
    if not traced:  # a one-token output has no positions: nothing is ever drafted
        return tuple(wanted or ("draft",))
    if wanted is None:
        return tuple(n for n in PROPOSER_NAMES if n in traced)
    missing = [n for n in wanted if n not in traced]
    if missing:
        raise ValueError(f"the trace of {prompt[:40]!r} holds no proposals of {', '.join(missing)} (it has "
                         f"{', '.join(traced)}): trace the prompts again (`python -m engine trace`)")
    return tuple(n for n in PROPOSER_NAMES if n in wanted)


def replay(policy: Policy, trace: dict, positions: list[dict], costs: CostTable | None = None) -> Replay:
    """`trace`: a `traces` row (token_ids, prompt_ids, max_new_tokens, target_tier, kv_tier,
    prompt, task); `positions`: its `trace_positions` rows, for positions 1..N-1 of each traced
    proposer. The policy chooses among the traced proposers (or those its spec names). The
    steps are recorded at the trace's tiers (a row without a KV tier was made at native)."""
    out, n_prompt = list(trace["token_ids"]), len(trace["prompt_ids"])
    traced = proposals(positions)
    names = replay_proposers(policy, traced, trace.get("prompt", ""))
    for name in names:
        assert all(p in traced.get(name, {}) for p in range(1, len(out))), f"trace positions of {name} are incomplete"
    clock, scored = ModelledClock(), _SelfScored(policy)
    kv_tier = trace.get("kv_tier") if isinstance(trace.get("kv_tier"), str) else "native"
    run = Setting(n_prompt, int(trace["max_new_tokens"]), trace["target_tier"], kv_tier)
    config = trace.get("config")
    config = json.loads(config) if isinstance(config, str) else config if isinstance(config, dict) else {}
    width = config.get("tree_width")  # the draft's trees the trace holds (None: none)
    if getattr(policy, "tree_proposers", None) is not None and width is None:
        raise ValueError(f"policy {policy.name} drafts token trees; the trace of {trace.get('prompt', '')[:40]!r} holds "
                         "none (made before them): trace the prompts again (`python -m engine trace`)")
    proposers = {name: TraceProposer(traced.get(name, {}), n_prompt, costs, clock, name, width) for name in names}
    steps = list(decode(proposers, TraceVerifier(out, n_prompt, costs, clock), scored, run, clock))
    guessed = [(g, r.emitted) for g, r in zip(scored.guesses, steps[1:]) if g is not None]
    return Replay(getattr(policy, "name", "?"), trace.get("prompt", ""), trace.get("task"), run.target_tier, run.kv_tier,
                  steps, len(out), clock.now if costs else None,
                  sum(g for g, _ in guessed) if guessed else None, sum(e for _, e in guessed) or None)


def tier_label(target_tier: str, kv_tier: str | None) -> str:
    """One name for a (weight tier, KV tier) setting in tables: `fp32`, or `fp32/fp8` off the
    native KV tier."""
    return target_tier if kv_tier in (None, "native") else f"{target_tier}/{kv_tier}"


def summarize(replays: list[Replay], by: str = "task") -> list[dict]:
    """One row per (tier, KV tier, policy, task or prompt) plus "all": tokens, steps, modelled tokens/s."""
    if by not in ("task", "prompt"):
        raise ValueError(f"summarize by task or prompt, not {by!r}")
    groups: dict[tuple, list[Replay]] = {}
    for r in replays:
        for key in ((r.task or "-") if by == "task" else r.prompt, "all"):
            groups.setdefault((r.target_tier, r.kv_tier, r.policy, key), []).append(r)
    rows = []
    for (tier, kv, pol, task), rs in sorted(groups.items()):
        tokens = sum(r.n_tokens - 1 for r in rs)
        steps = sum(r.n_steps for r in rs)
        ms = sum(r.decode_ms or 0.0 for r in rs)
        pred = [r for r in rs if r.predicted_tokens is not None]
        realized = sum(r.realized_tokens_scored for r in pred)
        rows.append(dict(
            target_tier=tier, kv_tier=kv, tier=tier_label(tier, kv), policy=pol, **{by: task}, prompts=len(rs),
            tokens=tokens, steps=steps,
            tokens_per_step=tokens / steps if steps else 0.0,
            tokens_per_s=tokens / (ms / 1e3) if ms else None,
            # SpecKV scores its policy with its own predictor; the gap says how far that drifts.
            self_scored_gap=(sum(r.predicted_tokens for r in pred) / realized - 1.0) if realized else None,
        ))
    return rows
