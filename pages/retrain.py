"""Replay & retrain: every policy side by side over the stored acceptance traces (exact what-if
replay with the measured cost tables), the stored controllers, a retrain button and one that
calibrates the cost tables against the live runs. Glue only:
the replay, training and storage live in engine/ and store/."""
from __future__ import annotations

import json
import os

import pandas as pd
import streamlit as st

from engine.service import calibrate_all, replay_rows, retrain, tier_label
from pages.common import settings, show_error
from store import Store

DEFAULT_POLICIES = ["ar", "fixed:1", "fixed:2", "fixed:3", "fixed:4", "fixed:6", "heuristic", "rules", "rakv"]
LEARNED = ["speckv", "speckv-rf", "speckv-paper"]


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


st.title("Replay & retrain")
db = settings().db
overview = _overview(db)
if overview is not None:
    traces, controllers = overview
    if not len(traces):
        st.info(f"No acceptance traces in {db} yet: run `python -m engine costs` and "
                "`python -m engine trace --prompts train` (or a profile sweep), then come back.")
    else:
        tiers = ", ".join(f"{t} ({n})" for t, n in traces.groupby("target_tier").size().items())
        st.caption(f"{len(traces)} traced prompts in {db} — by tier: {tiers}")
        options = DEFAULT_POLICIES + [f"fixed:{k}" for k in (5, 7, 8)] + LEARNED
        default = DEFAULT_POLICIES + (["speckv"] if len(controllers) else [])
        chosen = st.multiselect("Policies", options, default=default, key="replay_policies")
        if chosen:
            try:
                with Store(db, read_only=True, wait_s=3.0) as s:
                    rows = replay_rows(s, chosen, None, by="task")
                st.subheader("Side by side (exact replay, measured costs)")
                st.dataframe(_side_by_side(rows), width="stretch")
                st.caption("Best per tier: " + ", ".join(f"{t}: {p}" for t, p in _best(rows).items()))
                st.session_state["replay_rows"] = rows
            except Exception as e:  # noqa: BLE001
                show_error(e)

    st.subheader("Controllers")
    if len(controllers):
        metrics = [_metrics(m) for m in controllers["meta"]]
        table = controllers[["name", "version", "source", "active", "created_at"]].assign(
            test_corr=[m.get("test_corr") for m in metrics], whatif_gain_vs_fixed4=[m.get("whatif_gain_vs_fixed4") for m in metrics])
        st.dataframe(table, width="stretch", hide_index=True)
    else:
        st.caption("None stored yet.")
    if st.button("Retrain speckv from the traces", key="retrain", disabled=not len(traces)):
        try:
            with st.spinner("Fitting the MLP and the forest, replaying the test prompts…"):
                with Store(db, wait_s=3.0) as s:
                    r = retrain(s, "traces")
            st.success(f"speckv v{r.version} is now active: test corr {r.test_corr:.3f} (forest {r.rf_test_corr:.3f}), "
                       f"decision {r.decision_ms_median:.3f} ms, replay {r.whatif_gain_vs_fixed4:+.1%} vs fixed:4, "
                       f"{r.whatif_gain_vs_best_fixed:+.1%} vs the best fixed γ")
        except Exception as e:  # noqa: BLE001
            show_error(e)

    st.subheader("Cost tables")
    st.caption("Live steps also pay the draft's catch-up reads and the accept loop; calibrating scales each "
               "table, per draft length, to the live runs stored for its pair and tier (profile `ar` and a few "
               "`fixed:k` first). Replay and the `speckv`/`rakv` policies then use the calibrated table.")
    if st.button("Calibrate cost tables from the live runs", key="calibrate"):
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
