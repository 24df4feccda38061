"""What every AppTest of the workbench shares: the app's path, an environment on the tiny test
models with a fresh database, and small readers."""
from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[1] / "app.py"  # AppTest resolves relative paths oddly


@pytest.fixture
def app_env(tiny_dirs, tmp_path, monkeypatch) -> Path:
    target, draft = tiny_dirs
    db = tmp_path / "ui.duckdb"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECLAB_TARGET", str(target))
    monkeypatch.setenv("SPECLAB_DRAFT", str(draft))
    monkeypatch.setenv("SPECLAB_DB", str(db))
    return db


def _app() -> AppTest:
    """The app on its default page, run once."""
    at = AppTest.from_file(str(APP), default_timeout=60)
    return at.run()


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def press_generate(at: AppTest, timeout: float = 60) -> AppTest:
    """Generate on the Live page, then, once its run (a thread of its own: engine/service/session.py)
    has ended, the page run again, as its poll would: the result is drawn."""
    at.button(key="live_generate").click().run(timeout=timeout)
    run = at.session_state["live_run"] if "live_run" in at.session_state else None
    if run is not None:
        run.wait(timeout)
        at.run(timeout=timeout)
    return at


def open_page(path: str) -> AppTest:
    """The app switched to one of its pages (`views/….py`), run once."""
    return AppTest.from_file(str(APP), default_timeout=120).switch_page(path).run()


def page_links(at: AppTest) -> list[str]:
    """The labels of the st.page_link elements: the first steps a page offers."""
    return [p.proto.label for p in at.get("page_link")]


TRACE_PROMPTS = [("code", "def f(x):"), ("chat", "Hi there"), ("math", "1+1="), ("chat", "Tell me")]


def store_costs_and_traces(db, pair) -> None:
    """What replay and retraining read: a cost table and four traces of the tiny pair."""
    from engine.lab.profiling import measure_costs, trace
    from store import Store

    with Store(db) as s:
        s.add_costs(measure_costs(pair, buckets=(8,), reps=2).to_rows(2))
        for task, prompt in TRACE_PROMPTS:
            t = trace(pair, prompt, task, 16)
            s.add_trace(t.row, t.positions)
