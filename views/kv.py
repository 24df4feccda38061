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
from engine.service.kv.actions import KV_DEFAULTS, MEASURE_KV_WHAT, seed_view
from engine.service.kv.figures import GOALS, acceptance_tiers, axis_range, measured_windows
from engine.service.kv.tuner import target_name
from views.common import settings, show_error

LINKS = [0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100]  # the log slider's stops, Gbit/s
BITS_COLUMNS = {"kv_tier": "KV tier", "raw_bits": "raw bits", "coded_bits": "coded bits", "zstd19_bits": "zstd-19 bits",
                "raw_ratio": "raw ×", "coded_ratio": "coded ×", "zstd19_ratio": "zstd-19 ×"}


def _fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else ("∞" if isinstance(v, float) and math.isinf(v) else format(v, spec))


# -- measuring -------------------------------------------------------------------------------------
def measure_offer(db: str, target: str | None) -> None:
    """The quick measurement, offered beside the controls; the spinner names what it measures."""
    c1, c2 = st.columns([3, 1])
    c1.info(f"No KV measurements for {target_name(target)} in {db} yet: the controls show the seed notes' "
            "preset until one is stored. Run `python -m engine bench kv`, or measure here (the quick version: "
            f"{MEASURE_KV_WHAT[True]}).")
    if c2.button(f"Measure now (about {MEASURE_KV_MINUTES[True]} minutes)", key="kv_measure", type="primary"):
        try:
            with st.spinner(f"Measuring {MEASURE_KV_WHAT[True]}…"):
                measure_kv(db, quick=True, target=target)
        except Exception as e:  # noqa: BLE001 - one line, never a traceback
            show_error(e)
            return
        st.rerun()


# -- inputs ----------------------------------------------------------------------------------------
def inputs(m: dict) -> dict:
    """The controls, from the measurement `m` where it has a figure and KV_DEFAULTS where it has
    none (a fresh database: `m` is empty)."""
    d = KV_DEFAULTS
    predictors = list(m.get("predictors") or {}) or list(d["predictors"])
    best = m.get("best_predictor") or predictors[0]
    windows = measured_windows(m) or list(d["windows"])
    window = m.get("window") or d["window"]
    # Only tiers with measured acceptance (a tier without any shows nothing); fp32 first when
    # there, as on every other page, not the tier the KV happened to be coded at.
    acc_tiers = acceptance_tiers(m) or [d["target_tier"]]
    c1, c2, c3, c4 = st.columns(4)
    kv_tier = c1.selectbox("KV tier", KV_TIERS, key="kv_tier", index=KV_TIERS.index(d["kv_tier"]),
                           help="How the KV is held: native, fp8 or int8")
    coded = c2.toggle("Coding", value=d["coded"], key="kv_coded", help="Entropy-code the tier against the predictor")
    predictor = c3.selectbox("Predictor", predictors, key="kv_predictor",
                             index=predictors.index(best) if best in predictors else 0)
    window = c4.selectbox("W (tokens per window)", windows, key="kv_window",
                          index=windows.index(window) if window in windows else 0)
    c1, c2, c3, c4 = st.columns([1, 2, 1, 1])
    context = c1.number_input("Context (tokens)", min_value=1, value=int(m.get("context_tokens") or d["context"]),
                              step=512, key="kv_context")
    link = c2.select_slider("Link bandwidth", LINKS, value=d["link_gbit_s"], key="kv_link",
                            format_func=lambda b: f"{b:g} Gbit/s")
    goal = c3.radio("Goal", GOALS, key="kv_goal", horizontal=True)
    target_tier = c4.selectbox("Target tier (acceptance, γ)", acc_tiers, key="kv_target_tier",
                               index=acc_tiers.index(d["target_tier"]) if d["target_tier"] in acc_tiers else 0)
    # A measurement without per-predictor figures has only its headline ones: no predictor to pick.
    return dict(kv_tier=kv_tier, coded=bool(coded), predictor=predictor if m.get("predictors") else None,
                window=int(window), context=int(context),
                link_gbit_s=float(link), goal=goal, target_tier=target_tier)


# -- charts ----------------------------------------------------------------------------------------
def labelled_vline(fig: go.Figure, x: float, text: str, top: bool, **line) -> None:
    """A vertical line at `x` on the log x axis with its label beside it. Not add_vline's
    annotation_text: plotly places a shape at the data value but an annotation on a log axis at
    10^x, so each label landed by another line (1 Gbit/s at 10, a break-even of 0.054 at 1.13)."""
    fig.add_vline(x=x, **line)
    fig.add_annotation(x=math.log10(x), xref="x", y=1 if top else 0, yref="paper", text=text, showarrow=False,
                       xanchor="left", yanchor="top" if top else "bottom", font_color=line.get("line_color"))


def restore_chart(view: dict, inp: dict, m: dict) -> go.Figure:
    rows = pd.DataFrame(view["restore"])
    fig = go.Figure()
    at_bench = f"bench: {m.get('context_tokens', '?')} tokens, W {m.get('window', '?')}"
    yours = f"model: {inp['context']} tokens, W {view['chosen']['window']}"
    for col, name, dash in [("measured_raw_s", f"raw ({at_bench})", "dot"), ("measured_coded_s", f"coded ({at_bench})", "dot"),
                            ("modelled_raw_s", f"raw ({yours})", "solid"), ("modelled_coded_s", f"coded ({yours})", "solid")]:
        if col in rows and rows[col].notna().any():
            fig.add_trace(go.Scatter(x=rows["gbit_s"], y=rows[col], name=name, mode="lines+markers", line_dash=dash))
    labelled_vline(fig, inp["link_gbit_s"], f"{inp['link_gbit_s']:g} Gbit/s", top=True, line_color="gray")
    be = view["breakeven"]["measured"] if view["breakeven"]["measured"] is not None else view["breakeven"]["modelled"]
    if be is not None and 0 < be < math.inf:
        labelled_vline(fig, be, f"break-even {be:.3g}", top=False, line_dash="dash", line_color="firebrick")
    fig.update_xaxes(type="log", title_text="link Gbit/s")
    fig.update_yaxes(type="log", title_text="restore s")
    fig.update_layout(height=380, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h", y=-0.25))
    return fig


def sweep_chart(rows: list[dict], x: str, title: str, extra: str | None = None) -> go.Figure:
    """Ratio to native raw of each coded tier the sweep measured (left axis) and decode MB/s (right).
    Both axes start at 0 (axis_range): a ratio that does not move reads as a flat line, not as a
    slope across an axis of its last digits."""
    df = pd.DataFrame(rows)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    left, right = [], []
    for col in [c for c in df.columns if c.endswith("coded ×") and df[c].notna().any()]:
        fig.add_trace(go.Scatter(x=df[x], y=df[col], name=col, mode="lines+markers"), secondary_y=False)
        left += df[col].tolist()
    for col, name in [("decode_mb_s", "decode MB/s")] + ([(extra, "modelled restore s")] if extra else []):
        if col in df and df[col].notna().any():
            fig.add_trace(go.Scatter(x=df[x], y=df[col], name=name, mode="lines+markers", line_dash="dot"),
                          secondary_y=True)
            right += df[col].tolist()
    fig.update_xaxes(type="log", title_text=title)
    fig.update_yaxes(title_text="× smaller than native", range=axis_range(_finite(left)), secondary_y=False)
    fig.update_yaxes(title_text="MB/s · s", range=axis_range(_finite(right)), secondary_y=True)
    fig.update_layout(height=340, margin=dict(l=10, r=10, t=30, b=10), legend=dict(orientation="h", y=-0.3))
    return fig


def flat_caption(flat: dict[str, float], over: str) -> None:
    """The value of a ratio that does not move, in words: a flat line says it only to a close look."""
    if flat:
        st.caption("; ".join(f"{k.replace(' coded ×', '')} coded: {v:.3g}× at every {over}" for k, v in flat.items()))


def _finite(xs: list) -> list[float]:
    return [float(v) for v in xs if v is not None and not pd.isna(v)]


# -- the measurement -------------------------------------------------------------------------------
def seed_only(inp: dict) -> None:
    """Nothing measured yet: the seed notes' preset for the inputs, what a measurement is set beside."""
    try:
        view = seed_view(inp["context"], inp["link_gbit_s"], inp["goal"])
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        show_error(e)
        return
    st.subheader("The seed preset (nothing measured yet)")
    st.dataframe(pd.DataFrame(view["table"]), hide_index=True, width="stretch")
    st.caption("A measurement puts our recommendation beside it, each choice with the figure that decided it, "
               "and says where the two disagree.")


def measurement_caption(row: dict) -> None:
    """Which measurement the page reads, and at which tiers: the KV's and the acceptance's differ."""
    m = row["result"]
    acc = ", ".join(acceptance_tiers(m)) or "none"
    st.caption(f"Measurement {row.get('measurement_id')} of {row.get('target')} on {row.get('device')}, "
               f"{row.get('created_at')}: the KV coded with the target at {row.get('target_tier')}, "
               f"{m.get('context_tokens', '?')} tokens, W {m.get('window', '?')}, best predictor "
               f"{m.get('best_predictor', '?')}; acceptance measured at: {acc}")


def show(row: dict, notes: list[str], inp: dict) -> None:
    m = row["result"]
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
            flat_caption(view["flat"]["by_window"], "W")
        else:
            st.caption("No W sweep stored.")
    with right:
        st.subheader("… and vs context")
        if view["by_context"]:
            st.plotly_chart(sweep_chart(view["by_context"], "context", "context (tokens)"), key="kv_ctx_chart")
            flat_caption(view["flat"]["by_context"], "context")
        else:
            st.caption("No context sweep stored.")

    st.subheader("KV tier, acceptance and best γ")
    if view["acceptance"]:
        st.dataframe(pd.DataFrame(view["acceptance"]), hide_index=True, width="stretch")
    if view["acceptance_note"]:
        st.caption(view["acceptance_note"])

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
    # The controls first, measured or not: a fresh database shows them with the defaults and the seed
    # preset, and offers the measurement beside them.
    if _found is not None:
        measurement_caption(_found[0])
    _inp = inputs(_found[0]["result"] if _found else {})
    if _found is None:
        measure_offer(_s.db, _s.target)
        seed_only(_inp)
    else:
        show(*_found, _inp)
