"""Replay & retrain: every policy side by side over the stored acceptance traces (exact what-if
replay with the measured cost tables); retraining the learned controller from the data the user
picks (traces, live runs, the SpecKV import), its metrics beside the active version's, and
activating it or not; the stored controllers; calibrating the cost tables against the live runs.
Glue only: the replay, training and storage live in engine/ and store/."""
from __future__ import annotations

import json
import os

import pandas as pd
import streamlit as st

from engine.service import calibrate_all, replay_rows, retrain, tier_label
from engine.service.replays import shortfall_text, verdict
from store import Store
from views.common import settings, show_error

DEFAULT_POLICIES = ["ar", "fixed:1", "fixed:2", "fixed:3", "fixed:4", "fixed:6", "heuristic", "rules", "rakv"]
LEARNED = ["speckv", "speckv-rf", "speckv-paper"]
SOURCES = {"traces": "acceptance traces (gain by exact replay of the test prompts)",
           "runs": "live runs of profile sweeps (gain scored by the predictor)",
           "speckv": "the SpecKV import (gain scored by the predictor, as the paper does)"}
# (metric in a controller's meta, row label, format): what decides whether a new version is better.
COMPARED = [("test_corr", "test correlation", "{:.3f}"),
            ("whatif_gain_vs_fixed4", "replay gain vs fixed:4", "{:+.1%}"),
            ("whatif_gain_vs_best_fixed", "replay gain vs the best fixed γ", "{:+.1%}"),
            ("decision_ms_median", "decision latency (ms, median)", "{:.3f}")]
# Measured against the version active when it was trained: shown for the new version only, since an
# older version's figure compares it with whatever was active before it.
VS_ACTIVE = ("whatif_gain_vs_active", "replay gain vs the active version (same prompts)", "{:+.1%}")
REPORT_KEY, FLASH_KEY = "retrain_report", "retrain_flash"


def _overview(db: str) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    if not os.path.exists(db):  # nothing profiled yet: not an error
        return pd.DataFrame(), pd.DataFrame()
    try:
        with Store(db, read_only=True, wait_s=3.0) as s:
            return s.traces(), s.controllers()
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        show_error(e)
        return None


def _side_by_side(rows: list[dict]) -> pd.DataFrame:
    """Policies × tiers (`fp32`, `fp32/fp8` off the native KV tier): modelled tokens/s
    (tokens/step beside it), over all traced prompts."""
    df = pd.DataFrame([r for r in rows if r["task"] == "all"])
    df["cell"] = [f"{t:.1f} tok/s · {s:.2f} tok/step" if t else f"{s:.2f} tok/step"
                  for t, s in zip(df["tokens_per_s"], df["tokens_per_step"])]
    return df.pivot(index="policy", columns="tier", values="cell")


def _metrics(meta) -> dict:
    return (json.loads(meta) if isinstance(meta, str) else (meta or {})).get("metrics", {})


def _best(rows: list[dict]) -> dict[str, str]:
    best: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["task"] == "all" and r["tokens_per_s"] and r["tokens_per_s"] > best.get(r["tier"], (0.0, ""))[0]:
            best[r["tier"]] = (r["tokens_per_s"], r["policy"])
    return {tier: pol for tier, (_, pol) in best.items()}


def _active(controllers: pd.DataFrame, name: str) -> dict | None:
    """The active version's row of controller `name`, or None."""
    if not len(controllers):
        return None
    rows = controllers[(controllers["name"] == name) & controllers["active"].fillna(False).astype(bool)]
    return rows.iloc[-1].to_dict() if len(rows) else None


def _cell(metrics: dict, key: str, fmt: str) -> str:
    v = metrics.get(key)
    return "—" if v is None else fmt.format(v)


def comparison(report: dict, active: dict | None) -> pd.DataFrame:
    """Metric rows; the new version's column beside the active one's."""
    new_col = f"new: speckv v{report['version']}"
    cols = {new_col: dict(report["metrics"], source=report["source"])}
    if active is not None and int(active["version"]) != report["version"]:
        m = _metrics(active["meta"])
        cols[f"active: speckv v{int(active['version'])}"] = dict(m, source=m.get("source", active["source"]))
    rows = [(label, {c: _cell(m, key, fmt) for c, m in cols.items()}) for key, label, fmt in COMPARED]
    key, label, fmt = VS_ACTIVE
    if report["metrics"].get(key) is not None:
        rows.append((label, {c: _cell(m, key, fmt) if c == new_col else "—" for c, m in cols.items()}))
    rows += [("trained on", {c: str(m.get("source", "—")) for c, m in cols.items()}),
             ("gain measured by", {c: str(m.get("whatif_kind", "—")) for c, m in cols.items()}),
             ("examples (train / test)",
              {c: f"{m.get('n_train', '—')} / {m.get('n_test', '—')}" for c, m in cols.items()})]
    return pd.DataFrame([v for _, v in rows], index=[k for k, _ in rows])


def _flash(level: str, message: str) -> None:
    """Shown after the rerun that redraws the controllers with the change."""
    st.session_state[FLASH_KEY] = (level, message)
    st.rerun()


def train(db: str, source: str) -> None:
    try:
        with st.spinner("Fitting the MLP and the forest, scoring them on the test prompts…"):
            with Store(db, wait_s=3.0) as s:
                r = retrain(s, source, activate=False)
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        show_error(e)
        return
    st.session_state[REPORT_KEY] = dict(db=db, source=source, version=r.version, rf_version=r.rf_version,
                                        metrics=r.to_dict(), verdict=verdict(r))
    _flash("success", f"speckv v{r.version} (and speckv-rf v{r.rf_version}) trained from {source}; not active "
                      f"yet: compare it below, then activate it or not")


def activate(db: str, report: dict) -> None:
    try:
        with Store(db, wait_s=3.0) as s:
            s.activate_controller("speckv", report["version"])  # the MLP and its forest reference together
            s.activate_controller("speckv-rf", report["rf_version"])
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return
    _flash("success", f"speckv v{report['version']} is now active (with speckv-rf v{report['rf_version']})")


def retrain_section(db: str, controllers: pd.DataFrame) -> None:
    st.subheader("Retrain")
    flash = st.session_state.pop(FLASH_KEY, None)
    if flash:
        getattr(st, flash[0])(flash[1])
    source = st.radio("Data", list(SOURCES), format_func=lambda k: f"{k}: {SOURCES[k]}", key="retrain_source")
    if st.button("Train", key="retrain", type="primary"):
        train(db, source)
    report = st.session_state.get(REPORT_KEY)
    if not report or report["db"] != db:
        return
    active = _active(controllers, "speckv")
    st.dataframe(comparison(report, active), width="stretch", key="retrain_comparison")
    if active is not None and int(active["version"]) == report["version"]:
        st.caption(f"speckv v{report['version']} is the active version.")
        return
    activate_offer(db, report, active is None)


def activate_offer(db: str, report: dict, none_active: bool) -> None:
    """A plain Activate for a version that is not worse; for one that is (its held-out gain loses to
    the best fixed γ or the active version, or its test correlation is ≤ 0) the reason beside it and
    Activate only once the user ticks that they want it anyway: it would make `speckv` worse."""
    n, why = report["version"], report["metrics"].get("shortfalls") or []
    if not why:
        if none_active:
            st.caption("No version is active yet: until one is, speckv uses the newest version not held back "
                       "(this one).")
        if st.button(f"Activate v{n}", key="retrain_activate"):
            activate(db, report)
        return
    because = shortfall_text(why)
    st.warning(report.get("verdict") or f"speckv v{n} stored, not activated: {because}")
    # Keyed by version: a tick given for one version never carries over to the next one trained.
    anyway = st.checkbox(f"Activate v{n} anyway, although {because}", key=f"retrain_confirm_v{n}")
    if anyway and st.button(f"Activate v{n} anyway", key="retrain_activate"):
        activate(db, report)


def controllers_section(controllers: pd.DataFrame) -> None:
    st.subheader("Controllers")
    if not len(controllers):
        st.caption("None stored yet.")
        return
    metrics = [_metrics(m) for m in controllers["meta"]]
    table = controllers[["name", "version", "source", "active", "created_at"]].assign(
        test_corr=[m.get("test_corr") for m in metrics], whatif_gain_vs_fixed4=[m.get("whatif_gain_vs_fixed4") for m in metrics])
    st.dataframe(table, width="stretch", hide_index=True)


def replay_section(db: str, traces: pd.DataFrame, controllers: pd.DataFrame) -> None:
    tiers = ", ".join(f"{t} ({n})" for t, n in traces.groupby("target_tier").size().items())
    st.caption(f"{len(traces)} traced prompts in {db} — by tier: {tiers}")
    options = DEFAULT_POLICIES + [f"fixed:{k}" for k in (5, 7, 8)] + LEARNED
    default = DEFAULT_POLICIES + (["speckv"] if len(controllers) else [])
    chosen = st.multiselect("Policies", options, default=default, key="replay_policies")
    if not chosen:
        return
    try:
        with Store(db, read_only=True, wait_s=3.0) as s:
            rows = replay_rows(s, chosen, None, by="task")
        st.subheader("Side by side (exact replay, measured costs)")
        st.dataframe(_side_by_side(rows), width="stretch")
        st.caption("Best per tier: " + ", ".join(f"{t}: {p}" for t, p in _best(rows).items()))
        st.session_state["replay_rows"] = rows
    except Exception as e:  # noqa: BLE001
        show_error(e)


def calibrate_section(db: str) -> None:
    st.subheader("Cost tables")
    st.caption("Live steps also pay the draft's catch-up reads and the accept loop; calibrating scales each "
               "table, per draft length, to the live runs stored for its pair and tier (profile `ar` and a few "
               "`fixed:k` first). Replay and the `speckv`/`rakv` policies then use the calibrated table.")
    if not st.button("Calibrate cost tables from the live runs", key="calibrate"):
        return
    try:
        with Store(db, wait_s=3.0) as s:
            results = calibrate_all(s)
        for (device, target, draft, tier, _, kv_tier), out in results:
            name = f"{target} + {draft} at {tier_label(tier, kv_tier or 'native')} on {device}"
            if isinstance(out, str):
                st.warning(f"{name}: {out}")
            else:
                st.success(f"{name}: live / measured step time for k = 0..8: "
                           + " ".join(f"{f:.2f}" for f in out.step_factor))
    except Exception as e:  # noqa: BLE001
        show_error(e)


st.title("Replay & retrain")
db = settings().db
overview = _overview(db)
if overview is not None:
    traces, controllers = overview
    if not len(traces):
        st.info(f"No acceptance traces in {db} yet: a profile sweep (with “also trace the prompts”) makes them, "
                "and the live runs and cost tables replay and retraining need.")
        st.page_link("views/profile.py", label="Profile a sweep first", icon=":material/timer:")
    else:
        replay_section(db, traces, controllers)
    retrain_section(db, controllers)
    controllers_section(controllers)
    calibrate_section(db)
