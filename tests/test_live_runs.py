"""The Live page's decode on a thread of its own (engine/service/live_runs.py): Stop is heard
between two steps and the run is stored as stopped; a bad request fails before any thread starts.
The page's Stop button itself is pressed in a real browser (tests/test_browser.py)."""
import time

import pytest

from engine.service.live_runs import start_live
from engine.service.runs import Request
from store import Store


def test_stop_ends_a_live_run_within_one_step_and_it_is_stored(tiny_pair, tmp_path, monkeypatch):
    from engine.decode.policies.fixed import FixedPolicy

    choose = FixedPolicy.choose

    def slow(self, state):  # a step long enough that a stop lands mid-run
        time.sleep(0.02)
        return choose(self, state)

    monkeypatch.setattr(FixedPolicy, "choose", slow)
    db = tmp_path / "x.duckdb"
    run = start_live(tiny_pair, Request("Hello there", "fixed:1", max_new_tokens=200), str(db))
    deadline = time.monotonic() + 60
    while len(run.snapshot().steps) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.stop()
    heard = len(run.snapshot().steps)
    snap = run.wait(60)
    assert snap.state == "stopped" and len(snap.steps) <= heard + 1, (heard, len(snap.steps))
    assert snap.summary["stop_reason"] == "stopped" and len(snap.token_ids) < 200
    assert snap.stored.level == "success" and snap.stored.message.startswith("Stored as run ")
    with Store(db) as st:
        runs = st.runs()
    assert list(runs["stop_reason"]) == ["stopped"] and int(runs["n_tokens"].iloc[0]) == len(snap.token_ids)


def test_a_bad_request_fails_before_a_thread_starts(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="fixed:k"):
        start_live(tiny_pair, Request("Hello", "fixed:99"), str(tmp_path / "x.duckdb"))
    assert not (tmp_path / "x.duckdb").exists()


def test_a_failing_run_is_one_line_and_stores_nothing(tiny_pair, tmp_path):
    db = tmp_path / "x.duckdb"
    run = start_live(tiny_pair, Request("x" * 5000, "fixed:2"), str(db))  # over the tiny target's context
    snap = run.wait(60)
    assert snap.state == "failed" and "\n" not in snap.error and "context" in snap.error, snap.error
    assert not db.exists()
