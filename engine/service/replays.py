"""Exact replay of stored traces under any policy, and retraining the learned controller from
traces, live runs or the SpecKV import (docs/architecture.md, "Traces and replay")."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from engine.decode.acceptance import Predictor
from engine.decode.policies import PolicyContext, make_policy
from engine.lab.whatif import Replay, replay, summarize
from engine.service.cost_tables import controller_loader, stored_costs
from store import Store


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


def replay_rows(st: Store, policies: Iterable[str], tiers: list[str] | None, by: str,
                kv_tiers: list[str] | None = None) -> list[dict]:
    """`whatif`'s table: policies replayed over every stored trace, summarized per (tier, KV
    tier) and task or prompt."""
    return summarize(replay_all(st, list(policies), tiers, kv_tiers=kv_tiers), by=by)
