"""Background sweeps (engine/service/sweeps/jobs.py) on the tiny pair: results land as they finish, one sweep at
a time, Stop keeps what finished and a restart resumes the rest."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.lab.decode_lock import decode_slot
from engine.service.sweeps import jobs
from engine.service.sweeps.serial import sweep_jobs
from store import Store

PROMPTS = [("chat", "Hi there"), ("code", "def f(x):")]


def _spec(name: str = "bg", trace: bool = False) -> jobs.SweepSpec:
    return jobs.SweepSpec(name, tuple(sweep_jobs(PROMPTS, ["fp32"], ["ar", "fixed:2"])), 8, trace)


def _keys(db) -> list[tuple]:
    with Store(db, read_only=True) as st:
        return sorted(st.runs(sweep="bg")[["prompt", "policy"]].itertuples(index=False, name=None))


def test_sweep_runs_in_the_background_and_stores_each_run(tiny_pair, tmp_path):
    db = tmp_path / "jobs.duckdb"
    runner = jobs.SweepRunner()
    first = runner.start(_spec(trace=True), str(db), lambda tier: tiny_pair)
    assert first.running and first.total == 2 + 4  # two traces, then four runs
    end = runner.wait(120)
    assert end.state == "finished", end.error
    assert (end.done, end.ran, end.error, end.current) == (6, 6, "", "")
    assert _keys(db) == sorted((p, pol) for _, p in PROMPTS for pol in ("ar", "fixed:2"))
    with Store(db, read_only=True) as st:
        assert sorted(st.traces()["prompt"]) == sorted(p for _, p in PROMPTS)
    # The same name again resumes: nothing left to run, everything counts as done.
    again = runner.start(_spec(trace=True), str(db), lambda tier: tiny_pair)
    end = runner.wait(60)
    assert again.total == 6 and (end.state, end.done, end.ran) == ("finished", 6, 0)


def test_a_second_sweep_is_refused_while_one_runs(tiny_pair, tmp_path):
    runner = jobs.SweepRunner()
    with decode_slot("test"):  # the sweep waits for the slot: it is surely still running
        runner.start(_spec(), str(tmp_path / "a.duckdb"), lambda tier: tiny_pair)
        with pytest.raises(ValueError) as err:
            runner.start(_spec("other"), str(tmp_path / "b.duckdb"), lambda tier: tiny_pair)
        assert str(err.value) == "a sweep (bg, 0/4 done) is already running: wait for it or stop it"
        deadline = time.monotonic() + 30
        while runner.status().current != "waiting for test" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.status().current == "waiting for test"  # the page says what it waits for
    assert runner.wait(120).state == "finished"


def test_stop_keeps_what_finished_and_a_restart_resumes_the_rest(tiny_pair, tmp_path, monkeypatch):
    db = tmp_path / "stop.duckdb"
    runner = jobs.SweepRunner()
    real = jobs.decode_slot

    @contextlib.contextmanager
    def slot_then_stop(who, **kw):  # press Stop as the second run asks for the slot
        status = runner.status()
        if status is not None and status.ran >= 1:
            runner.stop()
        with real(who, **kw):
            yield

    monkeypatch.setattr(jobs, "decode_slot", slot_then_stop)
    runner.start(_spec(), str(db), lambda tier: tiny_pair)
    end = runner.wait(120)
    assert (end.state, end.done, end.ran, end.stop_requested) == ("stopped", 1, 1, True)
    assert len(_keys(db)) == 1
    monkeypatch.setattr(jobs, "decode_slot", real)

    resumed = runner.start(_spec(), str(db), lambda tier: tiny_pair)
    assert not resumed.stop_requested
    end = runner.wait(120)
    assert (end.state, end.done, end.ran) == ("finished", 4, 3)  # only the three left ran
    assert _keys(db) == sorted((p, pol) for _, p in PROMPTS for pol in ("ar", "fixed:2"))  # each once


def test_bad_specs_and_failures_are_one_line(tiny_pair, tmp_path):
    runner = jobs.SweepRunner()
    with pytest.raises(ValueError, match="nothing to run"):
        runner.start(jobs.SweepSpec("x", (), 8), str(tmp_path / "x.duckdb"), lambda tier: tiny_pair)
    with pytest.raises(ValueError, match="≥ 2"):
        runner.start(jobs.SweepSpec("x", _spec().jobs, 1, trace=True), str(tmp_path / "x.duckdb"), lambda t: tiny_pair)
    assert runner.status() is None

    def broken(tier):
        raise ValueError(f"cannot load tier {tier}\nsecond line")

    runner.start(_spec(), str(tmp_path / "f.duckdb"), broken)
    end = runner.wait(60)
    assert end.state == "failed" and "cannot load tier fp32" in end.error and "\n" not in end.error


def test_status_line_and_eta_format():
    s = jobs.SweepStatus("n", "db", "running", 3, 12, 0.0, current="ar on chat (fp32): 'Hi'", eta_s=65.2)
    assert s.line() == "3/12 runs · ETA 1:05 · now: ar on chat (fp32): 'Hi'"
    assert jobs.format_eta(3725) == "1:02:05" and jobs.format_eta(0) == "0:00"


def test_a_failing_cell_is_stored_as_failed_and_the_serial_sweep_goes_on(tiny_pair, tmp_path):
    from engine.service import profile, sweep_table

    jobs_ = sweep_jobs(PROMPTS, ["fp32"], ["ar", "fixed:2@eagle", "fixed:2"])  # the tiny pair has no EAGLE head
    said: list[str] = []
    with Store(str(tmp_path / "s.duckdb")) as st:
        assert profile(st, "s", jobs_, lambda tier: tiny_pair, 8, say=said.append) == len(jobs_)
        runs = st.runs(sweep="s")
        bad, good = runs[runs["policy"] == "fixed:2@eagle"], runs[runs["policy"] != "fixed:2@eagle"]
        assert len(bad) == len(PROMPTS) and (bad["stop_reason"] == "error").all() and (bad["n_tokens"] == 0).all()
        assert bad["error"].str.contains("eagle").all() and not bad["error"].str.contains("\n").any()
        assert len(good) == 2 * len(PROMPTS) and good["error"].isna().all() and (good["n_tokens"] > 0).all()
        assert set(sweep_table(runs)["fp32"]["tokens_per_s"]) == {"ar", "fixed:2"}  # failed cells have no speed
        assert sum("stored as failed" in m for m in said) == len(PROMPTS)
        assert profile(st, "s", jobs_, lambda tier: tiny_pair, 8) == 0  # a rerun skips the failed cells too


@pytest.mark.parametrize("trace", [False, True], ids=["run", "trace"])
def test_a_sweep_takes_turns_with_a_live_decode_a_step_each(trace, tiny_pair, tmp_path, monkeypatch):
    """A Generate pressed while a sweep's run (or trace) decodes waits for one of its steps, not for
    the whole run (or trace)."""
    from engine.lab import decode_lock

    holds: list[str] = []
    live: list[threading.Thread] = []
    real = decode_lock.decode_slot

    @contextlib.contextmanager
    def logged(who, *args, **kw):
        with real(who, *args, **kw):
            holds.append(who)
            if who.startswith("profile sweep") and holds.count(who) == 3 and not live:  # mid-run: Generate
                live.append(threading.Thread(target=lambda: list(decode_lock.stepped(iter(range(3)), "live"))))
                live[0].start()
                while decode_lock.queued() < 1:  # it waits behind this step
                    time.sleep(0.001)
            yield

    monkeypatch.setattr(decode_lock, "decode_slot", logged)
    monkeypatch.setattr(jobs, "decode_slot", logged)
    runner = jobs.SweepRunner()
    runner.start(_spec(trace=trace), str(tmp_path / "turns.duckdb"), lambda tier: tiny_pair)
    assert runner.wait(120).state == "finished"
    live[0].join(10)
    first, second = [i for i, who in enumerate(holds) if who == "live"][:2]
    assert holds[first - 1].startswith("profile sweep")  # it came in after the step it waited for
    assert any(h.startswith("profile sweep") for h in holds[first + 1:second])  # the run went on between its steps
    assert len(_keys(tmp_path / "turns.duckdb")) == 4
    with Store(tmp_path / "turns.duckdb", read_only=True) as st:
        assert len(st.traces()) == (2 if trace else 0)


def test_a_trace_steps_in_inference_mode_wherever_it_is_resumed(tiny_pair, monkeypatch):
    """Taken a step at a time from a thread outside inference mode (the sweep's), each step still
    runs inside it: no autograd graph, and no error on the inference tensors a live run cached."""
    import torch

    from engine.lab import profiling

    modes: list[bool] = []
    real = profiling.target_verifier

    def spied(*args, **kw):
        verifier = real(*args, **kw)
        verify = verifier.verify

        def verify_(*a, **k):
            modes.append(torch.is_inference_mode_enabled())
            return verify(*a, **k)

        verifier.verify = verify_
        return verifier

    monkeypatch.setattr(profiling, "target_verifier", spied)
    items = list(profiling.tracing(tiny_pair, "Hi there", "chat", 6))
    assert not torch.is_inference_mode_enabled()
    assert isinstance(items[-1], profiling.Trace) and modes and all(modes)
