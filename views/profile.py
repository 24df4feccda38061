"""Profile: a sweep (tiers × KV tiers × prompts × policies, each a live run stored as it finishes)
started from the page and run in the background (engine/service/sweeps/jobs.py), optionally after tracing the
same prompts for replay and retrain. The progress shows to every session; leaving the page and
coming back finds it; Stop keeps what finished and the same name resumes. Glue only."""
from __future__ import annotations

from datetime import date

import pandas as pd
import streamlit as st

from engine.base.names import tiers_of
from engine.service import POLICY_EXAMPLES, parse_policy, prompt_set, sweep_jobs, sweep_table
from engine.service.costs.kernels import kernel_report
from engine.service.sweeps.cluster import ClusterSpec, PairSpec
from engine.service.sweeps.jobs import RUNNER, SweepSpec, SweepStatus
from store import Store
from views.common import Settings, _pair, engine_key, get_pair, settings, show_error

PROMPT_SETS = ["heldout", "bench", "train"]
# One click must work on the embedded model on a CPU: one prompt per task, short runs, fp32 only.
DEFAULT_POLICIES = ["ar", "fixed:1", "fixed:2", "fixed:4", "rakv"]
POLICY_OPTIONS = list(dict.fromkeys(DEFAULT_POLICIES + [f"fixed:{k}" for k in range(1, 9)] + POLICY_EXAMPLES))


def inputs() -> tuple[bool, dict]:
    """The form; its widgets do not rerun the page until Start is pressed."""
    with st.form("profile_form", border=False):
        c1, c2, c3 = st.columns([2, 1, 1])
        name = c1.text_input("Sweep name", value=f"ui-{date.today():%Y-%m-%d}", key="profile_name",
                             help="Runs are stored under this name; starting the same name again resumes it")
        which = c2.selectbox("Prompt set", PROMPT_SETS, key="profile_prompts",
                             help="heldout: the held-out prompts; bench: the benchmark's; train: training prompts")
        per_task = c3.number_input("Prompts per task", min_value=1, max_value=100, value=1, key="profile_per_task")
        c1, c2 = st.columns(2)
        engine = settings().engine
        weight_tiers, kv_choices = tiers_of(engine)
        tiers = c1.multiselect("Tiers", weight_tiers, default=weight_tiers[:1], key=engine_key("profile_tiers", engine),
                               help="GGUF weight formats (q4_1 as shipped; the others converted once and cached)"
                               if engine == "llamacpp" else "Target weight tiers; fp16 needs CUDA, int8/nf4 bitsandbytes")
        kv_tiers = c2.multiselect("KV tiers", kv_choices, default=kv_choices[:1],
                                  key=engine_key("profile_kv_tiers", engine))
        policies = st.multiselect("Policies", POLICY_OPTIONS, default=DEFAULT_POLICIES, key="profile_policies")
        c1, c2 = st.columns(2)
        max_new = c1.number_input("Max new tokens", min_value=2, max_value=8192, value=32, step=16,
                                  key="profile_max_new")
        trace = c2.checkbox("also trace the prompts (for replay and retrain)", value=True, key="profile_trace")
        c1, c2 = st.columns(2)
        ray = c1.checkbox("run on a cluster (Ray)", value=False, key="profile_ray",
                          help="One worker per GPU (per CPU here) loads the pair once; this process stores every "
                          "run. Traces, when asked, are made here first. docs/scale.md")
        address = c2.text_input("Cluster address", value="", key="profile_ray_address",
                                placeholder="empty: a local cluster of 2 CPUs", help="host:port, ray://host:port or auto")
        start = st.form_submit_button("Start", type="primary", key="profile_start")
    return start, dict(name=name.strip(), which=which, per_task=int(per_task), tiers=tiers, kv_tiers=kv_tiers,
                       policies=policies, max_new_tokens=int(max_new), trace=bool(trace), ray=bool(ray),
                       ray_address=address.strip())


def spec_of(inp: dict, s: Settings | None = None) -> SweepSpec:
    """The sweep the form describes (on a cluster, with the sidebar's pair for its workers);
    one-line ValueErrors for what it lacks."""
    for what in ("tiers", "kv_tiers", "policies"):
        if not inp[what]:
            raise ValueError(f"choose at least one of the {what.replace('_', ' ').replace('kv', 'KV')}")
    for spec in inp["policies"]:
        parse_policy(spec)
    jobs = sweep_jobs(prompt_set(inp["which"], inp["per_task"]), inp["tiers"], inp["policies"], inp["kv_tiers"])
    if not inp.get("ray"):
        return SweepSpec(inp["name"], tuple(jobs), inp["max_new_tokens"], inp["trace"])
    cluster = ClusterSpec(inp["ray_address"] or None)
    pair = PairSpec(s.target, s.draft, engine=s.engine) if s else PairSpec()
    return SweepSpec(inp["name"], tuple(jobs), inp["max_new_tokens"], inp["trace"], cluster, pair)


def loader(s: Settings):
    """The sweep's loader: the pages' cached pairs (shared with Live decode, so the models load
    once); without st.spinner, which a background thread cannot draw."""
    return lambda tier: _pair(s.target, s.draft, tier, s.engine)


def start(inp: dict) -> None:
    s = settings()
    try:
        RUNNER.check_free()  # before loading anything
        spec = spec_of(inp, s)
        if spec.cluster is None or spec.trace:  # traces are made here; on a cluster, the workers load the pair
            get_pair(s, spec.jobs[0].tier)  # a bad model or tier fails here, on the page, in one line
        RUNNER.start(spec, s.db, loader(s))
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        show_error(e)


@st.fragment(run_every=1.0)
def progress() -> None:
    """Redraws once a second while the sweep runs; once it ends, the whole page reruns (and
    this fragment, with its timer, is no longer drawn)."""
    status = RUNNER.status()
    if status is None or not status.running:
        st.rerun()
    st.progress(status.done / status.total if status.total else 0.0, text=status.line())
    if st.button("Stop", key="profile_stop", disabled=status.stop_requested,
                 help="The run in progress finishes and is stored; the same name resumes the rest"):
        RUNNER.stop()
        st.caption("Stopping after the run in progress…")


def table_of(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """(one row per setting and policy: tokens/s and × the peer, captions per setting)."""
    rows, notes = [], []
    for setting, t in sweep_table(runs).items():
        notes.append(f"{setting}: {t['prompts']} prompts · best fixed γ = {t['best_gamma']} · "
                     f"vs_peer = tokens/s over the peer max(ar, best fixed) = {t['peer']:.2f} tok/s ({t['peer_policy']})")
        for pol, v in sorted(t["tokens_per_s"].items(), key=lambda kv: -kv[1]):
            # Every policy against the same peer (the peer itself 1.0): a blank cell read as "not measured".
            rows.append(dict(setting=setting, policy=pol, tokens_per_s=round(v, 2),
                             vs_peer=round(v / t["peer"], 3) if t["peer"] else None))
    return pd.DataFrame(rows), notes


def result(status: SweepStatus) -> None:
    """The ended sweep: what happened, then its table from the store."""
    before = status.done - status.ran  # stored by an earlier try of the same name
    head = f"Sweep {status.name}: {status.done}/{status.total} done" + (f" ({before} stored before)" if before else "")
    if status.state == "failed":
        st.error(f"Sweep {status.name} failed after {status.done}/{status.total}: {status.error}")
    elif status.state == "stopped":
        st.info(head + f" — stopped; start {status.name} again to resume")
    else:
        st.success(head)
    try:
        with Store(status.db, read_only=True, wait_s=3.0) as s:
            runs = s.runs(sweep=status.name)
    except Exception as e:  # noqa: BLE001
        show_error(e)
        return
    if not len(runs):
        return
    df, notes = table_of(runs)
    st.dataframe(df, hide_index=True, width="stretch", key="profile_table")
    for note in notes:
        st.caption(note)


st.title("Profile")
st.caption("A sweep runs every policy on every prompt, live, and stores each run as it finishes; the Replay & "
           "retrain page learns from its traces and runs. It runs in the background: other pages stay usable, "
           "and a live decode waits at most one run.")
top = st.container()
pressed, inp = inputs()
if pressed:
    start(inp)
with st.expander("This machine's verify kernels"):
    st.caption("On a CPU the target reads through row-invariant kernels built for this machine (exact at every "
               "tier: a verify row rounds as a plain step); here each one's time per weight shape and row count "
               "against torch's own linear. Cost tables and runs name the kernel set (`python -m engine kernels`).")
    if st.toggle("Show them (loads the fp32 pair)", key="profile_kernels"):
        try:
            rep = kernel_report(get_pair(settings(), "fp32"))
        except Exception as e:  # noqa: BLE001 - one line on the page
            show_error(e)
        else:
            if rep["rows"]:
                st.caption(f"{rep['cpu']}, {rep['threads']} threads, torch {rep['torch']}: kernel set {rep['kernel_set']}"
                           + (f". {rep['note']}" if rep["note"] else ""))
                st.dataframe(pd.DataFrame(rep["rows"]), hide_index=True)
            else:
                st.info(rep["note"])
with top:
    now = RUNNER.status()
    if now is not None and now.running:
        progress()
    elif now is not None:
        result(now)
