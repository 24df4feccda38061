"""Profiling sweeps on a local Ray cluster (engine/service/sweeps/cluster.py, cluster_sweep.py) over the tiny pair: the same stored
records as the serial sweep, a killed worker loses no cell, a bad cell is stored as failed and
the sweep goes on, a rerun adds nothing twice, bad input is one line and changes nothing stored.
One local cluster (2 CPUs) serves the whole module."""
from __future__ import annotations

import os
import signal

import pytest
import ray
import torch

from engine.lab.profiling import measure_costs
from engine.service import profile, sweep_table
from engine.service.sweeps import cluster, cluster_sweep
from engine.service.sweeps.serial import sweep_jobs
from store import Store

PROMPTS = [("chat", "Hi there"), ("code", "def f(x):"), ("math", "2+2=")]
POLICIES = ["ar", "fixed:2", "fixed:3@ngram", "rakv"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def costs_rows(tiny_pair):
    """One measured cost table, stored in every database a comparison uses: rakv reads it, so
    the serial and the Ray sweep decide from the same figures."""
    return measure_costs(tiny_pair, buckets=(16,), reps=1).to_rows(1)


def _pair_spec(tiny_dirs) -> cluster.PairSpec:
    target, draft = tiny_dirs
    return cluster.PairSpec(str(target), str(draft), device="cpu")


def _db(tmp_path, name: str, costs_rows=None) -> str:
    db = str(tmp_path / f"{name}.duckdb")
    if costs_rows is not None:
        with Store(db) as st:
            st.add_costs(costs_rows)
    return db


def _count(db: str) -> tuple[int, int]:
    with Store(db, read_only=True) as st:
        return len(st.runs()), len(st.steps())


def test_ray_sweep_stores_the_serial_sweeps_records_and_a_rerun_adds_nothing(
        local_cluster, tiny_pair, tiny_dirs, costs_rows, tmp_path):
    jobs = sweep_jobs(PROMPTS, ["fp32"], POLICIES)
    serial, on_ray = _db(tmp_path, "serial", costs_rows), _db(tmp_path, "ray", costs_rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's count (1 CPU each): CPU kernels split sums by thread
    try:
        with Store(serial) as st:
            assert profile(st, "s", jobs, lambda tier: tiny_pair, MAX_NEW) == len(jobs)
    finally:
        torch.set_num_threads(threads)
    seen, dispatched = [], []
    with Store(on_ray) as st:
        res = cluster_sweep.profile_on_ray(st, "s", jobs, _pair_spec(tiny_dirs), MAX_NEW,
                                     on_cell=seen.append, on_dispatch=lambda job, pid: dispatched.append(pid))
    assert (res.ran, res.failed, res.retried, res.stopped) == (len(jobs), 0, 0, False)
    assert len(res.workers) == 2 and len({w["pid"] for w in res.workers}) == 2
    assert sorted(f.job.key for f in seen) == sorted(j.key for j in jobs)  # each cell reported once, stored once
    assert set(dispatched) == {w["pid"] for w in res.workers}  # both workers took cells
    with Store(serial, read_only=True) as a, Store(on_ray, read_only=True) as b:
        ra, rb = cluster.records(a, "s"), cluster.records(b, "s")
        assert len(ra) == len(jobs) and cluster.differences(ra, rb) == []
        assert any(s["accepted"] for cell in rb.values() for s in cell["steps"])  # drafts were accepted: real steps
        assert b.runs(sweep="s")["wall_ms"].notna().all()  # the wall clock is stored, only not compared
    before = _count(on_ray)
    with Store(on_ray) as st:  # the same name again: everything is stored, no cluster work at all
        again = cluster_sweep.profile_on_ray(st, "s", jobs, _pair_spec(tiny_dirs), MAX_NEW)
    assert (again.ran, again.workers) == (0, []) and _count(on_ray) == before


def test_a_killed_worker_loses_no_cell_and_a_bad_cell_is_stored_as_failed(local_cluster, tiny_dirs, tmp_path):
    jobs = sweep_jobs(PROMPTS, ["fp32"], ["ar", "fixed:2", "fixed:2@eagle"])  # the tiny pair has no EAGLE head
    db = _db(tmp_path, "faults")
    killed: list[int] = []

    def kill_the_third(job, pid):  # SIGKILL the worker that just received the third cell: it is in flight
        if len(killed) == 0 and getattr(kill_the_third, "n", 0) == 2:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        kill_the_third.n = getattr(kill_the_third, "n", 0) + 1

    with Store(db) as st:
        res = cluster_sweep.profile_on_ray(st, "f", jobs, _pair_spec(tiny_dirs), MAX_NEW, on_dispatch=kill_the_third)
    assert killed and res.retried >= 1 and res.ran == len(jobs) and not res.stopped
    with Store(db, read_only=True) as st:
        runs = st.runs(sweep="f")
        assert sorted(zip(runs["prompt"], runs["policy"])) == sorted((j.prompt, j.policy) for j in jobs)  # each once
        bad = runs[runs["policy"] == "fixed:2@eagle"]
        assert len(bad) == len(PROMPTS) == res.failed
        assert bad["error"].str.contains("eagle").all() and not bad["error"].str.contains("\n").any()
        good = runs[runs["policy"] != "fixed:2@eagle"]
        assert good["error"].isna().all() and (good["n_tokens"] > 0).all()
        assert set(sweep_table(runs)["fp32"]["tokens_per_s"]) == {"ar", "fixed:2"}  # failed cells have no speed


def test_stop_keeps_every_finished_cell_and_the_same_name_resumes(local_cluster, tiny_dirs, tmp_path):
    jobs = sweep_jobs(PROMPTS, ["fp32"], ["ar", "fixed:2"])
    db = _db(tmp_path, "stop")
    done: list = []
    with Store(db) as st:
        res = cluster_sweep.profile_on_ray(st, "p", jobs, _pair_spec(tiny_dirs), MAX_NEW, on_cell=done.append,
                                     stop=lambda: len(done) >= 1)
    assert res.stopped and 1 <= res.ran < len(jobs) and _count(db)[0] == res.ran == len(done)
    with Store(db) as st:
        rest = cluster_sweep.profile_on_ray(st, "p", jobs, _pair_spec(tiny_dirs), MAX_NEW)
    assert rest.ran == len(jobs) - res.ran
    with Store(db, read_only=True) as st:
        assert len(cluster.records(st, "p")) == len(jobs)  # records() asserts no cell is stored twice


def test_bad_input_is_one_line_and_changes_nothing_stored(local_cluster, tiny_dirs, tmp_path):
    jobs = sweep_jobs(PROMPTS[:1], ["fp32"], ["ar"])
    db = _db(tmp_path, "bad")
    with Store(db) as st:
        cluster_sweep.profile_on_ray(st, "b", jobs, _pair_spec(tiny_dirs), MAX_NEW)
    before = _count(db)
    other = sweep_jobs(PROMPTS[:1], ["fp32"], ["fixed:2"])
    cases = [
        (dict(jobs=jobs, cluster=cluster.ClusterSpec("127.0.0.1:1")), "cannot reach a Ray cluster at 127.0.0.1:1"),
        (dict(jobs=jobs, cluster=cluster.ClusterSpec("nowhere")), "a Ray address is host:port"),
        (dict(jobs=other, cluster=cluster.ClusterSpec(workers=3)), "holds 2 worker(s) of 1 CPU + 0 GPU, not the 3 asked"),
        (dict(jobs=other, cluster=cluster.ClusterSpec(worker_gpus=1)), "0 GPU(s) on 1 node(s): it holds 0 worker(s)"),
        (dict(jobs=other, cluster=cluster.ClusterSpec()), "sweep 'b' already holds 1 run(s) of other cells"),
        (dict(jobs=jobs, cluster=cluster.ClusterSpec(), max_new=MAX_NEW + 1), "was run with max new tokens 8, not 9"),
    ]
    for kw, message in cases:
        # "b" again with other cells; under a new name for the cluster checks (which come after the name's)
        name = "b" if "sweep 'b'" in message or "max new" in message else "fresh"
        with Store(db) as st, pytest.raises(ValueError) as err:
            cluster_sweep.profile_on_ray(st, name, kw["jobs"], _pair_spec(tiny_dirs), kw.get("max_new", MAX_NEW), kw["cluster"])
        assert message in str(err.value) and "\n" not in str(err.value)
    assert _count(db) == before
    with Store(db) as st, pytest.raises(ValueError, match="a worker cannot load the pair"):
        cluster_sweep.profile_on_ray(st, "fresh", jobs, cluster.PairSpec(str(tmp_path / "no-such-model"), device="cpu"), MAX_NEW)
    assert _count(db) == before


def test_fit_counts_workers_per_node():
    nodes = [dict(Alive=True, Resources=dict(CPU=8, GPU=2)), dict(Alive=True, Resources=dict(CPU=3, GPU=1)),
             dict(Alive=False, Resources=dict(CPU=64, GPU=8))]
    assert cluster.fit(nodes, 1, 1) == 3 and cluster.fit(nodes, 4, 0) == 2 and cluster.fit(nodes, 1, 0.5) == 6
    assert cluster.plan_workers(cluster.ClusterSpec(), nodes) == (3, 1.0)
    assert cluster.plan_workers(cluster.ClusterSpec(worker_gpus=0), nodes) == (11, 0.0)


def test_the_profile_page_runs_a_sweep_on_the_cluster(local_cluster, app_env):
    from streamlit.testing.v1 import AppTest

    from apptest import APP, _errors
    from engine.service.sweeps.jobs import RUNNER

    at = AppTest.from_file(str(APP), default_timeout=120).switch_page("views/profile.py").run()
    at.text_input(key="profile_name").set_value("ui-ray")
    at.multiselect(key="profile_policies").set_value(["ar", "fixed:2"])
    at.checkbox(key="profile_trace").set_value(False)
    at.checkbox(key="profile_ray").set_value(True)
    at.text_input(key="profile_ray_address").set_value("127.0.0.1:1")
    at.button(key="profile_start").click().run()
    assert any("cannot reach a Ray cluster at 127.0.0.1:1" in e for e in _errors(at)), _errors(at)
    assert RUNNER.status() is None or RUNNER.status().name != "ui-ray"  # refused on the page: nothing started
    at.text_input(key="profile_ray_address").set_value("")  # the local cluster (this module's)
    at.button(key="profile_start").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    end = RUNNER.wait(300)
    assert (end.name, end.state, end.done, end.ran) == ("ui-ray", "finished", 8, 8), end.error
    with Store(app_env, read_only=True) as st:
        runs = st.runs(sweep="ui-ray")
    assert len(runs) == 8 and runs["error"].isna().all()  # heldout: one prompt per task, four tasks, two policies
    at.run()
    assert "Sweep ui-ray" in at.success[0].value and set(at.dataframe[0].value["policy"]) == {"ar", "fixed:2"}


def test_devices_are_named_by_type_so_two_gpu_models_never_share_a_cost_table(monkeypatch):
    from engine.runtime.models import device_name

    assert device_name("cpu") == device_name(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: {0: "NVIDIA H200", 1: "NVIDIA L4"}[torch.device(d).index])
    assert device_name("cuda:0") == "cuda (NVIDIA H200)" and device_name(torch.device("cuda:1")) == "cuda (NVIDIA L4)"
