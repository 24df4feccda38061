"""KV & prefetch: what the newest stored `bench kv` measurement says about holding the target's KV
cache at a tier, coding it, and restoring it over a link in windows of W; and the joint tuner's
choice beside the seed preset. Glue only: engine/service/ reads, models and tunes; this page draws."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.base.names import KV_TIERS
from engine.service import MEASURE_KV_MINUTES, kv_view, latest_kv_measurement, measure_kv
from engine.service.kv_figures import GOALS, measured_windows
from engine.service.kv_tuner import target_name
from views.common import settings, show_error

LINKS = [0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100]  # the log slider's stops, Gbit/s
BITS_COLUMNS = {"kv_tier": "KV tier", "raw_bits": "raw bits", "coded_bits": "coded bits", "zstd19_bits": "zstd-19 bits",
                "raw_ratio": "raw ×", "coded_ratio": "coded ×", "zstd19_ratio": "zstd-19 ×"}


def _fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else ("∞" if isinstance(v, float) and math.isinf(v) else format(v, spec))


# -- nothing measured yet --------------------------------------------------------------------------
def empty_state(db: str, target: str | None) -> None:
    st.info(f"No KV measurements for {target_name(target)} in {db} yet: run `python -m engine bench kv`, "
            "or measure here (the quick version).")
    if st.button(f"Measure now (about {MEASURE_KV_MINUTES[True]} minutes)", key="kv_measure", type="primary"):
        try:
            with st.spinner("Measuring the KV codec, restores and acceptance…"):
                measure_kv(db, quick=True, target=target)
        except Exception as e:  # noqa: BLE001 - one line, never a traceback
            show_error(e)
            return
        st.rerun()


# -- inputs ----------------------------------------------------------------------------------------
def inputs(m: dict) -> dict:
    predictors = list(m.get("predictors") or {}) or [m.get("best_predictor") or "—"]
    best = m.get("best_predictor")
    windows = measured_windows(m) or [512]
    acc_tiers = sorted({r.get("target_tier") for r in m.get("acceptance") or [] if r.get("target_tier")}
                       | ({m["target_tier"]} if m.get("target_tier") else set()))
    c1, c2, c3, c4 = st.columns(4)
    kv_tier = c1.selectbox("KV tier", KV_TIERS, key="kv_tier", help="How the KV is held: native, fp8 or int8")
    coded = c2.toggle("Coding", value=True, key="kv_coded", help="Entropy-code the tier against the predictor")
    predictor = c3.selectbox("Predictor", predictors, key="kv_predictor",
                             index=predictors.index(best) if best in predictors else 0)
    window = c4.selectbox("W (tokens per window)", windows, key="kv_window",
                          index=windows.index(m["window"]) if m.get("window") in windows else 0)
    c1, c2, c3, c4 = st.columns([1, 2, 1, 1])
    context = c1.number_input("Context (tokens)", min_value=1, value=int(m.get("context_tokens") or 2048), step=512,
                              key="kv_context")
    link = c2.select_slider("Link bandwidth", LINKS, value=1, key="kv_link", format_func=lambda b: f"{b:g} Gbit/s")
    goal = c3.radio("Goal", GOALS, key="kv_goal", horizontal=True)
    target_tier = c4.selectbox("Target tier (acceptance, γ)", acc_tiers or ["—"], key="kv_target_tier",
                               index=acc_tiers.index(m["target_tier"]) if m.get("target_tier") in acc_tiers else 0)
    return dict(kv_tier=kv_tier, coded=bool(coded), predictor=None if predictor == "—" else predictor,
                window=int(window), context=int(context), link_gbit_s=float(link), goal=goal,
                target_tier=None if target_tier == "—" else target_tier)


# -- charts ----------------------------------------------------------------------------------------
def restore_chart(view: dict, inp: dict, m: dict) -> go.Figure:
    rows = pd.DataFrame(view["restore"])
    fig = go.Figure()
    at_bench = f"bench: {m.get('context_tokens', '?')} tokens, W {m.get('window', '?')}"
    yours = f"model: {inp['context']} tokens, W {view['chosen']['window']}"
    for col, name, dash in [("measured_raw_s", f"raw ({at_bench})", "dot"), ("measured_coded_s", f"coded ({at_bench})", "dot"),
                            ("modelled_raw_s", f"raw ({yours})", "solid"), ("modelled_coded_s", f"coded ({yours})", "solid")]:
        if col in rows and rows[col].notna().any():
            fig.add_trace(go.Scatter(x=rows["gbit_s"], y=rows[col], name=name, mode="lines+markers", line_dash=dash))
    fig.add_vline(x=inp["link_gbit_s"], line_color="gray", annotation_text=f"{inp['link_gbit_s']:g} Gbit/s")
    be = view["breakeven"]["measured"] if view["breakeven"]["measured"] is not None else view["breakeven"]["modelled"]
    if be is not None and 0 < be < math.inf:
        fig.add_vline(x=be, line_dash="dash", line_color="firebrick", annotation_text=f"break-even {be:.3g}",
                      annotation_position="bottom right")
    fig.update_xaxes(type="log", title_text="link Gbit/s")
    fig.update_yaxes(type="log", title_text="restore s")
    fig.update_layout(height=380, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h", y=-0.25))
    return fig


def sweep_chart(rows: list[dict], x: str, title: str, extra: str | None = None) -> go.Figure:
    """Ratio to native raw of each coded tier the sweep measured (left axis) and decode MB/s (right)."""
    df = pd.DataFrame(rows)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for col in [c for c in df.columns if c.endswith("coded ×") and df[c].notna().any()]:
        fig.add_trace(go.Scatter(x=df[x], y=df[col], name=col, mode="lines+markers"), secondary_y=False)
    for col, name in [("decode_mb_s", "decode MB/s")] + ([(extra, "modelled restore s")] if extra else []):
        if col in df and df[col].notna().any():
            fig.add_trace(go.Scatter(x=df[x], y=df[col], name=name, mode="lines+markers", line_dash="dot"),
                          secondary_y=True)
    fig.update_xaxes(type="log", title_text=title)
    fig.update_yaxes(title_text="× smaller than native", secondary_y=False)
    fig.update_yaxes(title_text="MB/s · s", secondary_y=True)
    fig.update_layout(height=340, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h", y=-0.3))
    return fig


# -- the measurement -------------------------------------------------------------------------------
def show(row: dict, notes: list[str]) -> None:
    m = row["result"]
    st.caption(f"Measurement {row.get('measurement_id')} of {row.get('target')} at {row.get('target_tier')} on "
               f"{row.get('device')}, {row.get('created_at')}: {m.get('context_tokens', '?')} tokens, "
               f"W {m.get('window', '?')}, best predictor {m.get('best_predictor', '?')}")
    inp = inputs(m)
    try:
        view = kv_view(row, **inp)
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        show_error(e)
        return
    if view["missing"]:
        st.caption("Not in this measurement: " + ", ".join(view["missing"]))
    for note in notes + view["notes"]:
        st.caption(note)

    st.subheader("Size at rest")
    st.dataframe(pd.DataFrame(view["bits"]).rename(columns=BITS_COLUMNS), hide_index=True, width="stretch")
    s, ch, be = view["speeds"], view["chosen"], view["breakeven"]
    cols = st.columns(4)
    cols[0].metric("Encode MB/s", _fmt(s["encode_mb_s"]))
    cols[1].metric("Decode MB/s", _fmt(s["decode_mb_s"]))
    exact = m.get("roundtrip_exact")
    cols[2].metric("Round trip exact", "—" if exact is None else ("yes" if exact else "NO"))
    cols[3].metric(f"Break-even ({inp['kv_tier']})", f"{_fmt(be['measured'] if be['measured'] is not None else be['modelled'])} Gbit/s")

    st.subheader("Restore against raw transfer")
    how = "coded" if ch["coded"] else "raw"
    st.caption(f"{inp['kv_tier']} {how} at W {ch['window']}: {_fmt(ch['bits'])} bits/scalar; restoring "
               f"{inp['context']} tokens over {inp['link_gbit_s']:g} Gbit/s takes {_fmt(ch['restore_s'])} s "
               f"({'raw' if ch['coded'] else 'coded'}: {_fmt(ch['other_s'])} s), modelled")
    if view["restore"]:
        st.plotly_chart(restore_chart(view, inp, m), key="kv_restore_chart")
    else:
        st.caption("No restore sweep stored.")

    left, right = st.columns(2)
    with left:
        st.subheader("Ratio and throughput vs W")
        if view["by_window"]:
            st.plotly_chart(sweep_chart(view["by_window"], "window", "W (tokens)", "modelled_coded_s"), key="kv_w_chart")
        else:
            st.caption("No W sweep stored.")
    with right:
        st.subheader("… and vs context")
        if view["by_context"]:
            st.plotly_chart(sweep_chart(view["by_context"], "context", "context (tokens)"), key="kv_ctx_chart")
        else:
            st.caption("No context sweep stored.")

    st.subheader("KV tier, acceptance and best γ")
    if view["acceptance"]:
        st.dataframe(pd.DataFrame(view["acceptance"]), hide_index=True, width="stretch")
    else:
        st.caption("No acceptance measured.")

    st.subheader("Recommendation beside the seed preset")
    st.dataframe(pd.DataFrame(view["table"]), hide_index=True, width="stretch")
    st.markdown("**Where the measurement contradicts the seed**\n\n"
                + ("\n".join(f"- {c}" for c in view["contradictions"]) or "Nowhere."))


st.title("KV & prefetch")
st.caption("The target's KV cache at a tier, coded or raw, restored over a link window by window; and what to choose.")
_s = settings()
try:
    _found = latest_kv_measurement(_s.db, _s.target)
except Exception as e:  # noqa: BLE001 - one line, never a traceback
    show_error(e)
else:
    if _found is None:
        empty_state(_s.db, _s.target)
    else:
        show(*_found)
