"""The service layer: what the CLI, the pages and the benchmarks call. Each function is one user
action over engine modules and the store (docs/architecture.md, "Layers"). Torch-free at import;
functions that need the models receive a loaded pair or import what runs them."""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable

import numpy as np

from engine.base.helpers import csv_list, one_line
from engine.base.names import KV_TIERS, WEIGHT_TIERS
from engine.decode.acceptance import Predictor
from engine.decode.costs import REPS, CostTable, calibrate
from engine.decode.policies import (
    NEEDS_CONTEXT,
    PolicyContext,
    make_policy,
    parse_policy,
    split_spec,
)
from engine.lab.whatif import Replay, replay, summarize, tier_label
from store import Store

TRACE_POLICIES = "ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,fixed:8,heuristic,rules,speckv,rakv"


def prompt_set(which: str, per_task: int | None) -> list[tuple[str, str]]:
    """(task, prompt) pairs of a named set: heldout, bench or train."""
    from engine.datasets import prompts as P

    sets = {"heldout": lambda: P.heldout(per_task), "bench": lambda: P.bench_prompts(per_task or 2),
            "train": lambda: P.training_prompts(per_task or 10)}
    if which not in sets:
        raise ValueError(f"unknown prompt set {which!r}; use one of {', '.join(sets)}")
    return sets[which]()


def _known(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """Comma-separated names, each one of `known`, at least one."""
    names = csv_list(text)
    bad = [t for t in names if t not in known]
    if bad or not names:
        raise ValueError(f"unknown {what}(s) {', '.join(bad) or '(none)'}; known: {', '.join(known)}")
    return names


def parse_tiers(text: str) -> list[str]:
    return _known(text, WEIGHT_TIERS, "tier")


def parse_kv_tiers(text: str) -> list[str]:
    """Comma-separated KV tiers (native, fp8, int8), checked."""
    return _known(text, KV_TIERS, "KV tier")


ALPHA_MIN_STEPS = 32  # drafting steps of stored runs before their acceptance replaces rakv's default prior


# -- costs -------------------------------------------------------------------------------------
def cost_key(pair, kv_tier: str = "native") -> tuple:
    """(device, target, draft, target tier, draft tier, KV tier): what a cost table is measured for."""
    return (str(pair.device), pair.target_name, pair.draft_name, pair.target_tier, pair.draft_tier, kv_tier)


def stored_costs(store: Store, key: tuple) -> CostTable | None:
    """The newest cost table stored for `key`, or None."""
    rows = store.costs(*key).to_dict("records")
    return CostTable.from_rows(rows) if rows else None


def cost_table(store: Store, pair, say: Callable[[str], None] = lambda m: None, kv_tier: str = "native") -> CostTable:
    """The newest stored cost table for this pair, tier and KV tier; measured (and stored) when
    absent, or when it lacks a proposer the pair has (a table from before that proposer)."""
    from engine.oracles import available

    table = stored_costs(store, cost_key(pair, kv_tier))
    if table is None or not set(available(pair)) <= set(table.proposers):
        from engine.lab.profiling import measure_costs

        say(f"measuring costs for {pair.target_name} at {tier_label(pair.target_tier, kv_tier)} (once; stored)…")
        table = measure_costs(pair, kv_tier=kv_tier)
        store.add_costs(table.to_rows(REPS))
    return table


def calibrate_costs(store: Store, key: tuple) -> CostTable:
    """Stores (and returns) the cost table of `key` (cost_key's) calibrated against the stored
    live steps of that pair, device, tier and KV tier (engine/costs.py, `calibrate`)."""
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
    from store.tables import COST_KEY

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


def policy_context(store: Store, pair, say: Callable[[str], None] = lambda m: None,
                   kv_tier: str = "native") -> PolicyContext:
    """What `speckv`/`rakv` need on this pair at this KV tier: its cost table, the store's
    controllers, and the pair's per-token acceptance on this tier where stored runs measured it
    (rakv's prior)."""
    from engine.oracles import available

    priors = {}
    for name in available(pair):
        hits, n = store.first_token_acceptance(*cost_key(pair)[:4], kv_tier=kv_tier, proposer=name)
        if n >= ALPHA_MIN_STEPS:
            priors[name] = hits / n
    return PolicyContext(costs=cost_table(store, pair, say, kv_tier), controller=controller_loader(store),
                         alpha0=priors.get("draft"), priors=priors)


def context_for(db: str, pair, spec: str, say: Callable[[str], None] = lambda m: None,
                kv_tier: str = "native") -> PolicyContext | None:
    """The PolicyContext `spec` needs on `pair` at `kv_tier` (None for policies that need
    nothing), loaded from the store now so that a long generation holds no database file open."""
    name = parse_policy(spec)[0]
    if name not in NEEDS_CONTEXT:
        return None
    if not db:
        raise ValueError(f"policy {name} reads its cost table and controller from a database: pass --db")
    with Store(db) as st:
        ctx = policy_context(st, pair, say, kv_tier)
        make_policy(spec, ctx)  # loads (and caches) the controller while the file is open
    return ctx


def store_run(db: str, row: dict, steps: list[dict], wait_s: float = 10.0) -> tuple[str, bool, str]:
    """Stores a finished run and its steps: (run_id, staged?, a line saying what happened). The
    file is opened only for the write, so other processes can use it in between; one that holds
    it makes the store stage the run as Parquet, ingested on the next open (nothing is lost)."""
    with Store(db, wait_s=wait_s) as st:
        run_id = st.add_run(row, steps)
        if st.staged:
            return run_id, True, st.message
        return run_id, False, f"stored as run {run_id} in {db}" + (f" ({st.message})" if st.message else "")


# -- replay --------------------------------------------------------------------------------------
def replay_all(store: Store, policies: list, tiers: list[str] | None = None, trace_ids: set | None = None,
               kv_tiers: list[str] | None = None) -> list[Replay]:
    """Every policy (a spec string, or a function of the PolicyContext) over every stored trace
    (optionally some tiers/KV tiers/traces), with the cost table of the trace's pair, tier and
    KV tier."""
    traces = store.traces()
    if tiers:
        traces = traces[traces["target_tier"].isin(tiers)]
    if kv_tiers:
        traces = traces[traces["kv_tier"].fillna("native").isin(kv_tiers)]
    if trace_ids is not None:
        traces = traces[traces["trace_id"].isin(trace_ids)]
    if not len(traces):
        raise ValueError(f"no traces in {store.path}: run `python -m engine trace` first")
    traces = newest_traces(traces)
    positions = store.trace_positions()
    by_trace = {tid: df.to_dict("records") for tid, df in positions.groupby("trace_id", sort=False)}
    out, contexts = [], {}
    for t in traces.to_dict("records"):
        t["kv_tier"] = t.get("kv_tier") if isinstance(t.get("kv_tier"), str) else "native"
        key = (t["device"], t["target"], t["draft"], t["target_tier"], t["draft_tier"], t["kv_tier"])
        if key not in contexts:
            contexts[key] = PolicyContext(costs=stored_costs(store, key), controller=controller_loader(store))
        ctx = contexts[key]
        for spec in policies:
            policy = make_policy(spec, ctx) if isinstance(spec, str) else spec(ctx)
            out.append(replay(policy, t, by_trace.get(t["trace_id"], []), ctx.costs))
    return out


# What makes two traces the same trace of a prompt: a prompt traced again (for a proposer the
# first trace lacked) replaces the first, in replay as in training.
TRACE_IDENTITY = ("device", "target", "draft", "target_tier", "draft_tier", "kv_tier", "prompt", "chat", "max_new_tokens")


def newest_traces(traces):
    """The newest trace of each (pair, tiers, prompt, length): traces() are oldest first."""
    key = traces[list(TRACE_IDENTITY)].astype(str).agg("\x1f".join, axis=1)
    return traces[~key.duplicated(keep="last")]


# -- retrain -------------------------------------------------------------------------------------
def retrain(st: Store, source: str, protocol: str | None = None, seed: int = 42, sweep: str | None = None,
            activate: bool = True):
    """Fit `speckv` (MLP) and `speckv-rf` on the source's examples, test them, store both as new
    versions (active unless told), and return the report."""
    from engine.training import retrain as T

    protocol = protocol or ("paper" if source == "speckv" else "prompt")
    ex, whatif_fn = _examples(st, source, sweep)
    mlp, rf, m = T.train(ex, protocol, seed)
    test = m.pop("test_rows")
    if whatif_fn is None:  # per setting (the stratum's tier part: the weight tier, `+kv` off native)
        tiers = np.asarray([s.split("/")[0] for s in ex.stratum[test]])
        w, kind = T.predictor_scored(mlp, ex.x[test], tiers), "predictor-scored"
    else:
        w, kind = whatif_fn(mlp, set(ex.group[test])), "exact replay"
    report = T.Report(
        source=source, protocol=protocol, **m, decision_ms_median=T.decision_ms(mlp),
        rf_decision_ms_median=T.decision_ms(rf, n=200), whatif_kind=kind,
        whatif_gain_vs_fixed4=w["gain_vs_fixed4"], whatif_gain_vs_best_fixed=w["gain_vs_best_fixed"], whatif=w,
    )
    meta = dict(source=source, protocol=protocol, seed=seed, metrics=report.to_dict())
    report.version = st.add_controller("speckv", mlp.arrays, dict(mlp.meta, kind="mlp", **meta), source, activate=activate)
    report.rf_version = st.add_controller("speckv-rf", rf.arrays, dict(rf.meta, kind="rf", **meta), source, activate=activate)
    return report


def _examples(st: Store, source: str, sweep: str | None):
    """(examples, what-if function or None) for the chosen source."""
    from engine.training import retrain as T

    if source == "traces":
        traces = st.traces()
        traces = newest_traces(traces) if len(traces) else traces
        if not len(traces):
            raise ValueError(f"no traces in {st.path}: run `python -m engine trace` first")
        ids_of = lambda prompts: set(traces.loc[traces["prompt"].isin(prompts), "trace_id"])  # noqa: E731
        return T.from_traces(traces, st.trace_positions()), lambda mlp, prompts: _replay_gain(st, mlp, ids_of(prompts))
    origin = "speckv" if source == "speckv" else "speclab"  # runs.source: imported or our own
    runs = st.runs(source=origin) if sweep is None else st.runs(source=origin, sweep=sweep)
    if not len(runs):
        hint = "python -m engine import-speckv PATH" if source == "speckv" else "python -m engine profile"
        raise ValueError(f"no {source} runs in {st.path}: run `{hint}` first")
    steps = st.steps()
    steps = steps[steps["run_id"].isin(set(runs["run_id"]))]
    make = T.from_speckv_steps if source == "speckv" else T.from_live_steps
    return make(steps, runs), None


def _replay_gain(st: Store, mlp: Predictor, trace_ids: set) -> dict:
    """Exact replay over the test prompts' traces: the new controller vs fixed:4 and the best
    fixed γ per tier, in modelled tokens/s (summed over tiers)."""
    from engine.decode.policies.speckv import SpeckvPolicy

    fixed = ["ar"] + [f"fixed:{k}" for k in range(1, 9)]
    new = lambda ctx: SpeckvPolicy(mlp, ctx.need_costs("speckv"), name="speckv (new)")  # noqa: E731
    rows = [r for r in summarize(replay_all(st, fixed + [new], trace_ids=trace_ids)) if r["task"] == "all"]
    by = {(r["tier"], r["policy"]): r["tokens_per_s"] for r in rows}  # per weight tier and KV tier
    tiers = sorted({t for t, _ in by})
    best = {t: max(fixed, key=lambda p: by[(t, p)]) for t in tiers}
    ours = sum(by[(t, "speckv (new)")] for t in tiers)
    f4 = sum(by[(t, "fixed:4")] for t in tiers)
    bf = sum(by[(t, best[t])] for t in tiers)
    return dict(tokens_per_s=ours, fixed4_tokens_per_s=f4, best_fixed=best, best_fixed_tokens_per_s=bf,
                gain_vs_fixed4=ours / f4 - 1, gain_vs_best_fixed=ours / bf - 1)


# -- traces and sweeps ---------------------------------------------------------------------------
def trace_prompts(st: Store, pair, prompts: list[tuple[str, str]], max_new_tokens: int,
                  temperature: float | None = None, on_start: Callable[[int], None] = lambda n: None,
                  on_trace: Callable[[], None] = lambda: None, kv_tier: str = "native") -> int:
    """Traces the prompts not yet traced for this pair, tier, KV tier and length with every
    proposer the pair has (a rerun resumes; a prompt traced before a proposer existed is traced
    again, and its newest trace is the one replayed); each is stored as it is made. Returns how
    many were made."""
    from engine.lab.profiling import trace
    from engine.oracles import available

    have = st.traces(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
                     kv_tier=kv_tier, max_new_tokens=max_new_tokens)
    held = st.trace_proposers() if len(have) else {}
    need = set(available(pair))
    # A one-token output has no positions to hold proposals: done as it is.
    done = {r["prompt"] for r in have.to_dict("records")
            if need <= set(held.get(r["trace_id"], ())) or len(r["token_ids"]) <= 1}
    todo = [(task, prompt) for task, prompt in prompts if prompt not in done]
    on_start(len(todo))
    for task, prompt in todo:
        tr = trace(pair, prompt, task, max_new_tokens, temperature=temperature, kv_tier=kv_tier)
        st.add_trace(tr.row, tr.positions)
        on_trace()
    return len(todo)


def profile(st: Store, sweep: str, jobs: list, load: Callable[[str], object], max_new_tokens: int,
            on_start: Callable[[int], None] = lambda n: None, on_run: Callable[[], None] = lambda: None,
            say: Callable[[str], None] = lambda m: None,
            guard: Callable[[Any], ContextManager[Any]] = lambda job: contextlib.nullcontext()) -> int:
    """Runs the sweep's jobs that have no stored run in it yet, tier by tier (a tier's pair loads
    once, through `load(tier)`), then KV tier by KV tier (the cost table policies weigh is the
    KV tier's); each run is stored as it finishes, so an interrupted sweep keeps what it did and
    a rerun resumes. Whatever runs the models (a KV tier's cost measurement, each run) runs inside
    `guard(job)`: the workbench takes its decode slot there, and stops a sweep between runs by
    raising from it (engine/jobs.py). Returns how many ran."""
    from engine.lab.profiling import pending, run_job

    done = {(r["target_tier"], r["kv_tier"] if isinstance(r["kv_tier"], str) else "native", r["prompt"], r["policy"])
            for r in st.runs(sweep=sweep).to_dict("records")}
    todo = pending(jobs, done)
    on_start(len(todo))
    for tier in dict.fromkeys(j.tier for j in todo):
        pair = load(tier)
        for kv_tier in dict.fromkeys(j.kv_tier for j in todo if j.tier == tier):
            mine = [j for j in todo if j.tier == tier and j.kv_tier == kv_tier]
            learned = any(parse_policy(j.policy)[0] in NEEDS_CONTEXT for j in mine)
            with guard(mine[0]):
                ctx = policy_context(st, pair, say, kv_tier) if learned else None
            for job in mine:
                with guard(job):
                    row, steps = run_job(pair, job, ctx, max_new_tokens)
                st.add_run(dict(row, sweep=sweep), steps)
                on_run()
        del pair
    return len(todo)


def sweep_table(runs) -> dict:
    """Per tier (`fp32`; `fp32/fp8` for a KV tier off native): tokens/s of each policy (all
    tokens over all wall time of its runs; a prompt run several times counts once, at its median
    wall time, so a passing slowdown of the machine does not land on whichever policy ran then),
    the best fixed γ (any proposer: `fixed:4@ngram` counts as γ 4), and each adaptive policy against
    max(ar, best fixed)."""
    out = {}
    kv = runs["kv_tier"].fillna("native").tolist() if "kv_tier" in runs else ["native"] * len(runs)
    labels = [tier_label(t, k) for t, k in zip(runs["target_tier"], kv)]
    for tier, df in runs.assign(_setting=labels).groupby("_setting", sort=True):
        per_prompt = df.groupby(["policy", "prompt"])[["n_tokens", "wall_ms"]].median()
        sums = per_prompt.groupby(level="policy").sum()
        tps = {pol: float(r.n_tokens / (r.wall_ms / 1e3)) for pol, r in sums.iterrows()}
        fixed = {p: v for p, v in tps.items() if p.startswith("fixed:")}
        best_fixed = max(fixed, key=fixed.get) if fixed else None
        peer = max([tps.get("ar", 0.0)] + ([fixed[best_fixed]] if best_fixed else []))
        gamma = int(split_spec(best_fixed)[0].split(":")[1]) if best_fixed else None  # `fixed:4@ngram`: 4
        out[tier] = dict(tokens_per_s=tps, best_fixed=best_fixed, best_gamma=gamma,
                         peer=peer, vs_peer={p: v / peer for p, v in tps.items() if not p.startswith("fixed:") and p != "ar"},
                         prompts=int(df["prompt"].nunique()))
    return out


def format_sweep(table: dict) -> str:
    lines = []
    for tier, t in table.items():
        lines.append(f"{tier}: {t['prompts']} prompts; best fixed γ = {t['best_gamma']}; peer max(ar, best fixed) = {t['peer']:.2f} tok/s")
        for pol, v in sorted(t["tokens_per_s"].items(), key=lambda kv: -kv[1]):
            rel = f"  {t['vs_peer'][pol]:.3f}× peer" if pol in t["vs_peer"] else ""
            lines.append(f"  {pol:14} {v:7.2f} tok/s{rel}")
    return "\n".join(lines)


def replay_rows(st: Store, policies: Iterable[str], tiers: list[str] | None, by: str,
                kv_tiers: list[str] | None = None) -> list[dict]:
    """`whatif`'s table: policies replayed over every stored trace, summarized per (tier, KV
    tier) and task or prompt."""
    return summarize(replay_all(st, list(policies), tiers, kv_tiers=kv_tiers), by=by)


# -- KV tuning (engine/kv/tuner.py) and measurement (bench/kv.py) ------------------------------------
# Rough wall time of `bench kv` on this project's 2-core CPU, for the page's button (quick / full).
MEASURE_KV_MINUTES = {True: 5, False: 30}


def _kv_file_missing(db: str) -> bool:
    return not db or (db != ":memory:" and not os.path.exists(db))


def latest_kv_measurement(db: str, target: str | None, target_tier: str | None = None
                          ) -> tuple[dict, list[str]] | None:
    """The newest stored `bench kv` row of the target (at `target_tier`, else any tier, noted), its
    result parsed, with the notes; None when the file or such a row does not exist yet (not an error:
    nothing has been measured). Opened read-only, so a running benchmark keeps the file."""
    from engine.service import kv_tuner as tuner

    if _kv_file_missing(db):
        return None
    with Store(db, read_only=True, wait_s=3.0) as st:
        if not len(st.kv_measurements(target=tuner.target_name(target), kind="bench")):
            return None
        return tuner.newest_measurement(st, target, target_tier)


def tune_kv(db: str, target: str | None, target_tier: str | None, context: int, link_gbit_s: float,
            goal: str) -> dict[str, Any]:
    """`tune`: our KV recommendation from the newest stored measurement beside the seed preset and
    the contradictions, as one JSON-ready dict (ours, seed, contradictions, table, notes,
    measurement). Inputs are checked before the file is opened."""
    from engine.service import kv_tuner as tuner

    tuner.check_inputs(context, link_gbit_s, goal)
    if target_tier is not None:
        parse_tiers(target_tier)
    if _kv_file_missing(db):
        raise ValueError(tuner.no_measurement(target))
    with Store(db, read_only=True, wait_s=3.0) as st:
        ours, seed, contra = tuner.tune(st, target, target_tier, context, link_gbit_s, goal)
    f = ours.figures
    return dict(ours=ours.as_dict(), seed=seed.as_dict(), contradictions=contra,
                table=tuner.comparison_rows(ours, seed), notes=list(ours.notes),
                measurement=dict(measurement_id=f.get("measurement_id"), created_at=f.get("created_at"),
                                 device=f.get("device"), target=tuner.target_name(target),
                                 target_tier=f.get("measured_target_tier"), acceptance_tier=f.get("target_tier")))


def format_tune(out: dict[str, Any]) -> str:
    """`tune`'s text: the measurement it read, choice | measured | seed | why, the contradictions."""
    m, o = out["measurement"], out["ours"]
    acc = f" (acceptance and γ at {m['acceptance_tier']})" if m["acceptance_tier"] != m["target_tier"] else ""
    head = (f"{m['target']} at {m['target_tier']}{acc} on {m['device']}: measurement {m['measurement_id']} "
            f"({m['created_at']}) · {o['context']} tokens over {o['link_gbit_s']:g} Gbit/s · goal {o['goal']}")
    rows = [dict(choice="choice", measured="measured", seed="seed", why="why")] + out["table"]
    width = {k: max(len(r[k]) for r in rows) for k in ("choice", "measured", "seed")}
    lines = [head] + [f"{r['choice']:{width['choice']}}  {r['measured']:{width['measured']}}  "
                      f"{r['seed']:{width['seed']}}  {r['why']}" for r in rows]
    lines += ["contradictions with the seed:"] + [f"  - {c}" for c in out["contradictions"] or ["none"]]
    if out["notes"]:
        lines += ["notes:"] + [f"  - {n}" for n in out["notes"]]
    return "\n".join(lines)


def kv_view(row: dict, kv_tier: str, coded: bool, predictor: str | None, window: int, context: int,
            link_gbit_s: float, goal: str, target_tier: str | None = None) -> dict[str, Any]:
    """What the KV & prefetch page draws for one stored row and its inputs: bits per tier × coding,
    speeds, the restore curve of the chosen tier (measured and modelled at this context and W), the
    W and context sweeps, acceptance, the chosen setting's modelled restore, the recommendation
    beside the seed and the contradictions. ValueError for bad inputs, in one line."""
    from engine.service import kv_tuner as tuner

    tuner.check_inputs(context, link_gbit_s, goal)
    if kv_tier not in KV_TIERS:
        raise ValueError(f"unknown KV tier {kv_tier!r}; known: {', '.join(KV_TIERS)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"W must be a whole number of tokens ≥ 1, got {window!r}")
    m, notes = row["result"], []
    if window > context:
        notes.append(f"W {window} exceeds the context ({context} tokens): one window of {context}")
    w = min(window, context)
    ours, seed, contra = tuner.tune_row(row, context, link_gbit_s, goal, target_tier)
    cost, cost_notes = tuner.tier_cost(m, kv_tier, predictor, window)
    restore = {k: tuner.restore_seconds(cost, context, w, link_gbit_s, k) for k in (True, False)}
    return dict(
        bits=tuner.bits_rows(m, predictor), speeds=tuner.speeds(m, predictor),
        restore=tuner.restore_rows(m, kv_tier, predictor, w, context),
        breakeven=dict(measured=tuner.measured_breakeven(m, kv_tier), modelled=tuner.modelled_breakeven(cost, context, w)),
        by_window=tuner.window_rows(m, kv_tier, context, link_gbit_s), by_context=tuner.context_rows(m),
        acceptance=tuner.acceptance_rows(m),
        chosen=dict(kv_tier=kv_tier, coded=coded, window=w, bits=tuner.bits(m, kv_tier, coded, predictor),
                    restore_s=restore[coded], other_s=restore[not coded]),
        ours=ours.as_dict(), seed=seed.as_dict(), table=tuner.comparison_rows(ours, seed), contradictions=contra,
        missing=tuner.missing(m), notes=notes + cost_notes + list(ours.notes),
    )


def measure_kv(db_path: str, quick: bool = True, target: str | None = None) -> object:
    """Runs the KV benchmark (`python -m engine bench kv`) into `db_path`: bench/kv.py's
    `run(argv)` with `--db PATH` (`--quick` for the short version, `--target ID` when given), which
    stores its result with `Store.add_kv_measurement`; returns what `run` returns. Imported only
    now: it loads models. A benchmark that cannot be imported is a ValueError in one line."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # bench/ sits beside engine/, as for `python -m engine bench`
        sys.path.insert(0, root)
    try:
        bench = importlib.import_module("bench.kv")
    except Exception as e:  # noqa: BLE001 - whatever broke the import, the user gets one line
        raise ValueError(f"cannot load the KV benchmark bench/kv.py: {one_line(e)}") from None
    run = getattr(bench, "run", None)
    if not callable(run):
        raise ValueError("bench/kv.py has no run(argv) to call")
    return run(["--db", db_path] + (["--quick"] if quick else []) + (["--target", target] if target else []))


# -- exports (engine/export.py) -----------------------------------------------------------------
def save_export(db: str, cfg, fmt: str, name: str | None = None) -> tuple[str, int, str]:
    """Renders a TunedConfig in `fmt` and stores it as the next version of `name` (default: the
    target and the policy): (name, version, text). The text is made before the file is opened."""
    from engine.service.export import default_name, render

    text = render(cfg, fmt)
    name = (name or "").strip() or default_name(cfg)
    if not db:
        raise ValueError("an export is stored in a database: pass --db")
    with Store(db, wait_s=3.0) as st:
        return name, st.add_export(name, cfg.to_dict(), fmt, text), text


def stored_exports(db: str):
    """Every stored export, oldest first (empty when the file does not exist yet)."""
    import pandas as pd

    if _kv_file_missing(db):
        return pd.DataFrame(columns=["name", "version", "format", "created_at"])
    with Store(db, wait_s=3.0) as st:  # read-write: a file from before exports is migrated
        return st.exports()


def latest_live_run(db: str) -> dict | None:
    """The newest finished live run (what the Export page starts from); None when there is none."""
    if _kv_file_missing(db):
        return None
    with Store(db, wait_s=3.0) as st:
        runs = st.runs(source="speclab")
    runs = runs[runs["error"].isna()] if len(runs) else runs
    return None if not len(runs) else runs.iloc[-1].to_dict()
