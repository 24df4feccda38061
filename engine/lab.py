"""The measure → replay → learn → choose commands: `profile`, `costs`, `trace`, `whatif`, `retrain`
(DESIGN.md, "Acceptance traces" and "Controllers"). Each is a thin function over engine modules
and the store, registered on the CLI by engine/cli.py."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator

import numpy as np

TRACE_POLICIES = "ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,fixed:8,heuristic,rules,speckv,rakv"


# -- shared pieces ---------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _prompts(which: str, per_task: int | None) -> list[tuple[str, str]]:
    from engine import prompts as P

    sets = {"heldout": lambda: P.heldout(per_task), "bench": lambda: P.bench_prompts(per_task or 2),
            "train": lambda: P.training_prompts(per_task or 10)}
    if which not in sets:
        raise ValueError(f"unknown prompt set {which!r}; use one of {', '.join(sets)}")
    return sets[which]()


def parse_tiers(text: str) -> list[str]:
    from engine.models import TIERS

    tiers = _csv(text)
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise ValueError(f"unknown tier(s) {', '.join(bad) or '(none)'}; known: {', '.join(TIERS)}")
    return tiers


def _pairs(a: argparse.Namespace, tiers: list[str]) -> Iterator:
    """The pair at each tier, loaded when the caller gets to it."""
    from engine.models import load_pair

    for tier in tiers:
        yield load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code,
                        progress=lambda m: print(m, file=sys.stderr))


def _db_arg(p: argparse.ArgumentParser) -> None:
    from engine.cli import DEFAULT_DB

    p.add_argument("--db", default=os.environ.get("SPECLAB_DB", DEFAULT_DB), help=f"DuckDB file (default {DEFAULT_DB})")


def _stored_costs(store, key: tuple):
    """The newest cost table stored for (device, target, draft, target_tier, draft_tier), or None."""
    from engine.costs import CostTable

    rows = store.costs(*key).to_dict("records")
    return CostTable.from_rows(rows) if rows else None


def cost_key(pair) -> tuple:
    return (str(pair.device), pair.target_name, pair.draft_name, pair.target_tier, pair.draft_tier)


def cost_table(store, pair):
    """The newest stored cost table for this pair and tier; measured (and stored) when absent."""
    from engine.costs import REPS, measure

    table = _stored_costs(store, cost_key(pair))
    if table is None:
        print(f"measuring costs for {pair.target_name} at {pair.target_tier} (once; stored)…", file=sys.stderr)
        table = measure(pair)
        store.add_costs(table.to_rows(REPS))
    return table


def calibrate_costs(store, key: tuple):
    """Stores (and returns) the cost table of `key` (device, target, draft, target tier, draft
    tier) calibrated against the stored live steps of that pair, device and tier."""
    from engine.costs import REPS, calibrate

    table = _stored_costs(store, key)
    if table is None:
        raise ValueError(f"no cost table for {key[1]} + {key[2]} at {key[3]} on {key[0]}: run `python -m engine costs` first")
    live = store.step_times(*key[:4])
    table = calibrate(table, live.itertuples(index=False, name=None))
    store.add_costs(table.to_rows(REPS))
    return table


def calibrate_all(store) -> list[tuple[tuple, object]]:
    """Every stored cost table calibrated where its live steps allow: (key, table or the reason not)."""
    from store.tables import COST_KEY

    keys = store.costs()[list(COST_KEY)].drop_duplicates()
    out = []
    for key in keys.itertuples(index=False, name=None):
        try:
            out.append((key, calibrate_costs(store, key)))
        except ValueError as e:
            out.append((key, str(e)))
    return out


def policy_context(store, pair):
    """What `speckv`/`rakv` need: this pair's cost table and the store's controllers."""
    from engine.policies import PolicyContext

    return PolicyContext(costs=cost_table(store, pair), controller=_controller_loader(store))


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


def add_model_args(p: argparse.ArgumentParser) -> None:
    from engine.cli import add_model_args as add

    add(p)


# -- costs -----------------------------------------------------------------------------------------
def _add_costs(sub) -> None:
    from engine.costs import REPS

    p = sub.add_parser("costs", help="measure draft/verify costs per tier and context (stored)")
    add_model_args(p)
    p.add_argument("--tiers", default="fp32", help="comma-separated target tiers")
    p.add_argument("--buckets", default="64,256,512", help="context lengths to measure at")
    p.add_argument("--reps", type=int, default=REPS, help="timed repetitions per point (after warm-up)")
    p.add_argument("--calibrate", action="store_true",
                   help="instead of measuring: scale the stored table to the stored live steps of the pair (per k)")
    _db_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_costs)


def cmd_costs(a: argparse.Namespace) -> int:
    from engine.costs import measure
    from store import Store

    tiers = parse_tiers(a.tiers)
    try:
        buckets = tuple(int(b) for b in _csv(a.buckets))
    except ValueError:
        raise ValueError(f"--buckets takes comma-separated context lengths, got {a.buckets!r}") from None
    if not buckets or min(buckets) < 1 or a.reps < 1:
        raise ValueError("--buckets needs positive context lengths and --reps ≥ 1")
    out = []
    with Store(a.db, wait_s=0.0):
        pass  # a corrupt or locked file fails now, not after minutes of measuring
    for pair in _pairs(a, tiers):
        if a.calibrate:
            with Store(a.db) as st:
                table = calibrate_costs(st, cost_key(pair))
        else:
            table = measure(pair, buckets, a.reps, progress=lambda m: print(m, file=sys.stderr))
            with Store(a.db) as st:
                st.add_costs(table.to_rows(a.reps))
        out.append(dict(table.key, buckets=table.buckets, draft_ms=table.draft_ms,
                        verify_ms=table.verify_ms, step_factor=table.step_factor))
        if not a.json:
            print(f"{pair.target_tier}: draft {pair.draft_name} ({pair.draft_tier}) on {pair.device}")
            for b, d, v in zip(table.buckets, table.draft_ms, table.verify_ms):
                print(f"  ctx {b:5d}  draft {d:6.2f} ms/token  verify k=0..8 " + " ".join(f"{x:6.1f}" for x in v))
            if table.step_factor:
                print("  live / measured step time, k=0..8 " + " ".join(f"{x:6.3f}" for x in table.step_factor))
    if a.json:
        print(json.dumps(out))
    return 0


# -- trace -----------------------------------------------------------------------------------------
def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="acceptance traces along the target's greedy output (stored)")
    add_model_args(p)
    p.add_argument("--tiers", default="fp32")
    p.add_argument("--prompts", default="heldout", help="prompt set: heldout, bench or train")
    p.add_argument("--per-task", type=int, default=None, help="prompts per task (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None,
                   help="also store Σ min(p, q) per position at this sampling temperature")
    _db_arg(p)
    p.set_defaults(func=cmd_trace)


def cmd_trace(a: argparse.Namespace) -> int:
    from engine.profiling import trace
    from store import Store

    tiers, prompts = parse_tiers(a.tiers), _prompts(a.prompts, a.per_task)
    if a.max_new_tokens < 2:
        raise ValueError("--max-new-tokens must be ≥ 2 for a trace to have a position")
    made = 0
    with Store(a.db) as st:  # one connection; each trace is committed as it is made
        for pair in _pairs(a, tiers):
            have = st.traces(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
                             max_new_tokens=a.max_new_tokens)
            done = set(have["prompt"]) if len(have) else set()
            todo = [(t, p) for t, p in prompts if p not in done]  # a rerun resumes where it stopped
            bar = _progress(len(todo), f"trace {pair.target_tier}")
            for task, prompt in todo:
                tr = trace(pair, prompt, task, a.max_new_tokens, temperature=a.temperature)
                st.add_trace(tr.row, tr.positions)
                made += 1
                bar.update(1)
            bar.close()
    print(f"{made} traces stored in {a.db}", file=sys.stderr)
    return 0


# -- whatif ----------------------------------------------------------------------------------------
def _add_whatif(sub) -> None:
    p = sub.add_parser("whatif", help="replay policies over stored traces with the stored cost tables")
    p.add_argument("--policies", default=TRACE_POLICIES)
    p.add_argument("--tiers", default=None, help="only these target tiers")
    p.add_argument("--by", default="task", choices=("task", "prompt"), help="rows per task or per prompt")
    _db_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_whatif)


def replay_all(store, policies: list, tiers: list[str] | None = None, trace_ids: set | None = None) -> list:
    """Every policy (a spec string, or a function of the PolicyContext) over every stored trace
    (optionally some tiers/traces), with the cost table of the trace's pair and tier."""
    from engine.policies import PolicyContext, make_policy
    from engine.whatif import replay

    traces = store.traces()
    if tiers:
        traces = traces[traces["target_tier"].isin(tiers)]
    if trace_ids is not None:
        traces = traces[traces["trace_id"].isin(trace_ids)]
    if not len(traces):
        raise ValueError(f"no traces in {store.path}: run `python -m engine trace` first")
    positions = store.trace_positions()
    by_trace = {tid: df.to_dict("records") for tid, df in positions.groupby("trace_id", sort=False)}
    out, contexts = [], {}
    for t in traces.to_dict("records"):
        key = (t["device"], t["target"], t["draft"], t["target_tier"], t["draft_tier"])
        if key not in contexts:
            contexts[key] = PolicyContext(costs=_stored_costs(store, key), controller=_controller_loader(store))
        ctx = contexts[key]
        for spec in policies:
            policy = make_policy(spec, ctx) if isinstance(spec, str) else spec(ctx)
            out.append(replay(policy, t, by_trace.get(t["trace_id"], []), ctx.costs))
    return out


def _controller_loader(store):
    """Loads stored controllers by (name, version), each once: a context built while the store
    is open keeps working after it closes."""
    from engine.controllers import Predictor

    cache: dict = {}

    def load(name: str, version: int | None) -> Predictor:
        if (name, version) not in cache:
            params, meta = store.controller(name, version)
            cache[(name, version)] = Predictor(meta["kind"], params, meta)
        return cache[(name, version)]

    return load


def context_for(db: str, pair, spec: str):
    """The PolicyContext `spec` needs on `pair` (None for policies that need nothing), loaded from
    the store now so that a long generation holds no database file open."""
    from engine.policies import NEEDS_CONTEXT, make_policy, parse_policy
    from store import Store

    name = parse_policy(spec)[0]
    if name not in NEEDS_CONTEXT:
        return None
    if not db:
        raise ValueError(f"policy {name} reads its cost table and controller from a database: pass --db")
    with Store(db) as st:
        ctx = policy_context(st, pair)
        make_policy(spec, ctx)  # loads (and caches) the controller while the file is open
    return ctx


def cmd_whatif(a: argparse.Namespace) -> int:
    from engine.whatif import summarize
    from store import Store

    with Store(a.db, read_only=True) as st:
        rows = summarize(replay_all(st, _csv(a.policies), parse_tiers(a.tiers) if a.tiers else None), by=a.by)
    if a.json:
        print(json.dumps(rows))
        return 0
    width = max(len(str(r[a.by])) for r in rows) if a.by == "prompt" else 14
    print(f"{'tier':5} {'policy':14} {a.by:{min(width, 48)}} {'prompts':>7} {'tok/step':>8} {'tok/s':>8}  self-scored gap")
    for r in rows:
        tps = f"{r['tokens_per_s']:8.1f}" if r["tokens_per_s"] else "       –"
        gap = f"{r['self_scored_gap']:+.1%}" if r["self_scored_gap"] is not None else ""
        label = str(r[a.by])[:48]
        print(f"{r['target_tier']:5} {r['policy']:14} {label:{min(width, 48)}} {r['prompts']:7d} {r['tokens_per_step']:8.2f} {tps}  {gap}")
    return 0


# -- retrain ---------------------------------------------------------------------------------------
def _add_retrain(sub) -> None:
    p = sub.add_parser("retrain", help="retrain the speckv controller from runs or traces in the store")
    p.add_argument("--source", default="traces", choices=("traces", "runs", "speckv"))
    p.add_argument("--protocol", default=None, choices=("paper", "prompt"),
                   help="split over rows (the paper's) or over prompts (default: paper for speckv, else prompt)")
    p.add_argument("--sweep", default=None, help="only runs of this profile sweep (source runs)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-activate", action="store_true", help="store it without making it the default")
    _db_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_retrain)


def retrain(st, source: str, protocol: str | None = None, seed: int = 42, sweep: str | None = None,
            activate: bool = True):
    """Fit `speckv` (MLP) and `speckv-rf` on the source's examples, test them, store both as new
    versions (active unless told), and return the report."""
    from engine import training as T

    protocol = protocol or ("paper" if source == "speckv" else "prompt")
    ex, whatif_fn = _examples(st, source, sweep)
    mlp, rf, m = T.train(ex, protocol, seed)
    test = m.pop("test_rows")
    if whatif_fn is None:
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


def cmd_retrain(a: argparse.Namespace) -> int:
    from store import Store

    with Store(a.db) as st:
        r = retrain(st, a.source, a.protocol, a.seed, a.sweep, activate=not a.no_activate)
    if a.json:
        print(json.dumps(r.to_dict()))
        return 0
    print(f"speckv v{r.version} ({r.source}, {r.protocol} split: {r.n_train} train / {r.n_test} test rows)\n"
          f"  MLP(16)  test corr {r.test_corr:.3f}  MSE {r.test_mse:.4f}  decision {r.decision_ms_median:.4f} ms (median)\n"
          f"  RF(100)  test corr {r.rf_test_corr:.3f}  MSE {r.rf_test_mse:.4f}  decision {r.rf_decision_ms_median:.3f} ms\n"
          f"  what-if ({r.whatif_kind}): {r.whatif_gain_vs_fixed4:+.1%} vs fixed:4, "
          f"{r.whatif_gain_vs_best_fixed:+.1%} vs the best fixed γ\n  {json.dumps(r.whatif)}")
    return 0


def _examples(st, source: str, sweep: str | None):
    """(examples, what-if function or None) for the chosen source."""
    from engine import training as T

    if source == "traces":
        traces = st.traces()
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


def _replay_gain(st, mlp, trace_ids: set) -> dict:
    """Exact replay over the test prompts' traces: the new controller vs fixed:4 and the best
    fixed γ per tier, in modelled tokens/s (summed over tiers)."""
    from engine.policies.speckv import SpeckvPolicy
    from engine.whatif import summarize

    fixed = ["ar"] + [f"fixed:{k}" for k in range(1, 9)]
    new = lambda ctx: SpeckvPolicy(mlp, ctx.need_costs("speckv"), name="speckv (new)")  # noqa: E731
    rows = [r for r in summarize(replay_all(st, fixed + [new], trace_ids=trace_ids)) if r["task"] == "all"]
    by = {(r["target_tier"], r["policy"]): r["tokens_per_s"] for r in rows}
    tiers = sorted({t for t, _ in by})
    best = {t: max(fixed, key=lambda p: by[(t, p)]) for t in tiers}
    ours = sum(by[(t, "speckv (new)")] for t in tiers)
    f4 = sum(by[(t, "fixed:4")] for t in tiers)
    bf = sum(by[(t, best[t])] for t in tiers)
    return dict(tokens_per_s=ours, fixed4_tokens_per_s=f4, best_fixed=best, best_fixed_tokens_per_s=bf,
                gain_vs_fixed4=ours / f4 - 1, gain_vs_best_fixed=ours / bf - 1)


# -- profile ---------------------------------------------------------------------------------------
def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="sweep prompts × target tiers × policies live; every run and step stored")
    add_model_args(p)
    p.add_argument("--tiers", default="fp32")
    p.add_argument("--policies", default="ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,speckv,rakv")
    p.add_argument("--prompts", default="heldout", help="prompt set: heldout, bench or train")
    p.add_argument("--per-task", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sweep", default="default", help="sweep name: a rerun with the same name resumes it")
    _db_arg(p)
    p.add_argument("--json", action="store_true", help="print the per-tier table as JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(a: argparse.Namespace) -> int:
    from engine.policies import NEEDS_CONTEXT, parse_policy
    from engine.profiling import pending, run_job, sweep_jobs
    from store import Store

    tiers, prompts, policies = parse_tiers(a.tiers), _prompts(a.prompts, a.per_task), _csv(a.policies)
    for spec in policies:
        parse_policy(spec)  # a typo fails before any model loads
    jobs = sweep_jobs(prompts, tiers, policies)
    # One read-write connection for the sweep (DESIGN.md); each run is committed as it finishes,
    # so an interrupted sweep keeps what it did and a rerun with the same name skips it.
    with Store(a.db) as st:
        done = {(r["target_tier"], r["prompt"], r["policy"]) for r in st.runs(sweep=a.sweep).to_dict("records")}
        todo = pending(jobs, done)
        bar = _progress(len(todo), f"profile {a.sweep}")
        try:
            for tier in tiers:
                mine = [j for j in todo if j.tier == tier]
                if not mine:
                    continue
                pair = next(_pairs(a, [tier]))
                learned = any(parse_policy(j.policy)[0] in NEEDS_CONTEXT for j in mine)
                ctx = policy_context(st, pair) if learned else None
                for job in mine:
                    row, steps = run_job(pair, job, ctx, a.max_new_tokens)
                    st.add_run(dict(row, sweep=a.sweep), steps)
                    bar.update(1)
                del pair
        except KeyboardInterrupt:
            bar.close()
            print(f"\ninterrupted: finished runs are stored; rerun with --sweep {a.sweep} to resume", file=sys.stderr)
            return 130
        bar.close()
    with Store(a.db, read_only=True) as st:
        table = sweep_table(st.runs(sweep=a.sweep))
    print(json.dumps(table) if a.json else format_sweep(table))
    return 0


def sweep_table(runs) -> dict:
    """Per tier: tokens/s of each policy (all tokens over all wall time of its runs; a prompt run
    several times counts once, at its median wall time, so a passing slowdown of the machine
    does not land on whichever policy ran then), the best fixed γ, and each adaptive policy
    against max(ar, best fixed)."""
    out = {}
    for tier, df in runs.groupby("target_tier", sort=True):
        per_prompt = df.groupby(["policy", "prompt"])[["n_tokens", "wall_ms"]].median()
        sums = per_prompt.groupby(level="policy").sum()
        tps = {pol: float(r.n_tokens / (r.wall_ms / 1e3)) for pol, r in sums.iterrows()}
        fixed = {p: v for p, v in tps.items() if p.startswith("fixed:")}
        best_fixed = max(fixed, key=fixed.get) if fixed else None
        peer = max([tps.get("ar", 0.0)] + ([fixed[best_fixed]] if best_fixed else []))
        out[tier] = dict(tokens_per_s=tps, best_fixed=best_fixed, best_gamma=int(best_fixed.split(":")[1]) if best_fixed else None,
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


COMMANDS = (_add_profile, _add_costs, _add_trace, _add_whatif, _add_retrain)
