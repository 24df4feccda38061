"""Live decode: one generation streamed step by step, with the draft's signals as they happen.
Glue only: the engine decodes on a thread of its own (engine/service/session.py), the store keeps
the run, this page polls the run and draws it; Stop is heard between two steps."""
from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from engine.base.names import tiers_of
from engine.service import DEFAULT_POLICY, POLICY_EXAMPLES, WORKBENCH_PROMPT, side_by_side
from engine.service.costs.jobs import MEASURER
from engine.service.generation import Request, check
from engine.service.session import LiveRun, LiveSnapshot, start_live
from views.charts import accepted_rows, step_chart, tree_dot
from views.common import engine_key, get_pair, get_prefix_cache, get_suffix_history, settings, show_error

RUN_KEY = "live_run"  # the session's LiveRun (running or the last one)
INPUT_KEY = "live_run_inputs"  # the form's values that run was started with
PROPOSERS_KEY = "speclab_proposers"  # the loaded pair's proposers (engine.oracles.available), for the selectors
DEFAULT_PROMPT = WORKBENCH_PROMPT
# Redraw budget while streaming: every redraw is work for this server and for the browser, which
# share the cores with torch (on 2 cores per-step redraws cut decode speed 2.5–10×). The page polls
# the run once a second (text and a status line are cheap); the figure is not, so it is redrawn
# rarely and in full at the end.
TEXT_INTERVAL_S = 1.0
CHART_INTERVAL_S = 5.0
POLL_S = 0.1  # how often the page looks at the run between draws
# Stop reasons as the metric tile shows them (a tile cuts a long value: "max_…").
STOP_LABELS = {"max_new_tokens": "max tokens", "eos": "EOS", "stopped": "stopped", "context": "context full"}
MAX_NEW = 8192  # the form's largest request (the engine's own bound is the model's context)
# Per-step columns for the table; the per-position lists stay in the store.
TABLE_COLUMNS = [
    "step", "position", "proposer", "k_chosen", "k_drafted", "accepted", "emitted", "text",
    "mean_entropy", "max_entropy", "mean_confidence", "min_confidence",
    "draft_ms", "verify_ms", "decide_ms", "context_len", "why",
]


def _policies() -> list[str]:
    """The policy examples and their `@proposer` forms for the proposers of the last pair
    loaded in this session (an EAGLE head shows up once a pair that has one was loaded)."""
    return side_by_side.policy_options(POLICY_EXAMPLES, st.session_state.get(PROPOSERS_KEY))


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
        engine = settings().engine
        tiers, kv_tiers = tiers_of(engine)
        llama = engine == "llamacpp"
        tier = c3.selectbox("Target tier", tiers, key=engine_key("live_tier", engine),
                            help="GGUF format on llama.cpp (q4_1 as shipped; others converted once)" if llama else
                            "Target weight tier. fp16 needs CUDA; int8/nf4 use bitsandbytes.")
        c1, c2, c3, c4 = st.columns(4)
        # No min/max on the widget: out of range it only turns red; the request says why instead.
        max_new = c1.number_input("Max new tokens", value=64, step=16, key="live_max_new")
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
        kv_tier = c4.selectbox("KV tier", kv_tiers, key=engine_key("live_kv_tier", engine),
                               help="llama.cpp's cache type: native (f16), q8_0, q4_0" if llama else
                               "How the target's KV cache stores each token: native (the model's dtype), "
                               "fp8 (e4m3 × a power of two per token and head), int8 (× a bf16 scale)")
        go_ = st.form_submit_button("Generate", type="primary", key="live_generate")
    return go_, dict(
        prompt=prompt, chat=chat, policy=(typed or "").strip() or chosen, typed=bool((typed or "").strip()),
        tier=tier, max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p),
        seed=None if seed is None else int(seed), reuse=bool(reuse), budget_mib=int(budget), kv_tier=kv_tier,
    )


# -- a generation ----------------------------------------------------------------------------------
def request_of(inp: dict) -> Request:
    """The page's form as a service request (the Live page asks no task)."""
    n = inp["max_new_tokens"]
    if n is None or n != int(n) or not 1 <= n <= MAX_NEW:
        raise ValueError(f"max new tokens must be a whole number from 1 to {MAX_NEW}, got {n}")
    return Request(inp["prompt"], inp["policy"], chat=inp["chat"], max_new_tokens=int(n),
                   temperature=inp["temperature"], top_p=inp["top_p"], seed=inp["seed"], kv_tier=inp["kv_tier"],
                   reuse=inp["reuse"])


def start(inp: dict) -> None:
    """Starts a run on its own thread (see engine/service/session.py), or shows why not."""
    s = settings()
    try:
        req = request_of(inp)
        check(req, s.engine)  # fail fast on a bad spec, before loading any model
        pair = get_pair(s, inp["tier"])
        st.session_state[PROPOSERS_KEY] = side_by_side.proposers_of(pair)
        prefix = get_prefix_cache(s, inp["tier"], inp["budget_mib"])
        run = start_live(pair, req, s.db, prefix, get_suffix_history(s))
    except Exception as e:  # noqa: BLE001 - one line in the UI, never a traceback
        show_error(e)
        return
    st.session_state[RUN_KEY], st.session_state[INPUT_KEY] = run, inp


def _label(run: LiveRun, snap: LiveSnapshot) -> str:
    pair, inp = run.pair, st.session_state[INPUT_KEY]
    kv = f"KV {inp['kv_tier']}" + (f" {snap.kv_bytes_per_token / 1024:.1f} KiB/token" if snap.kv_bytes_per_token else "")
    sampling = "greedy" if inp["temperature"] == 0 else f"T {inp['temperature']:g}, seed {snap.seed}"
    return (f"{pair.target_name} ({pair.target_tier}, {kv}) ← {pair.draft_name} ({pair.draft_tier}) · "
            f"{inp['policy']} · {pair.device} · {sampling}")


def follow(run: LiveRun) -> LiveSnapshot:
    """Draws the run while it goes, from this script run: Stop, a status line and the text once a
    second, the figure and the step table every CHART_INTERVAL_S (not in a run's first seconds: a
    short run ends before, and drawing a six-panel figure in the browser while it decoded cost it a
    quarter of its speed; nor while other sessions' decodes take turns with this one). While
    others' decodes take turns with it, both are drawn empty at once, so that the browser loads
    their code during the turns it waits rather than as the result arrives (with several sessions,
    right before their next click); alone, that drawing would take CPU from the decode. Returns the ended run's
    snapshot. Stop is a widget of the page, not of a fragment: its press asks for a rerun that
    preempts this loop at its next draw (a fragment's own button would wait for the fragment's run
    to end), and its callback, run first in the new script run, sets the decode's stop event.
    Polling from a fragment every second instead cost the decode a third of its speed beside
    another job (a fragment rerun is a script run for the browser and the server)."""
    st.button("Stop", key="live_stop", icon=":material/stop:", on_click=run.stop,
              help="End the generation after this step; what it made is shown and stored")
    status_ph, text_ph, chart_ph, table_ph = st.empty(), st.container(border=True).empty(), st.empty(), st.empty()
    drawn, last_text, last_chart, primed = 0, 0.0, time.monotonic(), False
    while not (snap := run.snapshot()).done:
        now = time.monotonic()
        if not primed and run.shared():
            chart_ph.vega_lite_chart(*step_chart([]), key="live_chart_0")
            table_ph.dataframe(step_table([], run.pair.tokenizer), hide_index=True, width="stretch")
            primed = True
        if now - last_text >= TEXT_INTERVAL_S:
            status_ph.caption(_status(run, snap))
            text_ph.text(run.pair.tokenizer.decode(snap.token_ids, skip_special_tokens=True) or "…", width="stretch")
            last_text = now
        # Not while the model is shared: every session's runs would redraw their figures at once,
        # and the pages others open would wait behind those draws (the figure comes at the end).
        if (len(snap.steps) > drawn and now - snap.started_at >= CHART_INTERVAL_S
                and now - last_chart >= CHART_INTERVAL_S and not run.shared()):
            drawn, last_chart = len(snap.steps), now
            chart_ph.vega_lite_chart(*step_chart(snap.steps), key=f"live_chart_{drawn}")
            table_ph.dataframe(step_table(snap.steps, run.pair.tokenizer), hide_index=True, width="stretch")
        time.sleep(POLL_S)
    return snap


def _status(run: LiveRun, snap: LiveSnapshot) -> str:
    inp = st.session_state[INPUT_KEY]
    policy = inp["policy"] + (" (typed: the Policy box is ignored)" if inp["typed"] else "")
    if snap.state == "waiting":
        return f"{policy} · waiting for {snap.waiting_for or 'the model'}…"
    if not snap.steps:
        return f"{policy} · reading the prompt ({snap.costs or 'no costs needed'})"
    last = snap.steps[-1]
    return (f"{policy} · step {last['step']} · {last['proposer'] or 'plain'} γ {last['k_chosen']} · "
            f"{len(snap.token_ids)} tokens · {last['why']}" + (f" · {snap.costs}" if snap.costs else ""))


# -- the result ------------------------------------------------------------------------------------
def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def show_result(run: LiveRun, snap: LiveSnapshot) -> None:
    if snap.state == "failed":
        show_error(ValueError(snap.error))
        return
    s = snap.summary
    tok = run.pair.tokenizer
    st.container(border=True).text(tok.decode(snap.token_ids, skip_special_tokens=True), width="stretch")
    st.vega_lite_chart(*step_chart(snap.steps), key="live_chart_result")
    cols = st.columns(7)
    cols[0].metric("Tokens/s", _fmt(s["tokens_per_s"], ".1f"))
    cols[1].metric("TTFT ms", _fmt(s["ttft_ms"], ".1f"))
    cols[2].metric("Tokens/step", _fmt(s["tokens_per_step"], ".2f"))
    cols[3].metric("Mean accepted", _fmt(s["mean_accepted"], ".2f"))
    cols[4].metric("Acceptance rate", _fmt(s["acceptance_rate"], ".0%"))
    cols[5].metric("Prefix reuse", s["prefix_hit"], f"{s['reused_tokens']} tokens reused", delta_color="off")
    cols[6].metric("Stop reason", STOP_LABELS.get(s["stop_reason"], s["stop_reason"]))
    st.caption(f"{_label(run, snap)} · {s['n_tokens']} tokens in {s['n_steps']} steps, {s['wall_ms']:.0f} ms wall"
               + (f" (its own; {snap.turns_ms / 1e3:.1f} s more while other sessions' decodes took their turns)"
                  if snap.turns_ms >= 100 else "")
               + (f" · costs: {snap.costs}" if snap.costs else ""))
    p = run.prefix.stats() if run.prefix is not None else None
    if p:
        st.caption(f"Prefix cache: {p['entries']} entries, {p['bytes'] / 2**20:.1f} of {p['budget_bytes'] / 2**20:.0f} "
                   f"MiB; {p['lookups']} lookups → {p['exact_hits']} exact, {p['partial_hits']} partial, "
                   f"{p['misses']} misses; {p['reused_tokens']} tokens reused; {p['evictions']} evicted, "
                   f"{p['refused']} refused; {p.get('spilled_entries', 0)} spilled to disk "
                   f"({p.get('spill_bytes', 0) / 2**20:.1f} MiB), {p.get('spill_hits', 0)} brought back")
    getattr(st, snap.stored.level)(snap.stored.message)
    tree_panel(snap, tok)
    st.dataframe(step_table(snap.steps, tok), hide_index=True, width="stretch")


def tree_panel(snap: LiveSnapshot, tok) -> None:
    """A tree policy's steps, one at a time: what the draft grew, the path the target accepted,
    the token the target added, and what the step cost."""
    trees = [r for r in snap.steps if r.get("tree_parents")]
    if not trees:
        return
    st.subheader("Token trees")
    numbers = [r["step"] for r in trees]
    pick = st.select_slider("Step", numbers, value=numbers[0], key="live_tree_step") if len(numbers) > 1 else numbers[0]
    r = next(r for r in trees if r["step"] == pick)
    before = snap.token_ids[: r["position"]]
    root = tok.decode(before[-1:], skip_special_tokens=False)
    texts = [tok.decode([t], skip_special_tokens=False) for t in r["draft_ids"]]
    path = accepted_rows(r["tree_parents"], r["draft_ids"], r["token_ids"][: r["accepted"]])
    bonus = r["token_ids"][len(path)] if len(r["token_ids"]) > len(path) else None
    st.graphviz_chart(tree_dot(root, texts, r["tree_parents"], path,
                               None if bonus is None else tok.decode([bonus], skip_special_tokens=False)))
    st.caption(f"Step {r['step']}: {r['k_drafted']} nodes drafted ({r['draft_ms']:.1f} ms), {r['accepted']} "
               f"accepted, {r['emitted']} emitted by one verify ({r['verify_ms']:.1f} ms) · {r.get('why', '')}")


def step_table(steps: list[dict], tok) -> pd.DataFrame:
    """The steps as the table shows them: TABLE_COLUMNS, each step's tokens as text."""
    rows = [dict({k: v for k, v in r.items() if k in TABLE_COLUMNS},
                 text=tok.decode(r["token_ids"], skip_special_tokens=False)) for r in steps]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


@st.fragment(run_every=5.0)
def cost_measurement() -> None:
    """The background cost measurement a run started (a fresh database's first rakv run), polled
    while it runs (only then is this fragment drawn; seldom: each poll is work the measurement
    shares the cores with)."""
    status = MEASURER.status()
    if status is None:
        return
    if status.running:
        eta = f", about {status.eta_s:.0f} s left" if status.eta_s is not None else ""
        st.progress(status.done / status.total, text=f"Measuring the cost table for {status.label} in the "
                    f"background ({status.done} of {status.total} contexts{eta}); until then runs read probed "
                    "costs, and a Generate waits for one context at most")
    else:
        _measured(status)


def _measured(status) -> None:
    if status.state == "failed":
        st.warning(f"The cost table was not measured: {status.message}")
    else:
        st.caption(status.message)


def live_panel() -> None:
    go_, inp = inputs()
    if go_:
        start(inp)
    status = MEASURER.status()
    if status is not None and status.running:
        cost_measurement()
    elif status is not None:
        _measured(status)
    run: LiveRun | None = st.session_state.get(RUN_KEY)
    if run is None:
        st.caption("The output streams here.")
        return
    snap = run.snapshot()
    if not snap.done:
        snap = follow(run)
        st.rerun()  # the result replaces the streaming panels (and Stop)
    show_result(run, snap)


st.title("Live decode")
st.caption("One generation, step by step: the draft proposes γ tokens, the target verifies them.")
live_panel()
