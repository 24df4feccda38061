"""Live decode: one generation streamed step by step, with the draft's signals as they happen.
Glue only: the engine decodes, the store keeps the run, this page shows both."""
from __future__ import annotations

import time
from dataclasses import asdict

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.base.names import KV_TIERS, WEIGHT_TIERS
from engine.datasets.prompts import WORKBENCH_PROMPT
from engine.decode.policies import DEFAULT_POLICY, POLICY_EXAMPLES
from engine.decode.records import PROPOSER_NAMES
from engine.lab.generation import Generation
from engine.lab.side_by_side import policy_options, proposers_of
from engine.lab.slots import decode_slot
from engine.service.runs import Request, check, keep, open_generation
from views.common import (
    Saved,
    get_pair,
    get_prefix_cache,
    get_suffix_history,
    save_run,
    settings,
    show_error,
    show_saved,
)

RESULT_KEY = "live_result"
PROPOSERS_KEY = "speclab_proposers"  # the loaded pair's proposers (engine.oracles.available), for the selectors
# Marker shapes of the proposers on the γ timeline (colours come from the figure's palette).
PROPOSER_SYMBOLS = {"draft": "circle", "eagle": "diamond", "ngram": "square", "suffix": "triangle-up"}
DEFAULT_PROMPT = WORKBENCH_PROMPT
# Redraw budget while streaming: every redraw is work for this server and for the browser, which
# share the cores with torch (on 2 cores per-step redraws cut decode speed 2.5–10×). The text
# and a status line are cheap; the figure is not, so it is drawn rarely and in full at the end.
TEXT_INTERVAL_S = 1.0
CHART_INTERVAL_S = 5.0
# While a generation streams, the browser's CSS animations and transitions (the running indicator,
# stale elements fading) are switched off: headless Chromium repainting them took a third of a core
# per generation from torch here (1.5 s against 1.0 s of its CPU per 64-token run). Removed after.
CALM_CSS = "<style>*, *::before, *::after { animation: none !important; transition: none !important; }</style>"
# Per-step columns for the table; the per-position lists stay in the store.
TABLE_COLUMNS = [
    "step", "position", "proposer", "k_chosen", "k_drafted", "accepted", "emitted", "text",
    "mean_entropy", "max_entropy", "mean_confidence", "min_confidence",
    "draft_ms", "verify_ms", "decide_ms", "context_len", "why",
]


# -- charts ----------------------------------------------------------------------------------------
class StepChart:
    """One figure, six panels, built once and grown in place step by step."""

    # (panel row, col, trace name, record field, kind)
    TRACES = [
        (1, 1, "mean H", "mean_entropy", "line"),
        (1, 1, "max H", "max_entropy", "line"),
        (1, 2, "mean conf", "mean_confidence", "line"),
        (1, 2, "min conf", "min_confidence", "line"),
        (2, 1, "drafted", "k_drafted", "bar"),
        (2, 1, "accepted", "accepted", "bar"),
        (2, 2, "chosen γ", "k_chosen", "step"),
        *((2, 2, f"γ by {p}", f"proposer:{p}", "mark") for p in PROPOSER_NAMES),
        (3, 1, "draft ms", "draft_ms", "stack"),
        (3, 1, "verify ms", "verify_ms", "stack"),
        (3, 1, "decide ms", "decide_ms", "stack"),
        (3, 2, "tok/s so far", "running_tps", "line"),
    ]

    def __init__(self) -> None:
        fig = make_subplots(
            rows=3, cols=2, vertical_spacing=0.11, horizontal_spacing=0.08,
            subplot_titles=("Draft entropy (bits)", "Draft confidence", "Accepted vs drafted", "Chosen γ",
                            "Step latency split (ms)", "Running tokens/s"),
        )
        for row, col, name, field, kind in self.TRACES:
            if kind in ("bar", "stack"):
                trace = go.Bar(name=name, x=[], y=[], offsetgroup="latency" if kind == "stack" else None)
            elif kind == "mark":  # the γ line's points, one colour per proposer that drafted them
                proposer = field.partition(":")[2]
                trace = go.Scatter(name=name, x=[], y=[], mode="markers", showlegend=False,
                                   marker=dict(size=8, symbol=PROPOSER_SYMBOLS.get(proposer, "circle")))
            else:
                shape = "hv" if kind == "step" else "linear"
                trace = go.Scatter(name=name, x=[], y=[], mode="lines+markers",
                                   line_shape=shape, marker_size=4, connectgaps=False)
            fig.add_trace(trace, row=row, col=col)
        fig.update_layout(
            height=680, margin=dict(l=10, r=10, t=40, b=10), barmode="overlay",
            legend=dict(orientation="h", y=-0.06), uirevision="live",
        )
        fig.update_yaxes(range=[0, 1.02], row=1, col=2)
        fig.update_xaxes(title_text="step", row=3)
        self.fig = fig
        self.x: list[int] = []
        self.y: list[list] = [[] for _ in self.TRACES]
        self._tokens, self._ms = 0, 0.0

    def add(self, rec: dict) -> None:
        self._tokens += rec["emitted"]
        self._ms += rec["draft_ms"] + rec["verify_ms"] + rec["decide_ms"]
        if rec["step"] == 0:  # the prefill drafts nothing (and its latency is the TTFT)
            return
        rec = dict(rec, running_tps=self._tokens / (self._ms / 1e3) if self._ms else None)
        self.x.append(rec["step"])
        for ys, (_, _, _, field, kind) in zip(self.y, self.TRACES):
            ys.append(_marked(rec, field) if kind == "mark" else rec[field])

    def figure(self) -> go.Figure:
        with self.fig.batch_update():
            for trace, ys in zip(self.fig.data, self.y):
                trace.x, trace.y = self.x, ys
        self.fig.update_layout(barmode="overlay")  # stacked within the latency group (base set below)
        for i, (_, _, _, field, kind) in enumerate(self.TRACES):
            if kind == "mark":  # a proposer in the legend only once it has drafted
                self.fig.data[i].showlegend = any(v is not None for v in self.y[i])
            if kind == "stack":  # each latency part starts where the parts before it end
                below = [t for t, (_, _, _, _, k) in zip(self.y[:i], self.TRACES[:i]) if k == "stack"]
                self.fig.data[i].base = [sum(v) for v in zip(*below)] if below else None
        return self.fig

    @classmethod
    def of(cls, steps: list[dict]) -> go.Figure:
        chart = cls()
        for rec in steps:
            chart.add(rec)
        return chart.figure()


def _marked(rec: dict, field: str) -> int | None:
    """A "proposer:<name>" mark: the step's γ where that proposer drafted it, else a gap."""
    return rec["k_chosen"] if rec.get("proposer") == field.partition(":")[2] else None


def _policies() -> list[str]:
    """The policy examples and their `@proposer` forms for the proposers of the last pair
    loaded in this session (an EAGLE head shows up once a pair that has one was loaded)."""
    return policy_options(POLICY_EXAMPLES, st.session_state.get(PROPOSERS_KEY))


def _default_policy() -> int:
    return _policies().index(DEFAULT_POLICY)


# -- inputs ----------------------------------------------------------------------------------------
def inputs() -> tuple[bool, dict]:
    """The form; widgets inside it do not rerun the page until Generate is pressed."""
    with st.form("live_form", border=False):
        prompt = st.text_area("Prompt", value=DEFAULT_PROMPT, height=110, key="live_prompt")
        c1, c2, c3 = st.columns(3)
        chosen = c1.selectbox("Policy", _policies(), index=_default_policy(), key="live_policy",
                              help="γ controller; `@proposer` drafts with that proposer only (rakv and speckv "
                                   "choose among all the pair has); a typed spec on the right overrides it")
        typed = c2.text_input("…or any policy spec", key="live_policy_spec",
                              placeholder="e.g. fixed:6, threshold:0.3, fixed:3@ngram:max=3,min=2")
        tier = c3.selectbox("Target tier", WEIGHT_TIERS, key="live_tier",
                            help="Target weight tier. fp16 needs CUDA; int8/nf4 use bitsandbytes.")
        c1, c2, c3, c4 = st.columns(4)
        max_new = c1.number_input("Max new tokens", min_value=1, max_value=8192, value=64,
                                  step=16, key="live_max_new")
        temperature = c2.number_input("Temperature", min_value=0.0, max_value=5.0, value=0.0,
                                      step=0.1, key="live_temperature", help="0 = greedy")
        top_p = c3.number_input("Top-p", min_value=0.01, max_value=1.0, value=1.0, step=0.05,
                                key="live_top_p")
        seed = c4.number_input("Seed", min_value=0, max_value=2**31 - 1, value=None, step=1,
                               key="live_seed", placeholder="random",
                               help="Sampling seed; empty draws one (it is recorded with the run)")
        c1, c2, c3, c4 = st.columns(4)
        chat = c1.checkbox("Chat template", value=True, key="live_chat")
        reuse = c2.checkbox("Reuse prefix KV", value=True, key="live_reuse",
                            help="Take the longest stored prefix of this prompt from earlier requests' KV "
                                 "(RAKV-ASD's cache); off recomputes the whole prompt")
        budget = c3.number_input("Prefix cache budget (MiB)", min_value=1, max_value=65536, value=512, step=64,
                                 key="live_prefix_budget", help="Least recently used entries leave first")
        kv_tier = c4.selectbox("KV tier", KV_TIERS, key="live_kv_tier",
                               help="How the target's KV cache stores each token: native (the model's dtype), "
                                    "fp8 (e4m3 × a power of two per token and head), int8 (× a bf16 scale)")
        go_ = st.form_submit_button("Generate", type="primary", key="live_generate")
    return go_, dict(
        prompt=prompt, chat=chat, policy=(typed or "").strip() or chosen, tier=tier,
        max_new_tokens=int(max_new), temperature=float(temperature), top_p=float(top_p),
        seed=None if seed is None else int(seed), reuse=bool(reuse), budget_mib=int(budget), kv_tier=kv_tier,
    )


# -- a generation ----------------------------------------------------------------------------------
def request_of(inp: dict) -> Request:
    """The page's form as a service request (the Live page asks no task)."""
    return Request(inp["prompt"], inp["policy"], chat=inp["chat"], max_new_tokens=inp["max_new_tokens"],
                   temperature=inp["temperature"], top_p=inp["top_p"], seed=inp["seed"], kv_tier=inp["kv_tier"],
                   reuse=inp["reuse"])


def _step_row(rec, tokenizer, why: str) -> dict:
    row = {k: v for k, v in asdict(rec).items() if k in TABLE_COLUMNS}
    row["text"] = tokenizer.decode(rec.token_ids, skip_special_tokens=False)
    row["why"] = why if rec.step else "prefill"
    return row


def generate(inp: dict, out_ph, chart_ph, status_ph) -> dict | None:
    """Run one generation, streaming into the placeholders; the result, or None after an error
    (already shown)."""
    s = settings()
    try:
        req = request_of(inp)
        check(req)  # fail fast on a bad spec, before loading any model
        pair = get_pair(s, inp["tier"])
        st.session_state[PROPOSERS_KEY] = proposers_of(pair)
        prefix = get_prefix_cache(s, inp["tier"], inp["budget_mib"])
        with st.spinner("Reading the cost table and controller (measured once when missing)…"):
            gen = open_generation(pair, req, s.db, prefix=prefix,  # speckv/rakv read their costs and controller
                                  history=get_suffix_history(s))
    except Exception as e:  # noqa: BLE001 - one line in the UI, never a traceback
        show_error(e)
        return None

    with decode_slot("a live decode", lambda busy: st.info(f"Busy: {busy} is using the model; waiting for it…")):
        return _stream(gen, pair, inp, prefix, out_ph, chart_ph, status_ph, s.db)


def _stream(gen: Generation, pair, inp: dict, prefix, out_ph, chart_ph, status_ph, db: str) -> dict | None:
    tok = pair.tokenizer
    chart = StepChart()
    steps: list[dict] = []
    ui_s, last_text, last_chart, n_charts = 0.0, 0.0, time.perf_counter(), 0
    it = iter(gen)
    try:
        for rec in it:
            t0 = time.perf_counter()
            row = _step_row(rec, tok, getattr(gen.policy, "why", ""))
            steps.append(row)
            chart.add(row)
            if t0 - last_text >= TEXT_INTERVAL_S:
                out_ph.text(tok.decode(gen.token_ids, skip_special_tokens=True), width="stretch")
                status_ph.caption(f"step {rec.step} · {rec.proposer or 'plain'} γ {rec.k_chosen} · "
                                  f"{len(gen.token_ids)} tokens · {row['why']}")
                last_text = time.perf_counter()
            if t0 - last_chart >= CHART_INTERVAL_S:
                n_charts += 1
                chart_ph.plotly_chart(chart.figure(), key=f"live_chart_{n_charts}")
                last_chart = time.perf_counter()
            ui_s += time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return None
    except BaseException:  # Stop (or leaving the page) ends the script here: keep what ran
        it.close()
        if gen.summary is not None:
            st.session_state[RESULT_KEY] = _result(gen, pair, inp, prefix, steps, ui_s, db)
        raise
    return _result(gen, pair, inp, prefix, steps, ui_s, db)


def _result(gen: Generation, pair, inp: dict, prefix, steps: list[dict], ui_s: float, db: str) -> dict:
    """The finished (or stopped) generation, stored, as the page shows it."""
    tok = pair.tokenizer
    try:
        kept = keep(gen, request_of(inp))  # the row every caller stores for a run
        saved = save_run(db, kept.row, kept.steps)
    except Exception as e:  # noqa: BLE001 - the result is still shown
        saved = Saved(None, "error", f"run not stored: {type(e).__name__}: {e}")
    return dict(
        output=tok.decode(gen.token_ids, skip_special_tokens=True),
        summary=asdict(gen.summary),
        steps=steps,
        saved=saved,
        ui_ms=ui_s * 1e3,
        prefix=prefix.stats(),
        label=(f"{pair.target_name} ({pair.target_tier}, KV {inp['kv_tier']} "
               f"{(gen.kv_bytes_per_token or 0) / 1024:.1f} KiB/token) ← {pair.draft_name} ({pair.draft_tier})"
               f" · {inp['policy']} · {pair.device} · seed {gen.seed}"),
    )


# -- the result ------------------------------------------------------------------------------------
def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def show_result(res: dict, out_ph, chart_ph) -> None:
    s = res["summary"]
    out_ph.text(res["output"], width="stretch")
    chart_ph.plotly_chart(StepChart.of(res["steps"]), key="live_chart_result")
    cols = st.columns(7)
    cols[0].metric("Tokens/s", _fmt(s["tokens_per_s"], ".1f"))
    cols[1].metric("TTFT ms", _fmt(s["ttft_ms"], ".1f"))
    cols[2].metric("Tokens/step", _fmt(s["tokens_per_step"], ".2f"))
    cols[3].metric("Mean accepted", _fmt(s["mean_accepted"], ".2f"))
    cols[4].metric("Acceptance rate", _fmt(s["acceptance_rate"], ".0%"))
    cols[5].metric("Prefix reuse", s["prefix_hit"], f"{s['reused_tokens']} tokens reused", delta_color="off")
    cols[6].metric("Stop reason", s["stop_reason"])
    st.caption(
        f"{res['label']} · {s['n_tokens']} tokens in {s['n_steps']} steps, "
        f"{s['wall_ms']:.0f} ms wall (of which {res['ui_ms']:.0f} ms streaming to the UI)"
    )
    p = res["prefix"]
    st.caption(f"Prefix cache: {p['entries']} entries, {p['bytes'] / 2**20:.1f} of {p['budget_bytes'] / 2**20:.0f} MiB; "
               f"{p['lookups']} lookups → {p['exact_hits']} exact, {p['partial_hits']} partial, {p['misses']} misses; "
               f"{p['reused_tokens']} tokens reused; {p['evictions']} evicted, {p['refused']} refused; "
               f"{p.get('spilled_entries', 0)} spilled to disk ({p.get('spill_bytes', 0) / 2**20:.1f} MiB), "
               f"{p.get('spill_hits', 0)} brought back")
    show_saved(res["saved"])
    st.dataframe(pd.DataFrame(res["steps"], columns=TABLE_COLUMNS), hide_index=True,
                 width="stretch")


@st.fragment
def live_panel() -> None:
    """Pressing Generate reruns only this panel."""
    go_, inp = inputs()
    status_ph = st.empty()
    stop_ph = st.empty()
    calm_ph = st.empty()
    if go_:
        calm_ph.html(CALM_CSS)
        stop_ph.button("Stop", key="live_stop", icon=":material/stop:",
                       help="End the generation after this step; what it made is shown and stored")
    out_box = st.container(border=True)
    out_ph = out_box.empty()
    chart_ph = st.empty()
    if go_:
        st.session_state[RESULT_KEY] = None
        st.session_state[RESULT_KEY] = generate(inp, out_ph, chart_ph, status_ph)
        status_ph.empty()
        stop_ph.empty()
        calm_ph.empty()
    res = st.session_state.get(RESULT_KEY)
    if res:
        show_result(res, out_ph, chart_ph)
    elif not go_:
        out_ph.caption("The output streams here.")


st.title("Live decode")
st.caption("One generation, step by step: the draft proposes γ tokens, the target verifies them.")
live_panel()
