"""The cost tables and controllers a run's policy reads: measured once per (device, pair, tiers),
then read from the store; calibrated to stored live steps; the PolicyContext `speckv`/`rakv` need."""
from __future__ import annotations

import contextlib
import os
import statistics
from typing import Any, Callable, ContextManager

from engine.base.names import COST_KEY
from engine.decode.acceptance import Predictor
from engine.decode.costs import REPS, CostTable, buckets_for, calibrate
from engine.decode.policies import NEEDS_CONTEXT, PolicyContext, make_policy, parse_policy
from engine.decode.policies.rakv import default_prior
from engine.decode.records import K_MAX
from engine.lab.whatif import tier_label
from store import Store

# Drafting steps of stored runs before their acceptance alone is rakv's prior; fewer are padded to
# this many with the policy's default (a free proposer's 0.5 was twice what the n-gram lookup
# measured on chat, 0.18 over 33 steps: a hard threshold kept the default until the 32nd step).
ALPHA_MIN_STEPS = 32


# -- costs -------------------------------------------------------------------------------------
def key_of(**fields: str) -> tuple:
    """A cost table's key from its fields by name, in COST_KEY's order."""
    assert fields.keys() == set(COST_KEY), sorted(fields)
    return tuple(fields[k] for k in COST_KEY)


def cost_key(pair, kv_tier: str = "native") -> tuple:
    """What a cost table is measured for: this pair on its device, at its tiers and `kv_tier`."""
    from engine.runtime.models import pair_device  # a loaded pair: torch is there already

    return key_of(device=pair_device(pair), target=pair.target_name, draft=pair.draft_name,
                  target_tier=pair.target_tier, draft_tier=pair.draft_tier, kv_tier=kv_tier)


def stored_costs(store: Store, key: tuple) -> CostTable | None:
    """The newest cost table stored for `key`, or None."""
    rows = store.costs(*key).to_dict("records")
    return CostTable.from_rows(rows) if rows else None


def reach(prompt_tokens: int, max_new_tokens: int) -> int:
    """The context a run reaches (`cost_table`'s `context`): its prompt, its output, and a verify
    of K_MAX drafted tokens past them."""
    return prompt_tokens + max_new_tokens + K_MAX + 1


def cost_table(store: Store, pair, say: Callable[[str], None] = lambda m: None, kv_tier: str = "native",
               context: int | None = None, measure: bool = True) -> CostTable:
    """The newest stored cost table for this pair, tier and KV tier, pricing runs up to `context`
    tokens (None: any run, every bucket). Measured (and stored) when absent, or when it lacks a
    proposer the pair has (a table from before that proposer): only the buckets `context` needs,
    so that a first short comparison does not wait for the 1,024-token reads; a longer run later
    measures the buckets it lacks and stores the table extended by them. With `measure` False
    nothing is measured here: a stored table is read as it is (past its buckets, costs follow
    its slope), and without one a probe (seconds, never stored) stands in; `missing_buckets` says
    what a measurement after the run should add."""
    from engine.lab.profiling import probe_costs

    have = _usable(store, pair, kv_tier)
    if not measure:
        if have is None:
            say(f"probing costs for {pair.target_name} at {tier_label(pair.target_tier, kv_tier)} (no table yet)…")
            return probe_costs(pair, kv_tier)
        return have
    if have is None:
        table = _measured(pair, buckets_for(context, pair.max_context), say, kv_tier)
    elif more := _lacking(have, context, pair.max_context):
        table = have.extended(_measured(pair, more, say, kv_tier))
    else:
        return have
    store.add_costs(table.to_rows(REPS))
    return table


def _usable(store: Store, pair, kv_tier: str) -> CostTable | None:
    """The stored table, unless it lacks a proposer the pair has (then it is measured anew)."""
    from engine.oracles import available

    table = stored_costs(store, cost_key(pair, kv_tier))
    return table if table is not None and set(available(pair)) <= set(table.proposers) else None


def _lacking(table: CostTable, context: int | None, max_context: int) -> tuple[int, ...]:
    return tuple(b for b in buckets_for(context, max_context, at_least=1) if b > table.buckets[-1])


def missing_buckets(store: Store, pair, kv_tier: str = "native", context: int | None = None) -> tuple[int, ...]:
    """The context buckets a measurement should add for runs up to `context` tokens: all a new
    table needs when none is stored (or it lacks a proposer), else those past its last; () when
    the stored table covers them."""
    have = _usable(store, pair, kv_tier)
    if have is None:
        return buckets_for(context, pair.max_context)
    return _lacking(have, context, pair.max_context)


def would_probe(db: str, pair, spec: str, kv_tier: str = "native") -> bool:
    """Whether opening `spec` on `pair` without measuring (cost_table's `measure` False) runs the
    models: its policy weighs costs and `db` holds no usable table at this KV tier, so a probe
    stands in. True too when the file cannot be read now (the caller then holds the decode slot
    around the opening, as for a probe)."""
    if parse_policy(spec)[0] not in NEEDS_CONTEXT:
        return False
    if not db or not os.path.exists(db):
        return True
    try:
        with Store(db, read_only=True, wait_s=3.0) as st:
            return _usable(st, pair, kv_tier) is None
    except Exception:  # noqa: BLE001 - unreadable now: opening it later says why, in one line
        return True


def measure_in_turns(db: "str | Store", pair, kv_tier: str, context: int | None,
                     hold: Callable[[], ContextManager[Any]], say: Callable[[str], None] = lambda m: None) -> None:
    """Measures (and stores) what `db` (a path or an open Store) lacks for runs up to `context`
    tokens, one context bucket (a new table's first two) inside each `hold()` (the decode slot,
    taken per bucket): a decode pressed meanwhile waits for a bucket, not for the whole table.
    `cost_table` then finds the table whole."""
    with contextlib.ExitStack() as stack:
        st = db if isinstance(db, Store) else stack.enter_context(Store(db))
        missing = missing_buckets(st, pair, kv_tier, context)
        while missing:
            with hold():
                cost_table(st, pair, say, kv_tier, missing[0])  # the buckets up to this one it lacks
            left = missing_buckets(st, pair, kv_tier, context)
            assert len(left) < len(missing), (left, missing)
            missing = left


def measure_missing(db: str, pair, kv_tier: str = "native", context: int | None = None,
                    say: Callable[[str], None] = lambda m: None) -> CostTable | None:
    """Measures and stores what `db` lacks for runs up to `context` tokens (missing_buckets), the
    file closed while the models run: a table of its own, or the stored one extended. None when
    nothing is lacking. MachineBusy (a ValueError) when other processes kept the CPU busy."""
    with Store(db) as st:
        have, buckets = _usable(st, pair, kv_tier), missing_buckets(st, pair, kv_tier, context)
    if not buckets:
        return None
    table = _measured(pair, buckets, say, kv_tier)
    if have is not None and table.buckets[0] > have.buckets[-1]:
        table = have.extended(table)
    with Store(db) as st:
        st.add_costs(table.to_rows(REPS))
    return table


def _measured(pair, buckets: tuple[int, ...], say: Callable[[str], None], kv_tier: str) -> CostTable:
    from engine.lab.profiling import measure_costs

    at = ", ".join(map(str, buckets))
    say(f"measuring costs for {pair.target_name} at {tier_label(pair.target_tier, kv_tier)}, contexts {at} (once; stored)…")
    return measure_costs(pair, buckets, kv_tier=kv_tier, progress=say)


def calibrate_costs(store: Store, key: tuple) -> CostTable:
    """Stores (and returns) the cost table of `key` (cost_key's) calibrated against the stored
    live steps of that pair, device, tier and KV tier (engine/decode/costs.py, `calibrate`)."""
    kv_tier = key[5] if len(key) > 5 and key[5] else "native"
    table = stored_costs(store, key)
    if table is None:
        raise ValueError(f"no cost table for {key[1]} + {key[2]} at {tier_label(key[3], kv_tier)} on {key[0]}: "
                         "run `python -m engine costs` first")
    table = calibrate(table, store.step_times(*key[:4], kv_tier=kv_tier).itertuples(index=False, name=None))
    store.add_costs(table.to_rows(REPS))
    return table


def calibrate_all(store: Store) -> list[tuple[tuple, CostTable | str]]:
    """Every stored cost table calibrated where its live steps allow: (key, table or the reason not)."""
    out: list[tuple[tuple, CostTable | str]] = []
    for key in store.costs()[list(COST_KEY)].drop_duplicates().itertuples(index=False, name=None):
        try:
            out.append((key, calibrate_costs(store, key)))
        except ValueError as e:
            out.append((key, str(e)))
    return out


# -- policy context ------------------------------------------------------------------------------
def controller_loader(store: Store) -> Callable[[str, int | None], Predictor]:
    """Loads stored controllers by (name, version), each once: a context built while the store
    is open keeps working after it closes."""
    cache: dict = {}

    def load(name: str, version: int | None) -> Predictor:
        if (name, version) not in cache:
            params, meta = store.controller(name, version)
            cache[(name, version)] = Predictor(meta["kind"], params, meta)
        return cache[(name, version)]

    return load


def acceptance_priors(store: Store, key: tuple, proposers) -> dict[str, float]:
    """Per proposer that drafted in them, the per-token acceptance of the stored live runs and
    traces of `key`'s pair, device, tier and KV tier (rakv's prior; a trace counts each position
    the proposer could draft at): below ALPHA_MIN_STEPS of those shrunk to rakv's default for that
    proposer, as if the missing ones had measured it. Without the traces a head that is seldom
    right (the embedded EAGLE head keeps 0.1–0.15 of its first tokens) would start at the
    default 0.6 and be probed at a loss in every run on a tier where its drafts cannot pay."""
    priors = {}
    for name in proposers:
        live = store.first_token_acceptance(*key[:4], kv_tier=key[5], proposer=name)
        traced = store.traced_first_token_acceptance(*key[:4], kv_tier=key[5], proposer=name)
        hits, n = live[0] + traced[0], live[1] + traced[1]
        if n:
            pad = max(ALPHA_MIN_STEPS - n, 0)
            priors[name] = (hits + pad * default_prior(name)) / (n + pad)
    return priors


def policy_context(store: Store, pair, say: Callable[[str], None] = lambda m: None,
                   kv_tier: str = "native", context: int | None = None, measure: bool = True) -> PolicyContext:
    """What `speckv`/`rakv` need on this pair at this KV tier for runs up to `context` tokens (None:
    any): its cost table (`measure` False: as stored, or a probe; see cost_table), the store's
    controllers, and the pair's per-token acceptance on this tier where stored runs measured it
    (rakv's prior)."""
    from engine.oracles import available

    priors = acceptance_priors(store, cost_key(pair, kv_tier), available(pair))
    return PolicyContext(costs=cost_table(store, pair, say, kv_tier, context, measure),
                         controller=controller_loader(store), alpha0=priors.get("draft"), priors=priors)


def context_for(db: str, pair, spec: str, say: Callable[[str], None] = lambda m: None,
                kv_tier: str = "native", context: int | None = None, measure: bool = True) -> PolicyContext | None:
    """The PolicyContext `spec` needs on `pair` at `kv_tier` for runs up to `context` tokens (None
    for policies that need nothing), loaded from the store now so that a long generation holds no
    database file open. `measure` False: a missing cost table is probed, not measured (cost_table)."""
    name = parse_policy(spec)[0]
    if name not in NEEDS_CONTEXT:
        return None
    if not db:
        raise ValueError(f"policy {name} reads its cost table and controller from a database: pass --db")
    with Store(db) as st:
        ctx = policy_context(st, pair, say, kv_tier, context, measure)
        make_policy(spec, ctx)  # loads (and caches) the controller while the file is open
    return ctx


# -- the model against the live steps ---------------------------------------------------------------
# What-if's modelled step times and the live steps of the same pair and setting agree within this
# share, or the page says by how much they do not and why that may be.
MODEL_TOLERANCE = 0.15
MODEL_MIN_STEPS = 12  # live steps before a comparison means anything


def priced_vs_live(store: Store, key: tuple) -> dict | None:
    """How the stored table of `key` (cost_key's) prices the stored live steps of that pair and
    setting: the median of live ms / priced ms over them, per k drafted and overall, the number of
    steps, and one line when they disagree by more than MODEL_TOLERANCE. None when there is no
    table or too few live steps to say."""
    table = stored_costs(store, key)
    if table is None:
        return None
    steps = [(int(k), int(c), float(ms), p) for k, c, ms, p in
             store.step_times(*key[:4], kv_tier=key[5]).itertuples(index=False, name=None)
             if p in table.proposers or k == 0]
    if len(steps) < MODEL_MIN_STEPS:
        return None
    ratios = [ms / table.step_ms(k, c, p if k else "draft") for k, c, ms, p in steps]
    ratio = statistics.median(ratios)
    out = {"ratio": ratio, "steps": len(steps), "source": table.describe(), "calibrated": table.step_factor is not None}
    if abs(ratio - 1) > MODEL_TOLERANCE:
        out["why"] = (f"the table prices this setting's {len(steps)} live steps at {1 / ratio:.2f}× what they took "
                      f"(outside ±{MODEL_TOLERANCE:.0%}): modelled tok/s are off by as much. "
                      + ("It was measured while other processes used the CPU, or before the engine changed: "
                         if table.busy is None or table.busy > 0.1 else
                         "The live runs may have run beside other work, or the engine changed since: ")
                      + "`python -m engine costs --calibrate` scales it to the live steps, `python -m engine costs` "
                      "measures it again")
    return out


def model_checks(store: Store, tiers: list[str] | None = None, kv_tiers: list[str] | None = None) -> list[tuple[str, dict]]:
    """`priced_vs_live` for every setting the stored traces hold (the ones What-if replays), as
    (its label, the check), those with too few live steps left out."""
    traces = store.traces()
    if not len(traces):
        return []
    traces = traces.assign(kv_tier=traces["kv_tier"].fillna("native"))
    if tiers:
        traces = traces[traces["target_tier"].isin(tiers)]
    if kv_tiers:
        traces = traces[traces["kv_tier"].isin(kv_tiers)]
    out = []
    for key in traces[list(COST_KEY)].drop_duplicates().itertuples(index=False, name=None):
        check = priced_vs_live(store, key)
        if check is not None:
            out.append((tier_label(key[3], key[5]), check))
    return out
