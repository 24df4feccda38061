"""Measuring a pair: acceptance traces, cost tables, and profiling sweeps, all through the
model-backed oracles a live run uses (docs/architecture.md, "Traces and replay", "Costs").

A trace records, at every position p of the target's greedy output, what every proposer the
pair has proposes from there: its k_max greedy tokens, their entropy/confidence, L(p) (how many
of them match the output) and its lookahead. It is one live run of plain decoding in which,
before each target step, every proposer drafts k_max tokens and then hears that none stood and
the target's token followed. The draft reads the prompt alone, then one token at a time; a live
run's catch-up reads several at once, which the draft's row-invariant forward computes bit for
bit alike, so any policy replays over a trace exactly (engine/lab/whatif.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import torch

from engine.base.helpers import median_ms
from engine.decode.costs import CONTEXT_BUCKETS, REPS, WARMUP, CostTable, DraftCost, buckets_for, monotone, reps_at
from engine.decode.policies import K_MAX, make_policy
from engine.decode.records import TREE_MAX_NODES, UNBOUNDED, DraftToken
from engine.decode.tree import TREE_WIDTH, DraftTree, tree_levels
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.lab.timing import SPREAD_LIMIT, MachineBusy, Neighbours, busy_limit, timed_medians
from engine.oracles import PROPOSERS, available, build, draft_head, target_verifier
from engine.oracles.draft import DraftModelProposer, draft_read
from engine.oracles.sampling import Sampler, law_sum, warp
from engine.oracles.target import target_reads
from engine.runtime.forward import crop_to, forward_logits, sync_device
from engine.runtime.kv.cache import new_cache
from engine.runtime.models import ModelPair, pair_device
from engine.runtime.prefix.cache import fill, kv_of

# The draft's token tree a trace records at each position: the largest node budget a tree policy
# takes, at one width; a tree:N×TRACE_TREE_WIDTH policy replays the first N rows of it.
TRACE_TREE_NODES = TREE_MAX_NODES
TRACE_TREE_WIDTH = TREE_WIDTH


@dataclass
class Trace:
    """One traced prompt: the `traces` row and its `trace_positions` rows (store/schema.py)."""

    row: dict
    positions: list[dict]


def _always(j: int, token: DraftToken) -> bool:
    return True


def trace(pair: ModelPair, prompt: str, task: str | None = None, max_new_tokens: int = 128,
          chat: bool = True, k_max: int = K_MAX, temperature: float | None = None,
          kv_tier: str = "native", proposers: tuple[str, ...] | None = None, history=None) -> Trace:
    """`tracing` run to its end: the Trace."""
    *_, made = tracing(pair, prompt, task, max_new_tokens, chat, k_max, temperature, kv_tier, proposers, history)
    assert isinstance(made, Trace)
    return made


@torch.inference_mode()  # on a generator: each step resumes inside the mode
def tracing(pair: ModelPair, prompt: str, task: str | None = None, max_new_tokens: int = 128,
            chat: bool = True, k_max: int = K_MAX, temperature: float | None = None,
            kv_tier: str = "native", proposers: tuple[str, ...] | None = None,
            history=None) -> Iterator[Trace | None]:
    """A trace a target step per item (None), the Trace last: whoever shares the models (the
    workbench's decode slot) takes turns between the steps. The target's greedy output for
    `prompt` (its KV cache at `kv_tier`) and every proposer's (`proposers`, default: all the pair
    has) k_max-token proposals along it. With `temperature`, each position also gets Σ min(p, q)
    of the warped first-token laws (the acceptance probability speculative sampling would have
    there), for proposers whose tokens carry a law. The suffix proposer reads `history` (a
    SuffixHistory, snapshotted here; None: none), which the row's config describes: a live run
    replays exactly over the trace when it read the same."""
    ids = encode_prompt(pair.tokenizer, prompt, chat)
    Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=max_new_tokens, kv_tier=kv_tier))  # checks them as a run does
    sampler = Sampler(0.0, 1.0, None, pair.device)
    verifier = target_verifier(pair, ids, sampler, kv_tier=kv_tier)
    seen = history.snapshot() if history is not None else None
    props = build(pair, ids, sampler, verifier, proposers, history=seen)
    # Plain decoding, as `ar` runs it: the same budget, the same target steps, so `out` is
    # exactly what plain decoding emits at this KV tier. Before each step every proposer drafts
    # k_max tokens from the context and is then told that none stood (update(0, [token])): a
    # step a live run could take, so each proposer is in the state a live run leaves it at that
    # context, whatever it drafted before (the exactness duty, docs/architecture.md).
    budget = min(max_new_tokens, pair.max_context - len(ids))
    yield None  # the proposers have read the prompt (the draft's prefill); the target's is next
    first = verifier.prefill()
    for prop in props.values():
        prop.update(0, [first])
    out, drafts = [first], []
    yield None
    grower = props.get("draft") if hasattr(props.get("draft"), "propose_tree") else None
    trees = []  # the draft's tree at each position, grown before its chain (it leaves the draft as it found it)
    while not verifier.ended and len(out) < budget:
        if grower is not None:
            try:
                trees.append(grower.propose_tree(TRACE_TREE_NODES, TRACE_TREE_WIDTH))
            except ValueError:  # a draft whose cache cannot read trees: its chains alone
                grower, trees = None, []
        drafts.append({name: (prop.lookahead(), prop.propose(k_max, _always)) for name, prop in props.items()})
        _, emitted = verifier.verify([])
        for prop in props.values():
            prop.update(0, emitted)
        out.extend(emitted)
        yield None
    q = _target_laws(pair, ids, out, temperature, kv_tier) if temperature else None  # [N, V]
    positions = [_position(p, name, lookahead, drafted, out, len(ids), q, temperature)
                 for p, at in enumerate(drafts, start=1) for name, (lookahead, drafted) in at.items()]
    for row in positions if trees else []:
        if row["proposer"] == "draft":
            tree = trees[row["position"] - 1]
            row.update(tree_ids=list(tree.tokens), tree_parents=list(tree.parents))
    stop = "eos" if verifier.ended else "max_new_tokens" if budget == max_new_tokens else "context"
    row = dict(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
               draft_tier=pair.draft_tier, kv_tier=kv_tier, device=pair_device(pair), prompt=prompt, task=task, chat=chat,
               max_new_tokens=max_new_tokens, k_max=k_max, prompt_ids=ids, token_ids=out,
               stop_reason=stop, config=dict(temperature=temperature, proposers=list(props),
                                             tree_width=TRACE_TREE_WIDTH if trees else None))
    if "suffix" in props:
        row["config"]["suffix_history"] = props["suffix"].history.describe()
    yield Trace(row, positions)


def _position(p: int, name: str, lookahead: int, drafted: list[DraftToken], out: list[int], n_prompt: int,
              q: torch.Tensor | None, temperature: float | None) -> dict:
    """One proposer's trace_positions row at position p: its proposal and L(p)."""
    n = 0
    while n < len(drafted) and p + n < len(out) and drafted[n].token_id == out[p + n]:
        n += 1
    accept_prob = None
    if q is not None and drafted and drafted[0].p is not None:  # the greedy law p; warped: ∝ p^(1/T)
        p_warped = torch.softmax(torch.log(drafted[0].p) / temperature, dim=-1)
        accept_prob = float(law_sum(torch.minimum(p_warped, q[p])))
    elif q is not None and drafted:  # a deterministic proposal (one-hot p, given as None): accepted with q(x)
        accept_prob = float(q[p][drafted[0].token_id])
    return dict(position=p, proposer=name, accept_len=n, draft_ids=[d.token_id for d in drafted],
                entropies=[d.entropy for d in drafted], confidences=[d.confidence for d in drafted],
                accept_prob=accept_prob, context_len=n_prompt + p, lookahead=min(lookahead, UNBOUNDED))


def _target_laws(pair, ids, out, temperature, kv_tier: str = "native") -> torch.Tensor:
    """q at every output position p (the law of out[p] given the prefix): [N, V]."""
    if pair.engine == "llamacpp":
        ctx = pair.target.lease(kv_tier)
        try:
            ctx.truncate(0)
            logits = torch.from_numpy(ctx.read(ids + out[:-1], len(out))[:, : pair.vocab_size])
        finally:
            pair.target.release(ctx)
        return warp(logits, temperature, 1.0)
    with target_reads(pair, kv_tier)():
        logits, _ = forward_logits(pair.target, ids + out[:-1], new_cache(pair.target, kv_tier), len(out), pair.vocab_size)
    return warp(logits, temperature, 1.0)


# Plain steps before the timed draft that prices another proposer's warm catch-up: each is a target
# forward per repetition, and the catch-up per token is linear enough that two show it.
WARM_STEPS = 2
# Timed reads of a whole bucket (the target's prefill, the draft's cold read), spread over a
# bucket's rounds: seconds each at long contexts, so steady in fewer samples, and most of a round
# when timed in all of them (one thread, 512 tokens: 4.0 s + 4.4 s of a 12 s round).
LONG_REPS = 3


# Tries of a whole cost measurement on a machine other processes keep busy, before it is refused.
BUSY_TRIES = 2


def measure_costs(pair: ModelPair, buckets: tuple[int, ...] = CONTEXT_BUCKETS, reps: int = REPS,
                  progress: Callable[[str], None] = lambda m: None, kv_tier: str = "native",
                  proposers: tuple[str, ...] | None = None) -> CostTable:
    """Times the live oracles on a context of `bucket` random tokens: one drafted token (a draft
    forward, its law and signals), a verify of k = 0..8 drafted tokens (the target forward under
    the pair's verify mode, acceptance, roll-back), the target's prefill and the draft's catch-up
    reads (the bucket's tokens into an empty cache; K_MAX tokens after them); and filling a cache
    from the prefix cache, per position. Medians after warm-up (engine/lab/timing.py: disturbed
    calls timed again, rounds added where they disagree); the prefill and the cold read (a whole
    bucket each) in LONG_REPS of the rounds. Each other proposer (`proposers`, default: all the
    pair has) is timed in the same turns as a live run drives it (`_Driven`). The target's cache
    is at `kv_tier`: its reads dequantize the context (the draft's stays native).
    The table is made monotone (costs.monotone) and stamped with its spread and with other
    processes' CPU use while it ran; measured again when that was over busy_limit(), and refused
    (MachineBusy) when it stays so."""
    for attempt in range(BUSY_TRIES):
        watch = Neighbours()
        table = _measure_costs(pair, buckets, reps, progress, kv_tier, proposers)
        cores = watch.cores()
        if cores is None or cores <= busy_limit():
            return replace(table, busy=cores)
        progress(f"other processes used {cores:.2f} of a core while the costs were measured: measuring again")
    raise MachineBusy("the cost table", cores)


@torch.inference_mode()
def _measure_costs(pair: ModelPair, buckets: tuple[int, ...], reps: int, progress: Callable[[str], None],
                   kv_tier: str, proposers: tuple[str, ...] | None) -> CostTable:
    dev = pair.device
    buckets = buckets_for(None, pair.max_context, buckets)
    others = [n for n in (proposers or available(pair)) if n != "draft"]
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(0.0, 1.0, None, dev)
    sync = lambda: sync_device(dev)  # noqa: E731
    draft_ms, verify_ms, prefill_ms, cold_read_ms, warm_read_ms = [], [], [], [], []
    tree_level_ms: list[float] = []
    tree_verify_ms: list[float] = []
    other_ms: dict[str, list[list[float]]] = {n: [] for n in others}  # per bucket: (cold, draft, warm) propose ms
    spreads: list[float] = []
    reads = target_reads(pair, kv_tier)
    # The draft as a run's proposer reads it: through the pair's default head (the embedded draft's
    # 8,192-row sub-head; timed with the full 49,152 rows, a drafted token cost twice what it does live).
    head = draft_head(pair)

    def prefill(ids: list[int]) -> None:  # the target reads a prompt into an empty cache at the tier
        if pair.engine == "llamacpp":  # a verifier's own prefill: it leases an emptied context
            target_verifier(pair, ids, sampler, kv_tier=kv_tier).prefill()
            return
        with reads():
            forward_logits(pair.target, ids, new_cache(pair.target, kv_tier), 1, pair.vocab_size)

    for b in buckets:
        progress(f"costs at context {b}")
        rig = _Bucket(pair, b, gen, sampler, kv_tier, head)
        ids, proposer, verifier, draft_one, verify = rig.ids, rig.proposer, rig.verifier, rig.draft_one, rig.verify

        def warm_read() -> None:  # K_MAX tokens after the b-token cache, then back
            draft_read(pair, ids[b + 1 :], proposer.cache, head)
            crop_to(proposer.cache, b)

        driven = [_Driven(pair, name, ids[:b], sampler, kv_tier) for name in others]
        # In turns, so that a slow spell of the machine cannot make one k look cheaper than another.
        verifies = [(lambda k=k: verify(k), None) for k in range(K_MAX + 1)]
        verifies[-1] = (verifies[-1][0], rig.settle)  # verify(0) comes next when they are timed again
        timed = [(draft_one, rig.settle), *verifies,
                 (lambda: prefill(ids[:b]), None), (lambda: draft_read(pair, ids[:b], None, head), None), (warm_read, None)]
        for d in driven:  # a fresh one's first draft, one after a verify, one after WARM_STEPS plain steps
            timed += [(d.propose, d.step), (d.propose, lambda d=d: d.step(WARM_STEPS)), (d.propose, d.fresh)]
        if rig.trees:  # the draft growing a tree (per level, below), the target verifying a 16-node one
            timed += [(rig.grow_tree, None), (rig.verify_tree, None)]
        n = reps_at(b, reps)
        few = long_rounds(n, WARMUP)
        t = timed_medians(timed, n, WARMUP, sync, rounds_of=lambda i: few if i in (K_MAX + 2, K_MAX + 3) else None)
        ms = t.medians
        if _inverted(ms[1 : K_MAX + 2], t.spreads[1 : K_MAX + 2]):  # a noisy point: the verifies once more
            again = timed_medians(verifies, n, 1, sync)
            ms[1 : K_MAX + 2], t.spreads[1 : K_MAX + 2] = again.medians, again.spreads
        # The table's spread is its draft's and verifies' (what a γ is chosen on); a lookup's 10 µs
        # or a head's step with its catch-up folded in vary widely at no cost that matters.
        spreads.append(max(t.spreads[: K_MAX + 2]))
        draft_ms.append(ms[0])
        verify_ms.append(ms[1 : K_MAX + 2])
        prefill_ms.append(ms[K_MAX + 2])
        cold_read_ms.append(ms[K_MAX + 3])
        warm_read_ms.append(ms[K_MAX + 4] / K_MAX)
        for i, name in enumerate(others):
            other_ms[name].append(ms[K_MAX + 5 + 3 * i : K_MAX + 8 + 3 * i])
        if rig.trees:
            tree_level_ms.append(ms[-2] / rig.levels)
            tree_verify_ms.append(ms[-1])
    fill_ms = None  # llama.cpp keeps no prefix cache: nothing is ever filled from one
    if pair.engine == "torch":
        stored = kv_of(verifier.cache, buckets[-1])
        fill_ms = median_ms(lambda: fill(new_cache(pair.target, kv_tier), stored, buckets[-1]), reps, WARMUP, sync) / buckets[-1]
    return monotone(CostTable(list(buckets), draft_ms, verify_ms, _table_key(pair, kv_tier), prefill_ms=prefill_ms, fill_ms=fill_ms,
                              cold_read_ms=cold_read_ms, warm_read_ms=warm_read_ms,
                              proposer_costs={n: _draft_cost(per_bucket) for n, per_bucket in other_ms.items()},
                              spread=max(spreads), tree_level_ms=tree_level_ms or None,
                              tree_verify_ms=tree_verify_ms or None))


# A probe's verify lengths (the rest interpolated) and rounds: about two seconds for the embedded
# fp32 pair on 2 cores, against a minute for a measured table of two contexts.
PROBE_KS = (0, 1, 2, 4, 8)
PROBE_REPS = 3


@torch.inference_mode()
def probe_costs(pair: ModelPair, kv_tier: str = "native") -> CostTable:
    """A first cost table in seconds, for a run that must not wait for the measured one: at the
    smallest context bucket only, one drafted token of each proposer and verifies of PROBE_KS rows
    (the k between them interpolated), PROBE_REPS rounds. Marked `source="probe"`: never stored; a
    run reading it says so in its `why`, and the workbench measures the real table after the run."""
    dev = pair.device
    b = buckets_for(None, pair.max_context)[0]
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(0.0, 1.0, None, dev)
    rig = _Bucket(pair, b, gen, sampler, kv_tier, draft_head(pair))
    ids, draft_one, verify = rig.ids, rig.draft_one, rig.verify
    others = [n for n in available(pair) if n != "draft"]
    driven = [_Driven(pair, name, ids[:b], sampler, kv_tier) for name in others]
    timed = [(draft_one, rig.settle), *((lambda k=k: verify(k), None) for k in PROBE_KS), *((d.propose, d.step) for d in driven)]
    if rig.trees:
        timed += [(rig.grow_tree, None), (rig.verify_tree, None)]
    t = timed_medians(timed, PROBE_REPS, 1, lambda: sync_device(dev), spread_limit=float("inf"))
    trees = dict(tree_level_ms=[t.medians[-2] / rig.levels], tree_verify_ms=[t.medians[-1]]) if rig.trees else {}
    at = dict(zip(PROBE_KS, t.medians[1 : 1 + len(PROBE_KS)]))
    verify_ms = [float(np.interp(k, list(at), list(at.values()))) for k in range(K_MAX + 1)]
    key = _table_key(pair, kv_tier)
    drafts = t.medians[1 + len(PROBE_KS):][: len(others)]
    return monotone(CostTable([b], [t.medians[0]], [verify_ms], key, spread=t.spread, source="probe",
                              proposer_costs={n: DraftCost([ms]) for n, ms in zip(others, drafts)}, **trees))


def _table_key(pair: ModelPair, kv_tier: str) -> dict:
    """What a cost table is measured for (service.costs.tables.cost_key's fields)."""
    return dict(device=pair_device(pair), target=pair.target_name, draft=pair.draft_name,
                target_tier=pair.target_tier, draft_tier=pair.draft_tier, kv_tier=kv_tier)


TREE_GROWN = 8  # the node budget of the tree whose growth a cost table times per level


class _Bucket:
    """One context bucket's timing rig: random ids (b of context, the newest token, K_MAX to
    draft or verify), the draft and the target each holding the b-token cache, and the two timed
    actions, each leaving the caches as it found them."""

    def __init__(self, pair: ModelPair, b: int, gen: torch.Generator, sampler: Sampler, kv_tier: str, head) -> None:
        self.b = b
        self.ids = torch.randint(0, pair.vocab_size, (b + 1 + K_MAX,), generator=gen).tolist()
        self.proposer = DraftModelProposer(pair, self.ids[:b], sampler, head=head)
        self.verifier = target_verifier(pair, self.ids[:b], sampler, kv_tier=kv_tier)
        self.verifier.prefill()
        self.verifier.rewind(b + 1)
        self.proposer.update(0, self.ids[b : b + 1])
        self.vocab, self.levels = pair.vocab_size, 1  # levels: those of the last grow_tree

    def draft_one(self) -> None:
        self.proposer.propose(1, _always)
        self.proposer.rewind(self.b, self.ids[self.b : self.b + 1])

    @property
    def trees(self) -> bool:
        """Whether this pair grows and verifies token trees (the torch engine, a draft whose cache reads them)."""
        return self.proposer.tree_width > 0 and hasattr(self.verifier, "verify_tree")

    def grow_tree(self) -> None:
        """The draft grows a tree of TREE_GROWN nodes (`levels` reads: the figure is divided by them)."""
        tree = self.proposer.propose_tree(TREE_GROWN, self.proposer.tree_width)
        self.levels = tree_levels(tree.parents, TREE_GROWN, K_MAX)

    def verify_tree(self) -> None:
        """The target reads a bushy tree of TREE_MAX_NODES nodes, two children a node."""
        tree = DraftTree.bushy([(self.ids[self.b] + 1 + i) % self.vocab for i in range(TREE_MAX_NODES)])
        self.verifier.verify_tree(tree)
        self.verifier.rewind(self.b + 1)

    def verify(self, k: int) -> None:
        self.verifier.verify([DraftToken(x, 0.0, 0.0) for x in self.ids[self.b + 1 : self.b + 1 + k]])
        self.verifier.rewind(self.b + 1)

    @property
    def settle(self) -> Callable[[], None] | None:
        """What runs, untimed, before the timed plain step (the verify of k = 0, which follows the
        timed draft): a plain step on an engine whose plain step is cheaper after one (a run of
        plain steps is what k = 0 prices), else nothing."""
        return (lambda: self.verify(0)) if self.verifier.plain_reuses_shape else None


def _inverted(verify_ms: list[float], spreads: list[float]) -> bool:
    """A verify of more rows measured cheaper than one of fewer by more than both points' spread:
    one of them is noise (a read of k + 1 rows never costs less than one of k)."""
    for k in range(1, len(verify_ms)):
        if verify_ms[k] < verify_ms[k - 1] * (1 - max(spreads[k], spreads[k - 1], SPREAD_LIMIT)):
            return True
    return False


class _Driven:
    """A proposer other than the draft model, timed as a live run drives it (through the Proposer
    protocol alone, so any proposer can be measured): with a verifier of its own on the bucket's
    context, each timed draft of one token is verified and its outcome told (`step`), so the next
    one reads what a live step's draft reads; `fresh` starts anew (its first draft reads the
    prompt: the cold catch-up) and keeps the context within the bucket."""

    def __init__(self, pair: ModelPair, name: str, ids: list[int], sampler: Sampler, kv_tier: str) -> None:
        self.pair, self.name, self.ids, self.sampler = pair, name, ids, sampler
        self.verifier = target_verifier(pair, ids, sampler, kv_tier=kv_tier)
        self.first = self.verifier.prefill()
        self._start()

    def _start(self) -> None:
        # The prefill is done once: rewinding to it (cache and features cropped) is the state a
        # fresh prefill leaves, without paying a prompt read per timed round.
        self.verifier.rewind(len(self.ids) + 1)
        self.proposer = PROPOSERS[self.name](self.pair, self.ids, self.sampler, self.verifier, {})
        self.proposer.update(0, [self.first])
        self.drafted: list[DraftToken] = []

    def propose(self) -> None:
        self.drafted = self.proposer.propose(1, _always)

    def step(self, plain: int = 0) -> None:
        """Verifies the last draft and tells the proposer, then `plain` plain target steps."""
        n, emitted = self.verifier.verify(self.drafted)
        self.proposer.update(n, emitted)
        for _ in range(plain):
            _, emitted = self.verifier.verify([])
            self.proposer.update(0, emitted)

    def fresh(self) -> None:
        self.step()  # the last draft's outcome is told, as in any run, before starting anew
        self._start()


def _draft_cost(per_bucket: list[list[float]]) -> DraftCost:
    """(cold, draft, warm) propose ms per bucket → a DraftCost: ms per drafted token is a draft
    after a verify; the cold read what a fresh one's first draft adds (the prompt), the warm one
    per token what WARM_STEPS plain steps before a draft add."""
    return DraftCost([d for _, d, _ in per_bucket], [max(c - d, 0.0) for c, d, _ in per_bucket],
                     [max(w - d, 0.0) / WARM_STEPS for _, d, w in per_bucket])


def long_rounds(reps: int, warmup: int, n: int = LONG_REPS) -> set[int]:
    """The rounds a long read runs in: the first (its warm-up) and min(n, reps) timed rounds spread
    evenly over the `reps` after `warmup`, so that they stay in turns with the rest of the block."""
    n = min(n, reps)
    return {0} | {warmup + i * (reps - 1) // max(n - 1, 1) for i in range(n)}
