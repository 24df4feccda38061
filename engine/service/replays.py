"""Exact replay of stored traces under any policy, and retraining the learned controller from
traces, live runs or the SpecKV import (docs/architecture.md, "Traces and replay")."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from engine.decode.acceptance import Predictor
from engine.decode.policies import PolicyContext, make_policy
from engine.lab.whatif import Replay, replay, summarize
from engine.service.costs.tables import controller_loader, stored_costs
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
NO_ACTIVE_FALLBACK = ("no version is active, and with none active `speckv` uses the newest version not held "
                      "back (store/tables.py `read_controller`), not this one")


def retrain(st: Store, source: str, protocol: str | None = None, seed: int = 42, sweep: str | None = None,
            activate: bool | None = None):
    """Fit `speckv` (MLP) and `speckv-rf` on the source's examples, test them, store both as new
    versions and return the report. `activate`: True or False makes them active or not; None (the
    default) activates them only when `report.shortfalls` is empty, so that a version that would
    make `speckv` worse than the best fixed γ or the active version is never made the default
    without being asked for (`report.activated` says what happened)."""
    from engine.training import retrain as T

    protocol = protocol or ("paper" if source == "speckv" else "prompt")
    ex, whatif_fn = _examples(st, source, sweep)
    mlp, rf, m = T.train(ex, protocol, seed)
    test = m.pop("test_rows")
    active = _active_speckv(st)
    if whatif_fn is None:  # per setting (the stratum's tier part: the weight tier, `+kv` off native)
        tiers = np.asarray([s.split("/")[0] for s in ex.stratum[test]])
        w, kind = T.predictor_scored(mlp, ex.x[test], tiers), "predictor-scored"
        if active is not None and active[1].features == ex.features:  # the same rows only if it reads them
            w["active_speckv"] = T.predictor_scored(active[1], ex.x[test], tiers)["speckv"]
            w["gain_vs_active"] = w["speckv"] / w["active_speckv"] - 1
    else:
        w, kind = whatif_fn(mlp, set(ex.group[test]), active), "exact replay"
    report = T.Report(
        source=source, protocol=protocol, **m, decision_ms_median=T.decision_ms(mlp),
        rf_decision_ms_median=T.decision_ms(rf, n=200), whatif_kind=kind,
        whatif_gain_vs_fixed4=w["gain_vs_fixed4"], whatif_gain_vs_best_fixed=w["gain_vs_best_fixed"], whatif=w,
        active_version=None if active is None else active[0], whatif_gain_vs_active=w.get("gain_vs_active"),
    )
    report.shortfalls = T.shortfalls(report)
    report.activated = not report.shortfalls if activate is None else bool(activate)
    # What it scored, not whether it was activated: that changes on the page, the metrics do not.
    metrics = {k: v for k, v in report.to_dict().items() if k != "activated"}
    meta = dict(source=source, protocol=protocol, seed=seed, metrics=metrics)
    report.version = st.add_controller("speckv", mlp.arrays, dict(mlp.meta, kind="mlp", **meta), source,
                                       activate=report.activated)
    report.rf_version = st.add_controller("speckv-rf", rf.arrays, dict(rf.meta, kind="rf", **meta), source,
                                          activate=report.activated)
    return report


def shortfall_text(shortfalls: list[str]) -> str:
    """A report's `shortfalls` as one clause ("a, b and c"); empty when there are none."""
    from engine.training.retrain import joined

    return joined(list(shortfalls)) if shortfalls else ""


def verdict(report) -> str | None:
    """What a front end says about the new version beside its report, in one line (None when it
    is not worse): why it was not activated, or that it was activated although it is worse. The
    CLI and the Replay & retrain page add how to override it."""
    if not report.shortfalls:
        return None
    why = shortfall_text(report.shortfalls)
    if report.activated:
        return f"speckv v{report.version} activated although {why}"
    fallback = f"; {NO_ACTIVE_FALLBACK}" if report.active_version is None else \
        f"; `speckv` keeps using v{report.active_version}"
    return f"speckv v{report.version} stored, not activated: {why}{fallback}"


def _active_speckv(st: Store) -> tuple[int, Predictor] | None:
    """(version, predictor) of the active `speckv`, or None when no version is active (then
    `speckv` reads the newest one not held back: there is nothing a user chose to compare with)."""
    c = st.controllers()
    if not len(c):
        return None
    rows = c[(c["name"] == "speckv") & c["active"].fillna(False).astype(bool)]
    if not len(rows):
        return None
    version = int(rows["version"].iloc[-1])
    params, meta = st.controller("speckv", version)
    return version, Predictor(meta.get("kind", "mlp"), params, meta)


def _examples(st: Store, source: str, sweep: str | None):
    """(examples, what-if function or None) for the chosen source."""
    from engine.training import retrain as T

    if source == "traces":
        traces = st.traces()
        traces = newest_traces(traces) if len(traces) else traces
        if not len(traces):
            raise ValueError(f"no traces in {st.path}: run `python -m engine trace` first")
        ids_of = lambda prompts: set(traces.loc[traces["prompt"].isin(prompts), "trace_id"])  # noqa: E731
        return (T.from_traces(traces, st.trace_positions()),
                lambda mlp, prompts, active: _replay_gain(st, mlp, ids_of(prompts), active))
    origin = "speckv" if source == "speckv" else "speclab"  # runs.source: imported or our own
    runs = st.runs(source=origin) if sweep is None else st.runs(source=origin, sweep=sweep)
    if not len(runs):
        hint = "python -m engine import-speckv PATH" if source == "speckv" else "python -m engine profile"
        raise ValueError(f"no {source} runs in {st.path}: run `{hint}` first")
    steps = st.steps()
    steps = steps[steps["run_id"].isin(set(runs["run_id"]))]
    make = T.from_speckv_steps if source == "speckv" else T.from_live_steps
    return make(steps, runs), None


def _replay_gain(st: Store, mlp: Predictor, trace_ids: set, active: tuple[int, Predictor] | None = None) -> dict:
    """Exact replay over the test prompts' traces: the new controller vs fixed:4, the best fixed γ
    per tier and (when one is active) the active version, in modelled tokens/s (summed over tiers)."""
    from engine.decode.policies.learned import SpeckvPolicy

    fixed = ["ar"] + [f"fixed:{k}" for k in range(1, 9)]
    new = lambda ctx: SpeckvPolicy(mlp, ctx.need_costs("speckv"), name="speckv (new)")  # noqa: E731
    policies = fixed + [new]
    if active is not None:
        policies.append(lambda ctx: SpeckvPolicy(active[1], ctx.need_costs("speckv"), name="speckv (active)"))
    rows = [r for r in summarize(replay_all(st, policies, trace_ids=trace_ids)) if r["task"] == "all"]
    by = {(r["tier"], r["policy"]): r["tokens_per_s"] for r in rows}  # per weight tier and KV tier
    tiers = sorted({t for t, _ in by})
    best = {t: max(fixed, key=lambda p: by[(t, p)]) for t in tiers}
    ours = sum(by[(t, "speckv (new)")] for t in tiers)
    f4 = sum(by[(t, "fixed:4")] for t in tiers)
    bf = sum(by[(t, best[t])] for t in tiers)
    out = dict(tokens_per_s=ours, fixed4_tokens_per_s=f4, best_fixed=best, best_fixed_tokens_per_s=bf,
               gain_vs_fixed4=ours / f4 - 1, gain_vs_best_fixed=ours / bf - 1)
    if active is not None:
        theirs = sum(by[(t, "speckv (active)")] for t in tiers)
        out.update(active_version=active[0], active_tokens_per_s=theirs, gain_vs_active=ours / theirs - 1)
    return out


def replay_rows(st: Store, policies: Iterable[str], tiers: list[str] | None, by: str,
                kv_tiers: list[str] | None = None) -> list[dict]:
    """`whatif`'s table: policies replayed over every stored trace, summarized per (tier, KV
    tier) and task or prompt."""
    return summarize(replay_all(st, list(policies), tiers, kv_tiers=kv_tiers), by=by)
