"""The one decode loop: policy → propose → verify → record, whatever proposes and verifies.

Live generations run it over model-backed oracles (engine/oracles/draft.py, target.py), what-if replay
over trace-backed ones (engine/oracles/trace.py): the same function makes every choice in both,
so a replay is the live run by construction (docs/architecture.md, "The step")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from engine.decode.policies import Policy
from engine.decode.records import (
    AcceptanceEWMA,
    Action,
    DecodeState,
    DraftToken,
    RunSummary,
    StepRecord,
    signal_summary,
)
from engine.decode.tree import DraftTree, root_rank_hits


class Proposer(Protocol):
    name: str  # the run's key for it: "draft", "eagle", "ngram", "suffix" (engine/oracles/__init__.py)
    unread: tuple[int, int]  # context tokens its next draft reads first: (into an empty cache, after its cache)

    def lookahead(self) -> int:
        """Tokens it can propose now without running a model (0: none; UNBOUNDED for a model).
        A function of the context alone, like its proposal (see docs/architecture.md, "Traces
        and replay")."""
        ...

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        """Up to k tokens after the context; asks keep_drafting(j, token) after each but the last."""
        ...

    def update(self, accepted: int, emitted: list[int]) -> None:
        """The step's outcome: `emitted` extends the context (the first `accepted` of it are the
        drafted tokens that stood). Every proposer of a run hears every step; one that did not
        draft it takes `emitted` as context."""
        ...

    # A proposer that drafts token trees also has
    #   propose_tree(nodes, width) -> DraftTree: at most `nodes` nodes, at most `width` children a node
    # and hears the step's outcome through `update` as a step that drafted nothing.


class Verifier(Protocol):
    ended: bool  # the last emitted token ends the text (EOS, or the end of a stored trace)
    reused: int  # prompt positions the prefill took from the prefix cache

    def prefill(self, take: Callable[[int], int]) -> int:
        """Reads the prompt (taking take(offered) of the positions a prefix cache offers);
        returns the first token."""
        ...

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        """(accepted n, emitted tokens: the accepted ones and one of the target's, cut at EOS)."""
        ...

    def verify_tree(self, tree: DraftTree) -> tuple[list[int], list[int]]:
        """(accepted rows, root first below it; emitted tokens, as `verify`'s) for a token tree."""
        ...


@dataclass(frozen=True)
class Setting:
    """What a run's steps are recorded against."""

    n_prompt: int
    budget: int  # tokens the run may emit (max_new_tokens, or what the context leaves)
    target_tier: str
    kv_tier: str


class ModelledClock:
    """Replay's time: a trace verifier advances it by the cost table's price of each step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decode(proposers: dict[str, Proposer] | Proposer, verifier: Verifier, policy: Policy, run: Setting,
           clock: Callable[[], float]) -> Iterator[StepRecord]:
    """Streams the run's StepRecords: step 0 is the prefill, then one per decode step.
    `proposers`: name → Proposer (a bare Proposer is the draft); the policy's Action.proposer
    says which one drafts a step, and every one hears each step's outcome, in dict order."""
    if not isinstance(proposers, dict):
        proposers = {"draft": proposers}
    policy.reset()
    acc, history = AcceptanceEWMA(), []
    # Trees where the draft grows them and the verifier reads them (not llama.cpp's, not a trace without trees).
    tree_width = (getattr(proposers.get("draft"), "tree_width", 0) or 0) if hasattr(verifier, "verify_tree") else 0
    by: dict[str, AcceptanceEWMA] = {}  # per proposer, over the steps it drafted
    t0 = clock()
    first = verifier.prefill(lambda offered: policy.take_reuse(offered, run.n_prompt))
    for p in proposers.values():
        p.update(0, [first])
    history.append(_record(0, 0, Action(0, verifier.reused), "", [], [first], 0, (0.0, clock() - t0, 0.0), run))
    yield history[-1]
    position = 1
    while not verifier.ended and position < run.budget:
        remaining = run.budget - position
        unread = {name: p.unread for name, p in proposers.items()}
        state = DecodeState(step=len(history), position=position, context_len=run.n_prompt + position,
                            remaining=remaining, target_tier=run.target_tier, kv_tier=run.kv_tier,
                            history=history, alpha_ewma=acc.alpha, alpha_trials=acc.trials,
                            draft_unread=unread.get("draft", (0, 0)), proposers=tuple(proposers),
                            lookahead={name: p.lookahead() for name, p in proposers.items()}, unread=unread,
                            alphas={name: (a.alpha, a.trials) for name, a in by.items()}, tree_width=tree_width)
        t0 = clock()
        action = policy.choose(state)
        k = min(action.k, remaining - 1)  # never draft past the budget: the bonus token needs a slot
        assert action.k == 0 or action.proposer in proposers, (action.proposer, tuple(proposers))
        t1 = clock()
        tree = None
        if k and action.width > 1:  # a token tree of at most k nodes, one verify read
            tree = proposers[action.proposer].propose_tree(k, action.width)
            drafted = tree.drafts
        else:
            drafted = proposers[action.proposer].propose(k, lambda j, token: policy.keep_drafting(state, j, token)) if k else []
        t2 = clock()
        if tree is not None:
            path, emitted = verifier.verify_tree(tree)
            n = len(path)
        else:
            n, emitted = verifier.verify(drafted)
        t3 = clock()
        assert 0 < len(emitted) <= remaining and n <= len(drafted), (n, len(drafted), len(emitted), remaining)
        for p in proposers.values():
            p.update(n, emitted)
        name = action.proposer if drafted else ""
        if tree is not None:  # α: how often a reached node's first child stood (a chain's next token)
            hits = root_rank_hits(tree.parents, tree.tokens, emitted[:n])
            acc.add(*hits)
            by.setdefault(name, AcceptanceEWMA()).add(*hits)
        else:
            acc.update(n, len(drafted))
            if name:
                by.setdefault(name, AcceptanceEWMA()).update(n, len(drafted))
        rec = _record(len(history), position, action, name, drafted, emitted, min(n, len(emitted)),
                      (t2 - t1, t3 - t2, t1 - t0), run)
        if tree is not None:
            rec.tree_parents = list(tree.parents)
        policy.observe(rec)
        history.append(rec)
        yield rec
        position += len(emitted)


def draft_tokens(k: int, keep_drafting: Callable[[int, DraftToken], bool],
                 next_token: Callable[[int], DraftToken]) -> list[DraftToken]:
    """Every proposer's inner loop: token j = next_token(j), until k or the policy says stop."""
    drafted: list[DraftToken] = []
    for j in range(k):
        drafted.append(next_token(j))
        if j + 1 < k and not keep_drafting(j, drafted[-1]):
            break
    return drafted


def _record(step: int, position: int, action: Action, proposer: str, drafted: list[DraftToken], emitted: list[int],
            accepted: int, ms: tuple[float, float, float], run: Setting) -> StepRecord:
    ents, confs = [d.entropy for d in drafted], [d.confidence for d in drafted]
    return StepRecord(
        step=step, position=position, k_chosen=action.k, k_drafted=len(drafted), accepted=accepted,
        emitted=len(emitted), token_ids=list(emitted), **signal_summary(ents, confs), entropies=ents,
        confidences=confs, draft_ms=ms[0], verify_ms=ms[1], decide_ms=ms[2],
        context_len=run.n_prompt + position, target_tier=run.target_tier, kv_tier=run.kv_tier, reuse=action.reuse,
        proposer=proposer, draft_ids=[d.token_id for d in drafted],
    )


def summarize(records: list[StepRecord], wall_ms: float, stop: str, prefix_hit: str = "off") -> RunSummary:
    """A finished run's figures from its records (step 0's verify time is the TTFT, its reuse
    the prompt positions taken from the prefix cache)."""
    n_tokens = sum(r.emitted for r in records)
    steps = records[1:]
    drafted = [r for r in steps if r.k_drafted > 0]
    n_drafted = sum(r.k_drafted for r in drafted)
    return RunSummary(
        n_tokens=n_tokens,
        n_steps=len(steps),
        wall_ms=wall_ms,
        ttft_ms=records[0].verify_ms,
        tokens_per_s=n_tokens / (wall_ms / 1e3) if wall_ms > 0 else 0.0,
        tokens_per_step=sum(r.emitted for r in steps) / len(steps) if steps else 0.0,
        mean_accepted=sum(r.accepted for r in drafted) / len(drafted) if drafted else 0.0,
        acceptance_rate=sum(r.accepted for r in drafted) / n_drafted if n_drafted else None,
        stop_reason=stop,
        reused_tokens=records[0].reuse,
        prefix_hit=prefix_hit,
    )
