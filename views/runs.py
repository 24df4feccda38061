"""Runs: every stored run and its steps, filtered (model pair, tier, policy, task, date): the runs
with downloads as CSV or Parquet, and in tabs of their own acceptance against the draft's entropy
and confidence, the best fixed γ by tier × task, and tokens/s by policy. Glue only:
views/runs_data.py shapes the DataFrames the store returns; the file is opened read-only,
so a running sweep keeps writing."""
from __future__ import annotations

import os
from datetime import date

import pandas as pd
import streamlit as st

from store import Store, file_stamp
from views import runs_data as V
from views.charts import SIGNALS, acceptance_chart, best_gamma_chart, grouped_bars
from views.common import settings, show_error

# Past this many steps the steps' CSV is made when its button is clicked (it takes seconds).
EAGER_STEPS = 20_000
# The runs table's columns (the rest, lists and config, are in the downloads).
RUN_COLUMNS = ["created_at", "policy", "target_tier", "kv_tier", "task", "prompt", "n_tokens", "tokens_per_s",
               "ttft_ms", "acceptance_rate", "tokens_per_step", "stop_reason", "sweep", "source", "run_id"]


def _empty(what: str) -> None:
    st.info(f"{what}: a live decode or a profile sweep stores its runs here.")
    c1, c2 = st.columns(2)
    c1.page_link("views/live.py", label="Live decode: one run", icon=":material/bolt:")
    c2.page_link("views/profile.py", label="Profile: a sweep of runs", icon=":material/timer:")


@st.cache_data(max_entries=4, show_spinner=False)
def _read(db: str, stamp: tuple) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The store's runs and steps as of `stamp` (store.file_stamp): read once per commit, however
    many sessions open the page meanwhile (under load each read shares the cores with decodes)."""
    with Store(db, read_only=True, wait_s=3.0) as s:
        return s.runs(), s.steps()


def load(db: str) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(runs, steps); None when there is no file yet (not an error) or after an error (shown)."""
    if not os.path.exists(db):
        _empty(f"No database at {db} yet")
        return None
    try:
        return _read(db, file_stamp(db))
    except Exception as e:  # noqa: BLE001 - one line, never a traceback; the file is left as it is
        show_error(e)
        return None


def filters(runs: pd.DataFrame) -> V.Filters:
    opts = V.options(runs)
    c1, c2, c3, c4 = st.columns(4)
    pairs = c1.multiselect("Model pair", opts["pairs"], key="runs_pairs", placeholder="all")
    tiers = c2.multiselect("Tier", opts["tiers"], key="runs_tiers", placeholder="all")
    policies = c3.multiselect("Policy", opts["policies"], key="runs_policies", placeholder="all")
    tasks = c4.multiselect("Task", opts["tasks"], key="runs_tasks", placeholder="all")
    first, last = opts["dates"]
    days = st.date_input("Dates", value=(first, last), min_value=first, max_value=max(last, date.today()),
                         key="runs_dates")
    days = tuple(days) if isinstance(days, (tuple, list)) else (days,)
    since = days[0] if days else None
    until = days[1] if len(days) > 1 else since  # while picking a range only its start is set
    return V.Filters(tuple(pairs), tuple(tiers), tuple(policies), tuple(tasks), since, until)


@st.cache_data(max_entries=8, show_spinner=False)
def _encoded(db: str, stamp: tuple, chosen: tuple, encode: str, which: str) -> bytes:
    """One download's bytes for the runs `chosen` (their ids) as of `stamp`: encoded once per
    commit and selection, whichever session asks."""
    runs, steps = _read(db, stamp)
    runs = runs[runs["run_id"].isin(chosen)]
    table = runs if which == "runs" else V.steps_of(steps, runs)
    return V.to_csv_bytes(table) if encode == "csv" else V.to_parquet_bytes(table)


def downloads(db: str, runs: pd.DataFrame, steps: pd.DataFrame) -> None:
    """The four files, their bytes on the page. Not made on click (a callable's file): Streamlit
    drops a file made on click once two other script runs end, and with several sessions at work
    that is often before the browser has fetched it (the download is cancelled). The bytes are
    cached per commit and selection; only the steps as CSV of a large selection (seconds to
    encode) wait for the click."""
    stamp, chosen = file_stamp(db), tuple(runs["run_id"])
    c1, c2, c3, c4 = st.columns(4)
    files = [(c1, "Runs (CSV)", "csv", "runs", "runs.csv", "text/csv", "runs_dl_runs_csv"),
             (c2, "Runs (Parquet)", "parquet", "runs", "runs.parquet", "application/octet-stream",
              "runs_dl_runs_parquet"),
             (c3, "Steps (CSV)", "csv", "steps", "steps.csv", "text/csv", "runs_dl_steps_csv"),
             (c4, "Steps (Parquet)", "parquet", "steps", "steps.parquet", "application/octet-stream",
              "runs_dl_steps_parquet")]
    for col, label, encode, which, name, mime, key in files:
        if which == "steps" and encode == "csv" and len(steps) > EAGER_STEPS:
            data = (lambda: V.to_csv_bytes(steps))
        else:
            data = _encoded(db, stamp, chosen, encode, which)
        col.download_button(label, data, name, mime, key=key, on_click="ignore")


# The page's views, one tab each; only the open tab's content is computed and drawn (a tab's
# `.open`), so opening the page costs the filters and the table, not three figures in every browser.
TABS = ["Runs", "Acceptance", "Best γ", "Tokens/s by policy"]


def table(db: str, chosen: pd.DataFrame, picked: pd.DataFrame) -> None:
    st.dataframe(chosen[[c for c in RUN_COLUMNS if c in chosen.columns]], hide_index=True, width="stretch")
    downloads(db, chosen, picked)


def acceptance(picked: pd.DataFrame) -> None:
    points = V.acceptance_points(picked)
    if not len(points):
        st.caption("No drafting steps in the selection (ar runs draft nothing).")
        return
    bins = {signal: V.acceptance_bins(points, signal) for signal in SIGNALS}
    st.vega_lite_chart(*acceptance_chart(points, bins), key="runs_acceptance")
    n = int((picked["k_drafted"] > 0).sum())
    st.caption(f"Acceptance against the draft's signals: {len(points)} of {n} drafting steps"
               + (" (a sample)" if len(points) < n else ""))


def best_gamma(chosen: pd.DataFrame) -> None:
    best = V.best_gamma(chosen)
    if not len(best):
        st.caption("No ar or fixed:k runs in the selection: a profile sweep over them finds the best γ.")
        return
    st.vega_lite_chart(*best_gamma_chart(best), key="runs_best_gamma")
    st.dataframe(best, hide_index=True, width="stretch")


def speed(chosen: pd.DataFrame) -> None:
    speeds = V.speed_by_policy(chosen)
    st.vega_lite_chart(*grouped_bars(speeds, "policy", "tier", "tokens_per_s", "tokens/s (all tokens / all wall time)",
                                 more=("runs",)), key="runs_speed")
    st.dataframe(speeds, hide_index=True, width="stretch")


def show(db: str, runs: pd.DataFrame, steps: pd.DataFrame) -> None:
    if not len(runs):
        _empty("No runs stored yet")
        return
    chosen = V.filter_runs(runs, filters(runs))
    picked = V.steps_of(steps, chosen)
    st.caption(f"{len(chosen)} of {len(runs)} runs, {len(picked)} steps")
    if not len(chosen):
        st.info("No run matches these filters.")
        return
    views = [lambda: table(db, chosen, picked), lambda: acceptance(picked), lambda: best_gamma(chosen),
             lambda: speed(chosen)]
    for tab, view in zip(st.tabs(TABS, key="runs_tab", on_change="rerun"), views):
        if tab.open:
            with tab:
                try:
                    view()
                except Exception as e:  # noqa: BLE001 - odd rows (an import) get one line, not a traceback
                    show_error(e)


st.title("Runs")
st.caption("Every stored run and step, filtered and plotted; download what you see.")
db = settings().db
loaded = load(db)
if loaded is not None:
    show(db, *loaded)
