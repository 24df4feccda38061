"""Measured step costs (docs/architecture.md, "Costs"): per device, pair, target tier and KV tier, the
draft's ms per drafted token and the target's verify ms for k = 0..8 drafted tokens, at a few
context lengths, and each other proposer's ms per drafted token (and catch-up reads). Controllers
weigh (proposer, draft length) with it; the what-if replay turns steps into seconds with it. Plain
Python: engine/lab/profiling.py measures it with the models."""
from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterable

from engine.base.names import COST_KEY
from engine.decode.records import K_MAX, TREE_MAX_NODES

# Context lengths measured; a step within them uses the nearest one below. Up to 1,024 because
# a verify of several rows grows faster with the context than a plain step, and long prompts (a
# shared system prompt, a document) are where a draft that paid at 512 loses: a table that
# stopped at 512 priced long drafts well under what live steps paid. Not 2,048: a round there
# reads 2,048-token prompts, which tripled the time of bench prefix's table and calibration.
# Buckets past a model's context are skipped. (Figures: docs/benchmarks.md, "Cost buckets".)
CONTEXT_BUCKETS = (64, 256, 512, 1024)
# Beyond the last bucket costs keep growing, so there they follow the slope of the last two
# buckets, read at multiples of this many tokens (a controller's choice stays cached within one).
EXTRAPOLATE_STRIDE = 128
REPS = 9  # timed forwards per point, in turns with every other point: enough for a steady median
# Past this context a round's forwards are long enough to time steadily with fewer of them
# (`reps_at`): a round of verifies and proposer steps at 1,024 tokens takes 5 s on one thread (the
# whole-bucket reads, seconds more, run in a few rounds only: profiling.LONG_REPS).
LONG_CONTEXT = 512
WARMUP = 2  # rounds discarded before timing: first calls allocate and pick kernels
CALIBRATE_MIN = 12  # live steps of one draft length before their median ratio is trusted


def buckets_for(context: int | None, max_context: int, buckets: tuple[int, ...] = CONTEXT_BUCKETS,
                at_least: int = 2) -> tuple[int, ...]:
    """The buckets a table needs for runs reaching `context` tokens (None: any run): those up to
    the first at or past it, `at_least` of them (a new table two: past its last bucket, costs
    follow the slope of two). Buckets whose verify the model's context cannot hold are left out
    (the smallest stays)."""
    fits = tuple(b for b in buckets if b + K_MAX + 2 <= max_context) or (min(buckets),)
    if context is None:
        return fits
    upto = next((i + 1 for i, b in enumerate(fits) if b >= context), len(fits))
    return fits[: max(upto, at_least)]


def reps_at(bucket: int, reps: int) -> int:
    """Timed rounds at a context bucket: `reps`, past LONG_CONTEXT fewer in proportion (at least
    3 for a median, never more than `reps`)."""
    return reps if bucket <= LONG_CONTEXT else max(min(reps, 3), reps * LONG_CONTEXT // bucket)


@dataclass
class DraftCost:
    """One proposer's drafting costs by context bucket: ms per drafted token (what a live step
    pays for it, reading the tokens the last verify emitted included), and its catch-up reads as
    CostTable's (None: it has none, or they were not measured)."""

    ms: list[float]
    cold_read_ms: list[float] | None = None
    warm_read_ms: list[float] | None = None


@dataclass
class CostTable:
    """Median costs by context bucket: draft_ms[b] per drafted token, verify_ms[b][k] for a
    target forward over k + 1 tokens (k = 0 is a plain decoding step)."""

    buckets: list[int]
    draft_ms: list[float]
    verify_ms: list[list[float]]
    key: dict = field(default_factory=dict)  # device, target, draft, target_tier, draft_tier, kv_tier
    # Live step time / this table's, per k (see `calibrate`); None: the bare forwards as measured.
    step_factor: list[float] | None = None
    # The prefill: reading `bucket` prompt tokens into an empty cache, per bucket, and filling a
    # cache from the prefix cache, per reused position. None: not measured (older tables).
    prefill_ms: list[float] | None = None
    fill_ms: float | None = None
    # The draft's catch-up reads (its prefill is lazy): reading `bucket` tokens into an empty
    # cache (a request's prompt, at its first draft), and ms per token read after a cache of
    # `bucket` tokens (what was emitted since it last drafted). A draft that is not row-invariant
    # reads the latter row by row: per token, nearly a drafted token's price. None: not measured.
    cold_read_ms: list[float] | None = None
    warm_read_ms: list[float] | None = None
    # The proposers other than the draft model ("eagle", "ngram", "suffix"), same buckets; the draft's are
    # the fields above. Tables measured before proposers had names hold the draft's alone.
    proposer_costs: dict[str, DraftCost] = field(default_factory=dict)
    # Live step time / this table's per k for the steps one of those proposers drafted, where its
    # own live steps calibrated it (`calibrate`); the others, the draft and plain steps take
    # step_factor. A proposer's steps can run slower or faster than the draft's at the same k
    # (the EAGLE head also reads the target's features; n-gram steps draft nothing): one factor
    # for all, fitted mostly on the draft's steps, priced the others' steps at bf16 10–36% under
    # what they took, and rakv and speckv drafted with them where a plain step was cheaper.
    proposer_factor: dict[str, list[float]] = field(default_factory=dict)
    # How far the figures may be off: the widest relative spread (IQR / median) of any timed point,
    # and other processes' CPU (cores on average) while it was measured. None: not recorded.
    spread: float | None = None
    busy: float | None = None
    # "measured" (stored, all proposers, REPS rounds) or "probe" (a few rounds at one context,
    # used by a run until a measured table exists, never stored).
    source: str = "measured"
    # Token trees (engine/decode/tree.py), per bucket: one level of the draft's tree growth (a read
    # of up to TREE_WIDTH rows and their laws), and the verify of a TREE_MAX_NODES-node tree. None:
    # not measured (older tables, engines without trees): then no policy weighs trees on it.
    tree_level_ms: list[float] | None = None
    tree_verify_ms: list[float] | None = None

    def __post_init__(self) -> None:
        assert self.buckets == sorted(self.buckets) and self.buckets, self.buckets
        assert len(self.draft_ms) == len(self.verify_ms) == len(self.buckets)
        assert all(len(v) == K_MAX + 1 for v in self.verify_ms), "verify costs need k = 0..8"
        assert self.step_factor is None or len(self.step_factor) == K_MAX + 1, self.step_factor
        assert "draft" not in self.proposer_costs and all(len(c.ms) == len(self.buckets)
                                                          for c in self.proposer_costs.values()), self.proposer_costs
        assert set(self.proposer_factor) <= set(self.proposer_costs) and all(
            len(f) == K_MAX + 1 for f in self.proposer_factor.values()), self.proposer_factor

    def describe(self) -> str:
        """Where the figures come from, for a `why` and the pages: the source, its spread and when."""
        if self.source == "probe":
            return "probed costs (no measured table yet)"
        spread = f", ±{self.spread * 50:.0f}%" if self.spread is not None else ""
        return f"measured table{spread}"

    @property
    def proposers(self) -> tuple[str, ...]:
        """The proposers whose drafting this table prices."""
        return ("draft", *self.proposer_costs)

    def drafting(self, proposer: str = "draft") -> DraftCost:
        """`proposer`'s drafting costs; ValueError in one line for one the table has not measured."""
        if proposer == "draft":
            return DraftCost(self.draft_ms, self.cold_read_ms, self.warm_read_ms)
        if proposer not in self.proposer_costs:
            raise ValueError(f"the cost table has no draft costs for proposer {proposer!r} (it has: "
                             f"{', '.join(self.proposers)}): run `python -m engine costs` for this pair and tier again")
        return self.proposer_costs[proposer]

    def bucket_of(self, context_len: int) -> int:
        """Index of the measured context at or below `context_len` (costs are flat within one)."""
        return max(0, bisect.bisect_right(self.buckets, context_len) - 1)

    def band(self, context_len: int) -> int:
        """The context a cost is read at: the measured bucket at or below `context_len`, or past
        the last bucket `context_len` rounded down to a multiple of EXTRAPOLATE_STRIDE beyond it.
        Equal bands, equal costs: what a controller may key its cached choice on."""
        last = self.buckets[-1]
        if context_len < last + EXTRAPOLATE_STRIDE or len(self.buckets) < 2:
            return self.buckets[self.bucket_of(context_len)]
        return last + (context_len - last) // EXTRAPOLATE_STRIDE * EXTRAPOLATE_STRIDE

    def _at(self, per_bucket: list[float], context_len: int) -> float:
        """A per-bucket cost at `context_len`: flat within the measured buckets, past the last
        one along the slope of the last two (never falling: a noisy pair of medians)."""
        beyond = self.band(context_len) - self.buckets[-1]
        if beyond <= 0:
            return per_bucket[self.bucket_of(context_len)]
        slope = (per_bucket[-1] - per_bucket[-2]) / (self.buckets[-1] - self.buckets[-2])
        return per_bucket[-1] + max(slope, 0.0) * beyond

    def step_ms(self, k: int, context_len: int, proposer: str = "draft") -> float:
        """One decode step drafting k tokens with `proposer`: k of its drafted tokens and one
        verify over k + 1 (k = 0: a plain step, whoever would have drafted)."""
        return self.draft_part(k, context_len, proposer) + self.verify_part(k, context_len)

    def draft_part(self, k: int, context_len: int, proposer: str = "draft") -> float:
        """The drafting share of step_ms (calibrated alike): what replay charges the proposer. A
        proposer with a factor of its own also carries the difference it makes to the verify's
        price (verify_part is the same whoever drafted), so that the two add up to step_ms."""
        ms = k * self._at(self.drafting(proposer).ms, context_len) if k else 0.0
        own = self.proposer_factor.get(proposer) if k else None
        if own is None:
            return ms * self._factor(k)
        return ms * own[k] + self.verify_part(k, context_len) * (own[k] / self._factor(k) - 1.0)

    def _factor(self, k: int) -> float:
        return self.step_factor[k] if self.step_factor else 1.0

    def verify_part(self, k: int, context_len: int) -> float:
        """The verify share of step_ms: what replay charges the verifier. Past the last bucket a
        verify of k + 1 rows grows by k + 1 times the per-row slope (`row_slope`)."""
        beyond = self.band(context_len) - self.buckets[-1]
        ms = self.verify_ms[self.bucket_of(context_len)][k]
        if beyond > 0:  # the slope only past the last bucket (a controller asks every step)
            ms += (k + 1) * self.row_slope() * beyond
        return ms * self._factor(k)

    @property
    def prices_trees(self) -> bool:
        """Whether the table measured what a token tree costs (tree_level_ms, tree_verify_ms)."""
        return self.tree_level_ms is not None and self.tree_verify_ms is not None

    def tree_verify_part(self, nodes: int, context_len: int) -> float:
        """A token tree's verify of nodes + 1 rows: a chain's of as many rows up to K_MAX + 1 (the
        fused read takes the same kernels), then along the line to the measured verify of a
        TREE_MAX_NODES-node tree (past it, or without it, the last measured row's price per row)."""
        if nodes <= K_MAX:
            return self.verify_part(nodes, context_len)
        last = self.verify_part(K_MAX, context_len)
        if self.tree_verify_ms is not None:
            far = max(self._at(self.tree_verify_ms, context_len) * self._factor(K_MAX), last)
            return last + (far - last) * (nodes - K_MAX) / (TREE_MAX_NODES - K_MAX)
        return last + (nodes - K_MAX) * max(last - self.verify_part(K_MAX - 1, context_len), 0.0)

    def tree_step_ms(self, nodes: int, levels: int, context_len: int) -> float:
        """A token tree's step: the draft's `levels` reads and the tree's verify."""
        return self.tree_draft_part(levels, context_len) + self.tree_verify_part(nodes, context_len)

    def tree_draft_part(self, levels: int, context_len: int) -> float:
        """The drafting share of tree_step_ms (what replay charges the draft): `levels` measured
        levels of its growth, or without them as many drafted tokens."""
        if self.tree_level_ms is None:
            return self.draft_part(levels, context_len)
        return levels * self._at(self.tree_level_ms, context_len) * self._factor(1)

    def row_slope(self) -> float:
        """ms per verified row per token of context past the last bucket: the median over k of
        the last two buckets' growth per row (each row attends over the context), never falling.
        Pooled, because one k's pair of medians is noisy: on the embedded fp32 target, slopes per
        k put a 4-token verify at 3,000 tokens at 38 ms, a plain step's price, where live ones
        took 65–75 ms against 45, and rakv drafted a long document at a 14% loss (bench prefix)."""
        if len(self.buckets) < 2:
            return 0.0
        width = self.buckets[-1] - self.buckets[-2]
        per_row = [(last - before) / ((k + 1) * width)
                   for k, (before, last) in enumerate(zip(self.verify_ms[-2], self.verify_ms[-1]))]
        return max(statistics.median(per_row), 0.0)

    def prefill_cost(self, cold: int, reused: int) -> float | None:
        """ms to start a request: read `cold` prompt tokens after taking `reused` positions from
        the prefix cache. None without prefill measurements."""
        if self.prefill_ms is None or self.fill_ms is None:
            return None
        return self._along(self.prefill_ms, cold) + reused * self.fill_ms

    def catchup_cost(self, cold: int, warm: int, context_len: int, proposer: str = "draft") -> float | None:
        """ms for a proposer (the draft model by default) to read what it has not read before it
        drafts: `cold` tokens into an empty cache and `warm` after its cache. None unmeasured
        (or a proposer the table does not know)."""
        if proposer not in self.proposers:
            return None
        d = self.drafting(proposer)
        if d.cold_read_ms is None or d.warm_read_ms is None:
            return None
        cold_ms = self._along(d.cold_read_ms, cold) if cold else 0.0
        return cold_ms + warm * self._at(d.warm_read_ms, context_len)

    def _along(self, ms: list[float], tokens: int) -> float:
        """Per-bucket ms at `tokens`: linear between measured buckets, and beyond them along
        the slope of the last two."""
        xs = self.buckets
        i = min(max(bisect.bisect_right(xs, tokens) - 1, 0), max(len(xs) - 2, 0))
        slope = (ms[i + 1] - ms[i]) / (xs[i + 1] - xs[i]) if len(xs) > 1 else ms[0] / xs[0]
        return max(ms[i] + slope * (tokens - xs[i]), 0.0)

    def extended(self, more: "CostTable") -> "CostTable":
        """This table with `more`'s buckets (measured later, for longer runs) past its last: its own
        buckets, fill cost and calibration stay as they are, so that whatever ran within them is
        decided and replayed alike. Proposers `more` did not measure are dropped."""
        assert more.buckets[0] > self.buckets[-1], (self.buckets, more.buckets)
        cat = lambda a, b: a + b if a is not None and b is not None else None  # noqa: E731
        theirs = more.proposer_costs
        return replace(self, buckets=self.buckets + more.buckets, draft_ms=self.draft_ms + more.draft_ms,
                       verify_ms=self.verify_ms + more.verify_ms, prefill_ms=cat(self.prefill_ms, more.prefill_ms),
                       cold_read_ms=cat(self.cold_read_ms, more.cold_read_ms),
                       warm_read_ms=cat(self.warm_read_ms, more.warm_read_ms),
                       proposer_costs={n: DraftCost(c.ms + theirs[n].ms, cat(c.cold_read_ms, theirs[n].cold_read_ms),
                                                    cat(c.warm_read_ms, theirs[n].warm_read_ms))
                                       for n, c in self.proposer_costs.items() if n in theirs},
                       proposer_factor={n: f for n, f in self.proposer_factor.items() if n in theirs},
                       spread=_worst(self.spread, more.spread), busy=_worst(self.busy, more.busy),
                       tree_level_ms=cat(self.tree_level_ms, more.tree_level_ms),
                       tree_verify_ms=cat(self.tree_verify_ms, more.tree_verify_ms))

    @classmethod
    def from_rows(cls, rows: list[dict]) -> "CostTable":
        """From the store's `costs` rows (one per bucket and proposer; rows without a proposer
        are the draft model's)."""
        if not rows:
            raise ValueError("no cost rows: run `python -m engine costs` for this pair and tier first")
        by: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            by[r["proposer"] if isinstance(r.get("proposer"), str) else "draft"].append(r)
        rows = sorted(by.pop("draft", []), key=lambda r: r["ctx_bucket"])
        if not rows:
            raise ValueError("the cost rows hold no draft model's row: run `python -m engine costs` again")
        key = {k: rows[0].get(k) for k in COST_KEY}
        key["kv_tier"] = key["kv_tier"] if isinstance(key["kv_tier"], str) else "native"
        factor = rows[0].get("step_factor")
        per_bucket = lambda name: ([float(r[name]) for r in rows]  # noqa: E731
                                   if all(_given(r.get(name)) for r in rows) else None)
        buckets = [int(r["ctx_bucket"]) for r in rows]
        others, own = {}, {}
        for name, theirs in by.items():
            at = {int(r["ctx_bucket"]): r for r in theirs}
            assert sorted(at) == buckets, (name, sorted(at), buckets)  # one batch: measured at the same contexts
            ordered = [at[b] for b in buckets]
            read = lambda col: ([float(r[col]) for r in ordered]  # noqa: E731
                                if all(_given(r.get(col)) for r in ordered) else None)
            others[name] = DraftCost([float(r["draft_ms"]) for r in ordered], read("cold_read_ms"), read("warm_read_ms"))
            if _given(ordered[0].get("step_factor")):  # its own calibration (the draft's rows hold the others')
                own[name] = [float(x) for x in ordered[0]["step_factor"]]
        first = rows[0]
        return cls(buckets, [float(r["draft_ms"]) for r in rows],
                   [[float(x) for x in r["verify_ms"]] for r in rows], key,
                   [float(x) for x in factor] if _given(factor) else None,
                   per_bucket("prefill_ms"),
                   float(first["fill_ms"]) if _given(first.get("fill_ms")) else None,
                   per_bucket("cold_read_ms"), per_bucket("warm_read_ms"), others, own,
                   float(first["spread"]) if _given(first.get("spread")) else None,
                   float(first["busy"]) if _given(first.get("busy")) else None,
                   tree_level_ms=per_bucket("tree_level_ms"), tree_verify_ms=per_bucket("tree_verify_ms"))

    def to_rows(self, reps: int) -> list[dict]:
        """The store's `costs` rows: the draft's (with the target's costs) per bucket, then each
        other proposer's drafting costs per bucket (the target's columns NULL there)."""
        none = [None] * len(self.buckets)
        assert self.source == "measured", "a probe's costs are the run's own, never stored"
        quality = dict(spread=self.spread, busy=self.busy)
        rows = [dict(self.key, ctx_bucket=b, proposer="draft", draft_ms=d, verify_ms=v, reps=reps,
                     step_factor=self.step_factor, prefill_ms=p, fill_ms=self.fill_ms, cold_read_ms=c, warm_read_ms=w,
                     tree_level_ms=tl, tree_verify_ms=tv, **quality)
                for b, d, v, p, c, w, tl, tv in zip(self.buckets, self.draft_ms, self.verify_ms, self.prefill_ms or none,
                                                    self.cold_read_ms or none, self.warm_read_ms or none,
                                                    self.tree_level_ms or none, self.tree_verify_ms or none)]
        for name, d in self.proposer_costs.items():
            rows += [dict(self.key, ctx_bucket=b, proposer=name, draft_ms=ms, verify_ms=None, reps=reps,
                          step_factor=self.proposer_factor.get(name), prefill_ms=None, fill_ms=None, cold_read_ms=c,
                          warm_read_ms=w, **quality)
                     for b, ms, c, w in zip(self.buckets, d.ms, d.cold_read_ms or none, d.warm_read_ms or none)]
        return rows


def _given(value) -> bool:
    """A stored value, not a NULL (pandas reads NULL as None or NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _worst(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else max(x for x in (a, b) if x is not None)


def _rising(xs: list[float] | None) -> list[float] | None:
    """Each value at least the one before it (a running maximum)."""
    if xs is None:
        return None
    out, top = [], float("-inf")
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out


def monotone(table: CostTable) -> CostTable:
    """The table with every cost non-decreasing in the rows a verify reads (k) and in the context:
    a read of more rows or over a longer context never costs less. Medians of a noisy round can
    invert two neighbours (a busy spell made a 5-token verify cost a tenth of a 4-token one); a
    controller reading such a table drafts 5 where it should not. Each value is raised to the
    largest before it (bench figures: a raise beyond the spread is a noisy point, re-timed by
    measure_costs before this)."""
    by_k = [_rising(row) for row in table.verify_ms]  # in k, per bucket
    cols = [_rising([row[k] for row in by_k]) for k in range(K_MAX + 1)]  # in context, per k
    verify = [[cols[k][b] for k in range(K_MAX + 1)] for b in range(len(table.buckets))]
    return replace(table, verify_ms=verify, draft_ms=_rising(table.draft_ms), prefill_ms=_rising(table.prefill_ms),
                   cold_read_ms=_rising(table.cold_read_ms), warm_read_ms=_rising(table.warm_read_ms),
                   proposer_costs={n: DraftCost(_rising(c.ms), _rising(c.cold_read_ms), _rising(c.warm_read_ms))
                                   for n, c in table.proposer_costs.items()},
                   tree_level_ms=_rising(table.tree_level_ms), tree_verify_ms=_rising(table.tree_verify_ms))


def is_monotone(table: CostTable) -> bool:
    return monotone(table) == table


def calibrate(table: CostTable, live: Iterable[tuple]) -> CostTable:
    """`table` scaled to what the engine's own decode steps took. `live` holds (k drafted,
    context length, draft + verify ms[, proposer]) of stored steps (no proposer: the draft's;
    steps of a proposer the table has not measured are left out); per k the factor is the
    median of live / measured, whoever drafted. A live step pays what the bare forwards do not: the draft's catch-up read of the
    tokens emitted since it last drafted, the accept loop, cache crops, and more so for short
    steps: controllers that weigh the bare forwards speculate where it does not pay
    (`bench controllers live` prints the factors). A k with fewer than CALIBRATE_MIN steps takes
    the factor of the nearest drafting k that has them (k = 0 keeps 1.0 without its own).
    A proposer other than the draft model with CALIBRATE_MIN steps of its own (any k) gets its
    own factors (`proposer_factor`): those per k times the median of its steps' live time over
    what they price them at."""
    bare = replace(table, step_factor=None, proposer_factor={})
    ratios: dict[int, list[float]] = defaultdict(list)
    steps: list[tuple[int, int, float, str]] = []
    for k, context_len, ms, *who in live:
        proposer = who[0] if who and who[0] else "draft"
        if 0 <= k <= K_MAX and ms > 0 and (k == 0 or proposer in bare.proposers):
            ratios[k].append(ms / bare.step_ms(k, context_len, proposer))
            steps.append((k, context_len, ms, proposer))
    have = {k: statistics.median(v) for k, v in ratios.items() if len(v) >= CALIBRATE_MIN}
    drafting = sorted(k for k in have if k > 0)
    if not drafting:
        raise ValueError(f"too few live steps to calibrate costs (need {CALIBRATE_MIN} that drafted the same k): "
                         "profile this pair and tier first, e.g. `python -m engine profile --policies ar,fixed:1,fixed:2,fixed:4`")
    factor = [have.get(0, 1.0)] + [have[min(drafting, key=lambda j: (abs(j - k), j))] for k in range(1, K_MAX + 1)]
    pooled = replace(bare, step_factor=factor)
    theirs: dict[str, list[float]] = defaultdict(list)
    for k, context_len, ms, proposer in steps:
        if k and proposer in bare.proposer_costs:
            theirs[proposer].append(ms / pooled.step_ms(k, context_len, proposer))
    own = {p: [f * statistics.median(r) for f in factor] for p, r in theirs.items() if len(r) >= CALIBRATE_MIN}
    return replace(pooled, proposer_factor=own)
