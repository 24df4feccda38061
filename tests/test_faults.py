"""Faults, each a test (bench/faults.py on the tiny pair, each child a real `python -m engine` or
workbench process): a sweep, a decode and a retrain SIGKILLed mid-way lose nothing that had
finished and leave nothing that blocks the next action; the sweep resumes under its name; a full
disk is one line and loses nothing stored; a second server on a taken port says so and the first
keeps serving; the workbench's server killed while a sweep, a Live decode and a retrain run
restarts with nothing half-made, the sweep resuming and the next retrain storing a version."""
from __future__ import annotations

import pytest

from bench import faults


@pytest.fixture
def model(tiny_dirs) -> list[str]:
    target, draft = tiny_dirs
    return ["--target", str(target), "--draft", str(draft)]


def _held(o: faults.Outcome) -> None:
    assert o.injected, o  # the child was alive at the fault: it hit the work, not its end
    assert not o.failed and o.lost == 0 and o.resumed, o


def test_a_sweep_killed_mid_way_keeps_its_cells_and_resumes_under_its_name(model, tmp_path):
    o = faults.sweep_killed(model, tmp_path, per_task=1, max_new=32)
    _held(o)
    assert {"opens read-write at once", "every run whole", "no temporary file left"} <= set(o.checks)
    assert "each cell once" in o.line


def test_a_decode_killed_while_it_streams_leaves_the_stored_run_and_the_next_one_stores(model, tmp_path):
    o = faults.decode_killed(model, tmp_path, max_new=1500)
    _held(o)
    assert "the killed decode stored nothing half-made" in o.checks


def test_a_retrain_killed_half_way_stores_no_version_and_the_next_one_does(tmp_path):
    o = faults.retrain_killed(tmp_path)
    _held(o)
    assert "versions after: [1, 2]" in o.line


def test_a_full_disk_is_one_line_and_loses_nothing(model, tmp_path):
    o = faults.disk_full(model, tmp_path)
    _held(o)
    assert o.line.startswith("error: run ") and "not stored" in o.line and "too large" in o.line.lower(), o.line


def test_a_second_server_on_a_taken_port_says_so_and_the_first_keeps_serving(model, tmp_path):
    o = faults.second_server(model, tmp_path)
    _held(o)
    assert faults.TAKEN.search(o.line), o.line


def test_the_report_counts_what_was_injected_and_lost():
    ok = faults.Outcome("sweep killed", injected=True, resumed=True, checks=["a", "b"])
    bad = faults.Outcome("disk full", injected=True, lost=1, failed=["every run whole: 1 run(s) with missing steps"])
    assert faults.summary([ok, bad]) == ("faults injected 2/2, runs lost 1, sweeps resumed 1, "
                                         "database checks passed 2/3")
    assert ok.ok and not bad.ok and "FAILED" in faults.report([ok, bad])


@pytest.mark.slow
def test_a_server_killed_mid_sweep_decode_and_retrain_restarts_and_resumes(model, tmp_path):
    if (why := faults.browser.browser_missing()):
        pytest.skip(why)
    o = faults.server_killed(model, tmp_path, per_task=4)
    _held(o)
    assert "the killed decode stored nothing" in o.checks and "each cell once" in o.line
    assert "the killed retrain stored no version" in o.checks and o.line.endswith("[1]")
