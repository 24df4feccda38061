"""Compare: two to four policies on the same prompts, live, one after another (each run takes the
decode slot), side by side — summary, γ timelines, where the outputs differ — and a what-if tab
that replays any policies over the stored traces. Glue only: engine/service/generation.py runs,
engine/lab/side_by_side.py shapes, engine/service/ replays, the store keeps every run."""
from __future__ import annotations

import os
import time

import pandas as pd
import streamlit as st

from engine.base.names import tiers_of
from engine.service import (
    DEFAULT_POLICY,
    POLICY_EXAMPLES,
    WORKBENCH_PROMPT,
    comparison_contexts,
    parse_policy,
    replay_rows,
)
from engine.service import side_by_side as C
from engine.service.costs.tables import MODEL_TOLERANCE, model_checks
from engine.service.generation import Request, check, run_policies, store_outcome
from store import Store
from views.charts import Chart, gamma_chart, grouped_bars
from views.common import engine_key, get_pair, get_suffix_history, settings, show_error

RESULT_KEY = "compare_result"
WHATIF_KEY = "compare_whatif"
DEFAULT_PROMPT = WORKBENCH_PROMPT
# The comparison everyone asks first: plain decoding, a fixed γ, and the cost-aware default.
DEFAULT_POLICIES = ["ar", "fixed:4", DEFAULT_POLICY]
POLICY_OPTIONS = list(dict.fromkeys(["ar"] + [f"fixed:{k}" for k in range(1, 9)] + POLICY_EXAMPLES))
PROPOSERS_KEY = "speclab_proposers"  # the loaded pair's proposers (as views/live.py keeps them)
WHATIF_DEFAULT = ["ar", "fixed:2", "fixed:4", "heuristic", "rakv"]


def _options() -> list[str]:
    """POLICY_OPTIONS and the `@proposer` forms of the last pair loaded in this session."""
    return C.policy_options(POLICY_OPTIONS, st.session_state.get(PROPOSERS_KEY))


# -- live ------------------------------------------------------------------------------------------
def inputs() -> tuple[bool, dict]:
    """The form; its widgets do not rerun the page until Compare is pressed."""
    with st.form("compare_form", border=False):
        prompts = st.text_area("Prompts (one per line)", value=DEFAULT_PROMPT, height=90, key="compare_prompts")
        policies = st.multiselect("Policies (2–4)", _options(), default=DEFAULT_POLICIES,
                                  key="compare_policies", help="Run one after another on each prompt; "
                                  "`@proposer` drafts with that proposer only, rakv chooses among all")
        c1, c2, c3, c4, c5 = st.columns(5)
        engine = settings().engine
        tiers, kv_tiers = tiers_of(engine)
        tier = c1.selectbox("Target tier", tiers, key=engine_key("compare_tier", engine))
        kv_tier = c2.selectbox("KV tier", kv_tiers, key=engine_key("compare_kv_tier", engine))
        max_new = c3.number_input("Max new tokens", min_value=1, max_value=8192, value=48, step=16,
                                  key="compare_max_new")
        temperature = c4.number_input("Temperature", min_value=0.0, max_value=5.0, value=0.0, step=0.1,
                                      key="compare_temperature", help="0 = greedy: every policy must emit the same tokens")
        seed = c5.number_input("Seed", min_value=0, max_value=2**31 - 1, value=None, step=1, key="compare_seed",
                               placeholder="random", help="One seed for every policy; empty draws one")
        chat = st.checkbox("Chat template", value=True, key="compare_chat")
        go_ = st.form_submit_button("Compare", type="primary", key="compare_run")
    return go_, dict(prompts=prompts, policies=list(policies), tier=tier, kv_tier=kv_tier,
                     max_new_tokens=int(max_new), temperature=float(temperature),
                     seed=None if seed is None else int(seed), chat=bool(chat))


def _saved_line(saved: list) -> tuple[str, str]:
    """One line for all the runs' stores: the worst level, its first message, how many."""
    for level in ("error", "warning"):
        bad = [s for s in saved if s.level == level]
        if bad:
            return level, f"{bad[0].message}" + (f" (and {len(bad) - 1} more runs)" if len(bad) > 1 else "")
    return "success", f"Stored {len(saved)} runs"


def run_compare(inp: dict) -> dict | None:
    """Checks the inputs (before loading any model), runs the comparison with a progress line,
    stores each run as it ends; the result, or None after an error (already shown, one line)."""
    s = settings()
    wait_ph, progress_ph = st.empty(), st.empty()
    on_wait = lambda busy: wait_ph.info(f"busy: {busy} is using the model, waiting…")  # noqa: E731
    saved: list = []
    try:
        specs = C.check_policies(inp["policies"])
        prompts = C.parse_prompts(inp["prompts"])
        label = C.compare_label()
        req = C.shared_seed(Request("", chat=inp["chat"], max_new_tokens=inp["max_new_tokens"],
                                    temperature=inp["temperature"], seed=inp["seed"], kv_tier=inp["kv_tier"],
                                    reuse=False, label=label))
        check(req, s.engine)  # a bad value fails before any model loads
        pair = get_pair(s, inp["tier"])
        st.session_state[PROPOSERS_KEY] = C.proposers_of(pair)
        with st.spinner("Reading cost tables and controllers (measured once when missing)…"):
            ctxs = comparison_contexts(s.db, pair, specs, prompts, req, on_wait)
        total = len(specs) * len(prompts)

        def on_run(res: C.Result) -> None:
            wait_ph.empty()
            saved.append(store_outcome(s.db, res.row, res.steps))
            progress_ph.progress(len(saved) / total, text=f"{len(saved)}/{total} runs · last: {res.policy}, "
                                                          f"{res.row['n_tokens']} tokens")

        progress_ph.progress(0.0, text=f"0/{total} runs")
        # No prefix cache: a later policy would find the earlier one's prompt and win on TTFT.
        # The suffix history as it stands now for every policy; fed the outputs after the comparison.
        results = run_policies(pair, prompts, specs, req, ctxs.get, prefix=None, on_run=on_run, on_wait=on_wait,
                               history=get_suffix_history(s))
    except Exception as e:  # noqa: BLE001 - one line in the UI, never a traceback
        wait_ph.empty()
        progress_ph.empty()
        show_error(e)
        return None
    wait_ph.empty()
    progress_ph.empty()
    tok = pair.tokenizer
    return dict(
        results=results, label=label, greedy=C.greedy(results), seed=req.seed, saved=_saved_line(saved),
        diffs=C.output_differences(results, lambda ids: tok.decode(ids, skip_special_tokens=False)),
        outputs={(r.prompt_index, r.policy): r.row["output"] for r in results},
        prompts=prompts, policies=specs, engine=pair.engine,
        setting=f"{pair.target_name} ({pair.target_tier}, KV {inp['kv_tier']}) ← {pair.draft_name} · {pair.device}",
    )


def show_difference(d: dict, greedy: bool, n_prompts: int, engine: str = "torch") -> None:
    """Greedy: the policies must agree ('identical'), else where they part (on llama.cpp, whose
    batched read rounds otherwise than its one-token read, a measured divergence). Sampling with
    one seed: where they part and how far each is from the first policy."""
    where = f"Prompt {d['prompt_index'] + 1}: " if n_prompts > 1 else ""
    if d["identical"]:
        st.success(f"{where}identical: all {len(d['policies'])} policies emitted the same "
                   f"{d['lengths'][0] if d['lengths'] else 0} tokens")
        return
    at = ", ".join(f"{p} {t!r}" if t is not None else f"{p} (ended)" for p, t in zip(d["policies"], d["token_text"]))
    line = f"{where}outputs differ first at token {d['position']}: {at}"
    if greedy and engine == "llamacpp":
        st.warning(line + " — llama.cpp scores a batched verify with other kernels than a plain step, so "
                   "speculation there can change greedy output: put `ar` first to see each policy against "
                   "llama.cpp's own decoding (`bench peers` counts it per format)")
    elif greedy:  # exact speculative decoding must not change greedy output (bitsandbytes tiers excepted)
        st.warning(line + " — under greedy decoding they should not (see docs/architecture.md, Exactness)")
    else:
        st.info(line + " (sampling: the policies draw from the seed differently)")
    st.dataframe(pd.DataFrame([dict(policy=p, **v) for p, v in zip(d["policies"], d["versus_first"])]),
                 hide_index=True, width="stretch")


def show_result(res: dict) -> None:
    rows = C.summary_rows(res["results"])
    st.subheader("Summary")
    st.dataframe(pd.DataFrame(rows, columns=C.SUMMARY_COLUMNS), hide_index=True, width="stretch",
                 column_config={"tokens_per_s": st.column_config.NumberColumn("tok/s", format="%.1f"),
                                "ttft_ms": st.column_config.NumberColumn("TTFT ms", format="%.1f"),
                                "acceptance_rate": st.column_config.NumberColumn("acceptance", format="%.2f"),
                                "mean_accepted": st.column_config.NumberColumn("mean accepted", format="%.2f"),
                                "tokens_per_step": st.column_config.NumberColumn("tokens/step", format="%.2f"),
                                "proposers": st.column_config.TextColumn(
                                    "proposer mix", help="Share of the drafting steps each proposer drafted")})
    seed = f" · seed {res['seed']}" if res["seed"] is not None else ""
    mode = "greedy" if res["greedy"] else "sampling"
    st.caption(f"{res['setting']} · {mode}{seed} · runs labelled {res['label']} in their config")
    level, message = res["saved"]
    getattr(st, level)(message)

    prompts = res["prompts"]
    pick = 0
    if len(prompts) > 1:
        pick = st.selectbox("Prompt", range(len(prompts)), format_func=lambda i: f"{i + 1}: {prompts[i][:80]}",
                            key="compare_pick")
    st.vega_lite_chart(*gamma_chart(C.gamma_series(res["results"], pick), C.proposer_series(res["results"], pick)),
                    key="compare_gamma")

    st.subheader("Outputs")
    for d in res["diffs"]:
        show_difference(d, res["greedy"], len(prompts), res.get("engine", "torch"))
    cols = st.columns(len(res["policies"]))
    for col, policy in zip(cols, res["policies"]):
        col.caption(policy)
        col.text(res["outputs"].get((pick, policy), ""), width="stretch")


@st.fragment
def live_panel() -> None:
    """Pressing Compare reruns only this panel."""
    go_, inp = inputs()
    if go_:
        st.session_state[RESULT_KEY] = None
        st.session_state[RESULT_KEY] = run_compare(inp)
    res = st.session_state.get(RESULT_KEY)
    if res:
        show_result(res)
    elif not go_:
        st.caption("Each policy runs live on each prompt, one after another; every run is stored.")


# -- what-if -----------------------------------------------------------------------------------------
def _no_traces(db: str) -> None:
    st.info(f"No acceptance traces in {db} yet. A profile sweep with “also trace the prompts” records them; "
            "replaying any policy over them then takes seconds.")
    st.page_link("views/profile.py", label="Profile: run a sweep and trace its prompts", icon=":material/timer:")


def _traces(db: str) -> pd.DataFrame | None:
    """The stored traces (empty without a database file: nothing profiled yet is not an error);
    None after an error, shown in one line."""
    if not os.path.exists(db):
        return pd.DataFrame()
    try:
        with Store(db, read_only=True, wait_s=3.0) as s:
            return s.traces()
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return None


def whatif_panel() -> None:
    db = settings().db
    traces = _traces(db)
    if traces is None:
        return
    if not len(traces):
        _no_traces(db)
        return
    tiers = sorted(set(traces["target_tier"]))
    kv_tiers = sorted(set(traces["kv_tier"].fillna("native"))) if "kv_tier" in traces else ["native"]
    st.caption(f"{len(traces)} traced prompts in {db}; tasks: {', '.join(sorted(set(traces['task'].fillna('-'))))}")
    with st.form("compare_whatif_form", border=False):
        policies = st.multiselect("Policies", _options(), default=[p for p in WHATIF_DEFAULT if p in POLICY_OPTIONS],
                                  key="compare_whatif_policies")
        c1, c2 = st.columns(2)
        chosen_tiers = c1.multiselect("Target tiers", tiers, default=tiers, key="compare_whatif_tiers")
        chosen_kv = c2.multiselect("KV tiers", kv_tiers, default=kv_tiers, key="compare_whatif_kv_tiers")
        go_ = st.form_submit_button("Replay", type="primary", key="compare_whatif_run")
    if go_:
        st.session_state[WHATIF_KEY] = None
        try:
            if not policies:
                raise ValueError("choose at least one policy to replay")
            for spec in policies:
                parse_policy(spec)
            t0 = time.perf_counter()
            with Store(db, read_only=True, wait_s=3.0) as s:
                rows = replay_rows(s, policies, chosen_tiers or None, by="task", kv_tiers=chosen_kv or None)
                checks = model_checks(s, chosen_tiers or None, chosen_kv or None)
            st.session_state[WHATIF_KEY] = dict(rows=rows, policies=policies, seconds=time.perf_counter() - t0,
                                                checks=checks)
        except Exception as e:  # noqa: BLE001
            show_error(e)
    res = st.session_state.get(WHATIF_KEY)
    if res:
        show_whatif(res)


def whatif_chart(rows: list[dict]) -> Chart:
    """Modelled tokens/s (tokens/step where no cost table prices them) per tier · task, a bar per policy."""
    df = pd.DataFrame(rows)
    df["setting"] = df["tier"] + " · " + df["task"].astype(str)
    value = "tokens_per_s" if df["tokens_per_s"].notna().any() else "tokens_per_step"
    return grouped_bars(df, "setting", "policy", value,
                        "modelled tok/s" if value == "tokens_per_s" else "tokens/step")


def show_whatif(res: dict) -> None:
    rows = res["rows"]
    prompts = max((r["prompts"] for r in rows if r["task"] == "all"), default=0)
    st.caption(f"{len(res['policies'])} policies replayed over {prompts} traced prompts per setting in "
               f"{res['seconds']:.1f} s (exact replay, modelled tokens/s from the measured cost tables)")
    st.dataframe(C.whatif_table(rows).round(2), width="stretch")
    st.vega_lite_chart(*whatif_chart(rows), key="compare_whatif_chart")
    best = C.whatif_best(rows)
    st.caption("Best: " + "; ".join(f"{tier} {task}: {p}" for (tier, task), p in best.items()))
    for label, agree in res.get("checks", []):  # the model against what the engine's own steps took
        if "why" in agree:
            st.warning(f"{label}: {agree['why']}")
        else:
            st.caption(f"{label}: the table ({agree['source']}) prices this setting's {agree['steps']} live steps at "
                       f"{1 / agree['ratio']:.2f}× what they took, within ±{MODEL_TOLERANCE:.0%}")


st.title("Compare")
st.caption("Policies side by side on the same prompts: live, one run at a time, or replayed over the stored traces.")
live_tab, whatif_tab = st.tabs(["Live", "What-if (replay)"])
with live_tab:
    live_panel()
with whatif_tab:
    whatif_panel()
