"""The values that cross the engine's boundaries: what a policy sees and returns, what a proposer
drafts, and what a step and a run leave behind (the units the store keeps). See
docs/architecture.md, "Records"."""
from __future__ import annotations

from dataclasses import dataclass, field

K_MAX = 8  # longest draft any policy may ask for: the acceptance traces record L(p) up to 8
TREE_MAX_NODES = 16  # a token tree's node budget at most: its verify reads 17 rows, which the kernels stream at once
ALPHA_DECAY = 0.8  # EWMA weight of the past in the acceptance estimate: ~5 steps of memory


class Positive(int):
    """An option that counts something (the suffix history's budget in tokens): an integer ≥ 1,
    so that `@suffix:budget=0` fails where the spec is parsed, before any model loads."""

    def __new__(cls, value: object) -> "Positive":
        number = int(value)  # type: ignore[call-overload]
        if number < 1:
            raise ValueError(f"{number} is not positive")
        return super().__new__(cls, number)


# The proposers a run may draft with, in their canonical order (a run's, a trace's), and the
# options each takes in a policy spec (`fixed:3@ngram:max=3,min=2`); engine/oracles/__init__.py
# builds them. Here, not there, so that parsing a policy loads no model code.
# draft:vocab=K: the draft's LM head cut to the K most frequent target tokens (engine/runtime/vocab_head.py).
PROPOSER_OPTIONS: dict[str, dict[str, type]] = {"draft": {"vocab": int}, "eagle": {}, "ngram": {"max": int, "min": int},
                                                "suffix": {"budget": Positive, "depth": int, "prob": float}}
PROPOSER_NAMES = tuple(PROPOSER_OPTIONS)
# What a proposer's `lookahead()` says when a model drafts: it can propose any number of tokens.
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Action:
    """What a policy decides before drafting."""

    k: int  # draft length γ; 0 = plain decoding (one target forward, one token)
    reuse: int = 0  # prompt positions taken from the cross-request prefix cache (step 0)
    proposer: str = "draft"  # who drafts the k tokens (one of the run's proposers; unused at k = 0)
    # children a node at most: 1 drafts a chain of k; more, a token tree of at most k nodes
    # (engine/decode/tree.py), verified in one target read
    width: int = 1

    def __post_init__(self) -> None:
        assert self.k >= 0 and self.reuse >= 0 and self.width >= 1, self


@dataclass
class StepRecord:
    """One decode step, as streamed to the UI and stored in DuckDB's `steps` table."""

    step: int  # 0 is the prefill, which emits the first token
    position: int  # generated tokens before this step
    k_chosen: int  # the policy's γ
    k_drafted: int  # tokens actually drafted (≤ k_chosen: early stop, max-length cap)
    accepted: int  # drafted tokens the target accepted
    emitted: int  # tokens appended this step (accepted + 1, fewer at EOS/max length)
    token_ids: list[int]
    mean_entropy: float | None  # bits, over drafted positions; None when nothing was drafted
    max_entropy: float | None
    mean_confidence: float | None  # max draft probability, averaged over drafted positions
    min_confidence: float | None
    entropies: list[float]
    confidences: list[float]
    draft_ms: float
    verify_ms: float
    decide_ms: float
    context_len: int  # tokens in the context before the step (prompt + generated)
    target_tier: str
    kv_tier: str
    reuse: int = 0
    proposer: str = ""  # the proposer that drafted the step; "" when nothing was drafted (k_drafted == 0)
    # A token tree's shape: the parent row of each drafted node (0: the root, the newest token
    # before the step; node i is row i + 1), in the order the signals and k_drafted count them;
    # empty for a chain. `accepted` is then the length of the accepted root path.
    tree_parents: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)  # the drafted tokens (a chain's, or a tree's nodes in row order)


@dataclass
class DecodeState:
    """Everything known before drafting: what a policy may base its choice on.

    It deliberately holds nothing about the tokens about to be drafted, so a learned controller
    cannot leak the answer into its own features (SpecKV's flaw; docs/architecture.md)."""

    step: int
    position: int
    context_len: int
    remaining: int  # tokens still allowed by max_new_tokens
    target_tier: str
    kv_tier: str
    history: list[StepRecord] = field(default_factory=list)
    alpha_ewma: float | None = None  # per-token acceptance, EWMA over drafted steps
    alpha_trials: float = 0.0  # the (decayed) trials behind alpha_ewma: how much to trust it
    # Context tokens the draft would read before drafting, (into an empty cache, after its
    # cache): the whole prompt before its first draft (its prefill is lazy), then what was
    # emitted since it last drafted. A catch-up that drafting must earn back.
    draft_unread: tuple[int, int] = (0, 0)
    # The run's proposers, in order (the policy's Action.proposer names one of them), and per
    # proposer: how many tokens it can propose now without running a model (0: none, e.g. an
    # n-gram proposer without a match; UNBOUNDED for a model), what it would read before drafting
    # (as draft_unread, which is the draft's), and its own acceptance EWMA (alpha, trials) over
    # the steps it drafted. Context only: nothing here says whether the next tokens are right.
    proposers: tuple[str, ...] = ("draft",)
    lookahead: dict[str, int] = field(default_factory=dict)
    unread: dict[str, tuple[int, int]] = field(default_factory=dict)
    alphas: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    # The width the draft can grow token trees at in this run (its proposer and the verifier both
    # take trees: live on torch, or a trace that holds them); 0: chains only.
    tree_width: int = 0

    @property
    def last(self) -> StepRecord | None:
        return self.history[-1] if self.history else None


@dataclass(frozen=True)
class DraftToken:
    """One drafted position: what a proposer returns and `Policy.keep_drafting` sees."""

    token_id: int
    entropy: float  # bits
    confidence: float  # max probability
    # The law [V] (a torch tensor) the token was drawn from, which rejection sampling divides
    # by; None where no model proposed it (a stored trace, under greedy decoding).
    p: object = field(default=None, compare=False, repr=False)


@dataclass
class RunSummary:
    n_tokens: int
    n_steps: int  # decode steps after the prefill
    wall_ms: float
    ttft_ms: float
    tokens_per_s: float  # generated tokens over wall time, prefill included
    tokens_per_step: float  # tokens emitted per decode step (prefill excluded)
    mean_accepted: float  # drafted tokens accepted per step that drafted (bonus token excluded)
    acceptance_rate: float | None  # accepted / drafted over the run; None when nothing was drafted
    stop_reason: str  # "eos" | "max_new_tokens" | "context" | "stopped" (the consumer ended it early)
    reused_tokens: int = 0  # prompt positions the prefill took from the prefix cache
    prefix_hit: str = "off"  # "off" (no reuse) | "miss" | "partial" | "exact" | "declined" (by the policy)


@dataclass
class AcceptanceEWMA:
    """EWMA of per-token acceptance, counting each step's trials as a truncated geometric:
    `accepted` successes and one failure unless the whole draft passed."""

    hits: float = 0.0
    trials: float = 0.0

    def update(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        self.add(accepted, accepted + (accepted < drafted))

    def add(self, hits: int, trials: int) -> None:
        """One step's successes out of its trials (a token tree's: tree.root_rank_hits)."""
        if trials:
            self.hits = ALPHA_DECAY * self.hits + hits
            self.trials = ALPHA_DECAY * self.trials + trials

    @property
    def alpha(self) -> float | None:
        return self.hits / self.trials if self.trials else None


def signal_summary(entropies: list[float], confidences: list[float]) -> dict[str, float | None]:
    """A step's four SpecKV features over its drafted positions: mean and max entropy (bits),
    mean and min confidence (max probability); None when nothing was drafted."""
    if not entropies:
        return dict(mean_entropy=None, max_entropy=None, mean_confidence=None, min_confidence=None)
    return dict(mean_entropy=sum(entropies) / len(entropies), max_entropy=max(entropies),
                mean_confidence=sum(confidences) / len(confidences), min_confidence=min(confidences))
