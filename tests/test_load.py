"""The workbench under load in a real browser (bench/load.py): two sessions at once on one server,
a Profile sweep started beside them, each doing a tuner's actions. Every action completes without a
page error, every live run a session saw stored is stored once, no run is overtaken in the decode
queue, and the sweep ends with each of its cells stored once. (The pair loading once is `bench
load`'s figure: the tiny pair is too small to see.)"""
from __future__ import annotations

import pytest

from bench import browser as B
from bench import load

pytestmark = pytest.mark.slow

if (why := B.browser_missing()):
    pytest.skip(f"no real-browser test here: {why}", allow_module_level=True)


def test_two_sessions_at_once_lose_nothing_and_wait_their_turn(tiny_dirs):
    target, draft = tiny_dirs
    r = load.measure([2], rounds=1, max_new=8, env={"SPECLAB_TARGET": str(target), "SPECLAB_DRAFT": str(draft)},
                     warm=False, think_s=(0.0, 0.0))
    print("\n" + load.report(r))
    res = r["sessions"]["2"]
    assert res["errors"] == [], res["errors"]
    assert {"live", "runs page", "runs download", "compare page", "compare", "what-if", "profile start"} <= set(res["actions"])
    st = r["store"]
    assert st["live_seen"] == st["live_stored"] == 2 and st["seen_stored_once"]  # one each
    assert st["compares"] == 2 and st["compare_runs_stored"] == 2 * 3  # the page's three default policies each
    assert st["queue"]["runs"] == 2 and st["queue"]["overtaken"] == 0
    sw = r["sweep"]  # the sweep a session started ran to its end beside them, each cell stored once
    assert sw["state"] == "finished" and sw["done"] == sw["total"] > 0, sw
    assert sw["runs"] > 0 and sw["cells_once"] and sw["failed"] == 0, sw
