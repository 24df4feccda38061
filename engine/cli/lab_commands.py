"""Commands that measure, replay and learn over the store: costs, trace, whatif, retrain, profile, tune."""
from __future__ import annotations

import argparse
import json

from engine.base.flags import KV_TIERS_ARG, exact_verify
from engine.base.helpers import csv_list
from engine.cli.parsing import JSON_ARG, PROMPTS_ARG, TIERS_ARG, command, load, open_or_fail, pairs, progress_bar, say
from engine.decode.costs import CONTEXT_BUCKETS, REPS
from engine.decode.policies import split_policies
from engine.service import TRACE_POLICIES


# -- measure, replay, learn ------------------------------------------------------------------------
@command("kernels", "this machine's verify kernels: each chosen per weight shape and row count by a probe",
         TIERS_ARG, JSON_ARG, models=True)
def cmd_kernels(a: argparse.Namespace) -> int:
    from engine.service import parse_tiers
    from engine.service.costs.kernels import kernel_report

    out = []
    for pair in pairs(a, parse_tiers(a.tiers, a.engine)):
        rep = dict(target_tier=pair.target_tier, **kernel_report(pair))
        out.append(rep)
        if a.json:
            continue
        if not rep["rows"]:
            print(f"{pair.target_name} ({pair.target_tier}) on {pair.device}: {rep['note']}")
            continue
        print(f"{pair.target_name} ({pair.target_tier}) on {rep['cpu']}, {rep['threads']} threads, torch {rep['torch']}: "
              f"kernel set {rep['kernel_set']}")
        names = [k.removesuffix("_ms") for k in rep["rows"][0] if k.endswith("_ms")]
        print(f"  {'shape':>11} {'rows':>4} {'chosen':>7} " + " ".join(f"{n + ' ms':>10}" for n in names) + "  vs stock")
        for r in rep["rows"]:
            print(f"  {r['shape']:>11} {r['rows']:4d} {r['kernel']:>7} "
                  + " ".join(f"{r[n + '_ms']:10.3f}" for n in names) + f"  {r['vs_stock']:8.3f}")
        if "count" in rep["rows"][0]:  # a forward reads every linear: the sum per row count
            total: dict[int, list[float]] = {}
            for r in rep["rows"]:
                t = total.setdefault(r["rows"], [0.0, 0.0])
                t[0], t[1] = t[0] + r["count"] * r["rowdot_ms"], t[1] + r["count"] * r["stock_ms"]
            print("  a forward's linears: " + ", ".join(f"{m} rows {a:.1f} ms ({a / b:.2f}× stock)"
                                                         for m, (a, b) in total.items()))
        if rep["note"]:
            print(f"  {rep['note']}")
    if a.json:
        print(json.dumps(out))
    return 0


@command("costs", "measure draft/verify costs per tier, KV tier and context (stored)", TIERS_ARG, KV_TIERS_ARG,
         ("--buckets", dict(default=",".join(map(str, CONTEXT_BUCKETS)), help="context lengths to measure at")),
         ("--reps", dict(type=int, default=REPS, help="timed repetitions per point (after warm-up)")),
         ("--calibrate", dict(action="store_true", help="instead of measuring: scale the stored table to the "
                                                          "stored live steps of the pair (per k)")),
         JSON_ARG, models=True, db="DuckDB file")
def cmd_costs(a: argparse.Namespace) -> int:
    from engine.lab.profiling import measure_costs
    from engine.service import calibrate_costs, cost_key, parse_kv_tiers, parse_tiers
    from store import Store

    tiers, kv_tiers = parse_tiers(a.tiers, a.engine), parse_kv_tiers(a.kv_tiers, a.engine)
    try:
        buckets = tuple(int(b) for b in csv_list(a.buckets))
    except ValueError:
        raise ValueError(f"--buckets takes comma-separated context lengths, got {a.buckets!r}") from None
    if not buckets or min(buckets) < 1 or a.reps < 1:
        raise ValueError("--buckets needs positive context lengths and --reps ≥ 1")
    open_or_fail(a.db)
    out = []
    for pair, kv_tier in ((pair, kv) for pair in pairs(a, tiers) for kv in kv_tiers):
        if a.calibrate:
            with Store(a.db) as st:
                table = calibrate_costs(st, cost_key(pair, kv_tier))
        else:
            table = measure_costs(pair, buckets, a.reps, progress=say, kv_tier=kv_tier)
            with Store(a.db) as st:
                st.add_costs(table.to_rows(a.reps))
        out.append(dict(table.key, buckets=table.buckets, draft_ms=table.draft_ms,
                        verify_ms=table.verify_ms, step_factor=table.step_factor, prefill_ms=table.prefill_ms,
                        fill_ms=table.fill_ms, cold_read_ms=table.cold_read_ms, warm_read_ms=table.warm_read_ms,
                        spread=table.spread, busy=table.busy))
        if not a.json:
            busy = "" if table.busy is None else f"; other processes {table.busy:.2f} cores while measured"
            print(f"{pair.target_tier}, KV {kv_tier}: draft {pair.draft_name} ({pair.draft_tier}) on {pair.device} "
                  f"({table.describe()}{busy})")
            none = [None] * len(table.buckets)
            for b, d, v, p, c, w in zip(table.buckets, table.draft_ms, table.verify_ms, table.prefill_ms or none,
                                        table.cold_read_ms or none, table.warm_read_ms or none):
                reads = "" if None in (p, c, w) else f"  prefill {p:7.1f}  draft reads cold {c:6.1f}, warm {w:5.2f}/token"
                print(f"  ctx {b:5d}  draft {d:6.2f} ms/token  verify k=0..8 " + " ".join(f"{x:6.1f}" for x in v) + reads)
            if table.step_factor:
                print("  live / measured step time, k=0..8 " + " ".join(f"{x:6.3f}" for x in table.step_factor))
    if a.json:
        print(json.dumps(out))
    return 0


@command("trace", "acceptance traces along the target's greedy output (stored)", TIERS_ARG, KV_TIERS_ARG, PROMPTS_ARG,
         ("--per-task", dict(type=int, default=None, help="prompts per task (default: all)")),
         ("--max-new-tokens", dict(type=int, default=128)),
         ("--temperature", dict(type=float, default=None,
                                help="also store Σ min(p, q) per position at this sampling temperature")),
         models=True, db="DuckDB file")
def cmd_trace(a: argparse.Namespace) -> int:
    from engine.service import parse_kv_tiers, parse_tiers, prompt_set, trace_prompts
    from store import Store

    tiers, kv_tiers = parse_tiers(a.tiers, a.engine), parse_kv_tiers(a.kv_tiers, a.engine)
    prompts = prompt_set(a.prompts, a.per_task)
    if a.max_new_tokens < 2:
        raise ValueError("--max-new-tokens must be ≥ 2 for a trace to have a position")
    made = 0
    with Store(a.db) as st:  # one connection; each trace is committed as it is made
        for pair in pairs(a, tiers):
            for kv_tier in kv_tiers:
                bar = progress_bar(f"trace {pair.target_tier}, KV {kv_tier}", "trace")
                made += trace_prompts(st, pair, prompts, a.max_new_tokens, a.temperature,
                                      on_start=lambda n: bar.reset(total=n), on_trace=lambda: bar.update(1),
                                      kv_tier=kv_tier)
                bar.close()
    say(f"{made} traces stored in {a.db}")
    return 0


@command("whatif", "replay policies over stored traces with the stored cost tables",
         ("--policies", dict(default=TRACE_POLICIES)),
         ("--tiers", dict(default=None, help="only these target tiers")),
         ("--kv-tiers", dict(default=None, help="only traces made at these KV tiers (native, fp8, int8)")),
         ("--by", dict(default="task", choices=("task", "prompt"), help="rows per task or per prompt")),
         JSON_ARG, db="DuckDB file")
def cmd_whatif(a: argparse.Namespace) -> int:
    from engine.service import parse_kv_tiers, parse_tiers, replay_rows
    from store import Store

    kv_tiers = parse_kv_tiers(a.kv_tiers, None) if a.kv_tiers else None  # stored traces: any engine's tiers
    with Store(a.db, read_only=True) as st:
        rows = replay_rows(st, split_policies(a.policies), parse_tiers(a.tiers, None) if a.tiers else None, a.by,
                           kv_tiers)
    if a.json:
        print(json.dumps(rows))
        return 0
    width = min(max(len(str(r[a.by])) for r in rows), 48) if a.by == "prompt" else 14
    print(f"{'tier':5} {'KV':6} {'policy':14} {a.by:{width}} {'prompts':>7} {'tok/step':>8} {'tok/s':>8}  self-scored gap")
    for r in rows:
        tps = f"{r['tokens_per_s']:8.1f}" if r["tokens_per_s"] else "       –"
        gap = f"{r['self_scored_gap']:+.1%}" if r["self_scored_gap"] is not None else ""
        print(f"{r['target_tier']:5} {r['kv_tier']:6} {r['policy']:14} {str(r[a.by])[:48]:{width}} {r['prompts']:7d} "
              f"{r['tokens_per_step']:8.2f} {tps}  {gap}")
    return 0


@command("retrain", "retrain the speckv controller from runs or traces in the store",
         ("--source", dict(default="traces", choices=("traces", "runs", "speckv"))),
         ("--protocol", dict(default=None, choices=("paper", "prompt"), help="split over rows (the paper's) or "
                             "over prompts (default: paper for speckv, else prompt)")),
         ("--sweep", dict(default=None, help="only runs of this profile sweep (source runs)")),
         ("--seed", dict(type=int, default=42)),
         ("--activate", dict(action="store_true", help="make it the default even if its held-out gain loses to the "
                             "best fixed γ or the active version, or its test correlation is ≤ 0 (by default such "
                             "a version is stored inactive)")),
         ("--no-activate", dict(action="store_true", help="store it without making it the default")),
         JSON_ARG, db="DuckDB file")
def cmd_retrain(a: argparse.Namespace) -> int:
    from engine.service import retrain
    from engine.service.replays import verdict
    from store import Store

    activate = _activation(a)  # a contradiction fails before the store is opened
    with Store(a.db) as st:
        r = retrain(st, a.source, a.protocol, a.seed, a.sweep, activate=activate)
    line = verdict(r)
    if line and not r.activated:  # said, never silent: how to override it
        line += "; `--activate` makes it active anyway"
    if a.json:
        print(json.dumps(r.to_dict()))
        if line:
            say(line)
        return 0
    state = "active" if r.activated else "not active"
    print(f"speckv v{r.version} ({r.source}, {r.protocol} split: {r.n_train} train / {r.n_test} test rows; {state})\n"
          f"  MLP(16)  test corr {r.test_corr:.3f}  MSE {r.test_mse:.4f}  decision {r.decision_ms_median:.4f} ms (median)\n"
          f"  RF(100)  test corr {r.rf_test_corr:.3f}  MSE {r.rf_test_mse:.4f}  decision {r.rf_decision_ms_median:.3f} ms\n"
          f"  what-if ({r.whatif_kind}): {r.whatif_gain_vs_fixed4:+.1%} vs fixed:4, "
          f"{r.whatif_gain_vs_best_fixed:+.1%} vs the best fixed γ"
          + (f", {r.whatif_gain_vs_active:+.1%} vs the active v{r.active_version}" if r.whatif_gain_vs_active is not None else "")
          + f"\n  {json.dumps(r.whatif)}")
    if line:
        print(line)
    return 0


def _activation(a: argparse.Namespace) -> bool | None:
    """`retrain`'s activate: forced on or off by a flag, else None (the service's rule)."""
    if a.activate and a.no_activate:
        raise ValueError("--activate and --no-activate contradict each other: pass one of them")
    return True if a.activate else False if a.no_activate else None


@command("profile", "sweep prompts × target tiers × KV tiers × policies live; every run and step stored", TIERS_ARG,
         KV_TIERS_ARG,
         ("--policies", dict(default="ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,speckv,rakv")), PROMPTS_ARG,
         ("--per-task", dict(type=int, default=2)), ("--max-new-tokens", dict(type=int, default=128)),
         ("--sweep", dict(default="default", help="sweep name: a rerun with the same name resumes it")),
         ("--ray", dict(nargs="?", const="", default=None, metavar="ADDRESS", help="run the cells on a Ray cluster "
                        "(host:port, ray://host:port or auto; no address: a local one of 2 CPUs); docs/scale.md")),
         ("--workers", dict(type=int, default=None, help="with --ray: workers (default: as many as the cluster holds)")),
         ("--worker-gpus", dict(type=float, default=None, help="with --ray: GPUs per worker (default: 1 where the "
                                "cluster has GPUs, else 0)")),
         ("--json", dict(action="store_true", help="print the per-tier table as JSON")), models=True, db="DuckDB file")
def cmd_profile(a: argparse.Namespace) -> int:
    from engine.decode.policies import parse_policy
    from engine.service import format_sweep, parse_kv_tiers, parse_tiers, profile, prompt_set, sweep_table
    from engine.service.sweeps.serial import sweep_jobs
    from store import Store

    tiers, prompts, policies = parse_tiers(a.tiers, a.engine), prompt_set(a.prompts, a.per_task), split_policies(a.policies)
    kv_tiers = parse_kv_tiers(a.kv_tiers, a.engine)
    for spec in policies:
        parse_policy(spec)  # a typo fails before any model loads
    with Store(a.db) as st:  # one read-write connection for the sweep; each run committed as it finishes
        bar = progress_bar(f"profile {a.sweep}")
        try:
            jobs = sweep_jobs(prompts, tiers, policies, kv_tiers)
            if a.ray is not None:  # the cells on a cluster; this process alone writes the store
                _profile_on_ray(a, st, jobs, bar)
            else:
                profile(st, a.sweep, jobs, lambda tier: load(a, tier), a.max_new_tokens,
                        on_start=lambda n: bar.reset(total=n), on_run=lambda: bar.update(1), say=say)
        except KeyboardInterrupt:
            bar.close()
            say(f"\ninterrupted: finished runs are stored; rerun with --sweep {a.sweep} to resume")
            return 130
        bar.close()
    with Store(a.db, read_only=True) as st:
        table = sweep_table(st.runs(sweep=a.sweep))
    print(json.dumps(table) if a.json else format_sweep(table))
    return 0


def _profile_on_ray(a: argparse.Namespace, st, jobs: list, bar) -> None:
    """`profile --ray`: service/sweeps/cluster_sweep.py with the pair the model flags name."""
    from engine.service.sweeps.cluster import ClusterSpec, PairSpec
    from engine.service.sweeps.cluster_sweep import profile_on_ray

    pair = PairSpec(a.target, a.draft, a.draft_tier, a.device, a.trust_remote_code, exact_verify(a), a.eagle, a.engine)
    res = profile_on_ray(st, a.sweep, jobs, pair, a.max_new_tokens, ClusterSpec(a.ray or None, a.workers, 1.0, a.worker_gpus),
                         on_start=lambda n: bar.reset(total=n), on_cell=lambda f: bar.update(1), say=say)
    if res.workers:
        say(f"\n{res.ran} cell(s) on {len(res.workers)} worker(s) in {res.wall_s:.1f} s; {res.failed} failed, "
            f"{res.retried} resubmitted after a worker died")


@command("tune", "recommend a KV tier, coding, W and γ from the stored `bench kv` measurement, beside the seed "
         "preset",
         ("--context", dict(type=int, required=True, help="context length in tokens")),
         ("--link-gbit-s", dict(type=float, required=True, help="bandwidth of the link the KV is restored over")),
         ("--goal", dict(required=True, help="latency or memory")),
         ("--target", dict(default=None, help="the measured target (default: the embedded model)")),
         ("--target-tier", dict(default=None, help="its weight tier (default: the newest measurement's)")),
         JSON_ARG, db="DuckDB file with the KV measurements")
def cmd_tune(a: argparse.Namespace) -> int:
    from engine.service import format_tune, tune_kv

    out = tune_kv(a.db, a.target, a.target_tier, a.context, a.link_gbit_s, a.goal)
    print(json.dumps(out) if a.json else format_tune(out))
    return 0
