"""A profiling sweep on a Ray cluster, the parts a driver and a page need without Ray running
(docs/scale.md): what a worker loads (`PairSpec`), where the cluster is and what each worker takes
(`ClusterSpec`, `check_address`, `connect`, `plan_workers`), what a sweep returns, and the
records of a stored sweep with wall-clock fields aside (`records`, `differences`), which is how a
Ray sweep is checked against a serial one. The sweep itself is service/sweeps/cluster_sweep.py.
Ray is imported inside functions only: importing this module stays light."""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.helpers import one_line
from engine.service.sweeps.serial import Job, cell_key
from store import Store

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_CPUS = 2  # a local cluster's size: this project's machine has two cores
MAX_ATTEMPTS = 3  # a cell whose worker dies this many times is stored as failed
MAX_RESTARTS = 2  # per actor: a restart reruns its constructor (the pair loads again lazily)
START_TIMEOUT_S = 300.0  # workers must have loaded the first tier's pair by then
POLL_S = 0.2  # how often the driver looks at Stop while cells run
# What a cell's records may differ in between a serial and a Ray sweep: ids, times of storing,
# and the wall clock. Everything else (token ids, steps, acceptance, signals) must be equal.
NOT_COMPARED = {"runs": ("run_id", "created_at", "tokens_per_s", "ttft_ms", "wall_ms"),
                "steps": ("run_id", "draft_ms", "verify_ms", "decide_ms")}
# Passed on to local workers so they find the engine and the same model cache, offline or not.
_ENV_PASSED = ("HF_HUB_OFFLINE", "HF_HOME", "SPECLAB_CACHE", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True)
class PairSpec:
    """What a worker loads, as `load_pair` takes it (the tier comes with each cell): plain data,
    so it travels to the workers instead of a loaded pair."""

    target: str | None = None
    draft: str | None = None
    draft_tier: str | None = None
    device: str | None = None
    trust_remote_code: bool = False
    exact_verify: bool | None = None
    eagle: str | None = None
    engine: str = "torch"  # what runs the target (a llama.cpp worker probes its kernels in a child first)

    def load(self, tier: str):
        from engine.runtime.models import load_pair

        return load_pair(self.target, self.draft, tier, self.draft_tier, self.device, self.trust_remote_code,
                         exact_verify=self.exact_verify, eagle=self.eagle, engine=self.engine)


@dataclass(frozen=True)
class ClusterSpec:
    """Where to run: `address` None or "" starts (or reuses) a local cluster of LOCAL_CPUS CPUs;
    else a running cluster's address (`host:port`, `ray://host:port` or `auto`). `workers` None
    takes as many as the cluster fits; `worker_gpus` None gives each worker one GPU where the
    cluster has GPUs, else none (fractions share a GPU)."""

    address: str | None = None
    workers: int | None = None
    worker_cpus: float = 1.0
    worker_gpus: float | None = None
    start_timeout_s: float = START_TIMEOUT_S

    @property
    def where(self) -> str:
        return self.address or "a local cluster"

    def check(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be ≥ 1, got {self.workers}")
        if not self.worker_cpus > 0 or (self.worker_gpus is not None and self.worker_gpus < 0):
            raise ValueError(f"a worker needs > 0 CPUs and ≥ 0 GPUs, got {self.worker_cpus:g} CPUs, "
                             f"{self.worker_gpus:g} GPUs")


@dataclass(frozen=True)
class Finished:
    """One stored cell, for progress: the job, who ran it, whether it failed, and how many tries."""

    job: Job
    worker: int
    pid: int
    error: str | None
    attempts: int


@dataclass
class SweepResult:
    """What a Ray sweep did: cells stored now (ran), of them failed, cells resubmitted after a
    worker died, whether Stop ended it, the workers, and the driver's wall time."""

    ran: int = 0
    failed: int = 0
    retried: int = 0
    stopped: bool = False
    workers: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = 0.0  # connecting and starting the workers (their first pair loaded)
    store_s: float = 0.0  # the driver's DuckDB writes, all cells together


# -- connecting ----------------------------------------------------------------------------------------
def check_address(address: str, timeout_s: float = 3.0) -> None:
    """A `host:port` (or `ray://host:port`) nobody answers on is a ValueError in one line now,
    not a minute of retries inside ray.init."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a Ray address is host:port, ray://host:port or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"cannot reach a Ray cluster at {address} ({e.strerror or e}): start one with "
                         "`ray start --head` there, or check the address") from None


def connect(cluster: ClusterSpec) -> bool:
    """Connects this process to the cluster; True when it started a local one (to shut down)."""
    import logging

    import ray

    if cluster.address:
        check_address(cluster.address)
    if ray.is_initialized():
        return False
    if cluster.address:
        env = dict(working_dir=str(REPO_ROOT), excludes=[".venv/", "*.duckdb", ".git/", "docs/screenshots/"])
        try:
            ray.init(address=cluster.address, runtime_env=env, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError, TimeoutError) as e:
            raise ValueError(f"cannot connect to the Ray cluster at {cluster.address}: {one_line(e)}") from None
        return False
    ray.init(num_cpus=LOCAL_CPUS, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    return True


def local_env() -> dict:
    """The workers' environment on a cluster on this machine: the repository on the path."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    return dict(env_vars=dict(env, PYTHONPATH=path))


def fit(nodes: list[dict], cpus: float, gpus: float) -> int:
    """How many workers of `cpus` CPUs and `gpus` GPUs the alive nodes hold (an actor lives on
    one node, so a node's leftovers do not add up with another's)."""
    total = 0
    for n in nodes:
        if not n.get("Alive", True):
            continue
        res = n.get("Resources", {})
        per = [math.floor(res.get("CPU", 0) / cpus + 1e-9)]
        if gpus > 0:
            per.append(math.floor(res.get("GPU", 0) / gpus + 1e-9))
        total += max(0, min(per))
    return total


def plan_workers(cluster: ClusterSpec, nodes: list[dict]) -> tuple[int, float]:
    """(workers, GPUs per worker) for this cluster; ValueError when it cannot hold what is asked."""
    alive = [n for n in nodes if n.get("Alive", True)]
    cpu = sum(n.get("Resources", {}).get("CPU", 0) for n in alive)
    gpu = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
    gpus = cluster.worker_gpus if cluster.worker_gpus is not None else (1.0 if gpu > 0 else 0.0)
    room = fit(alive, cluster.worker_cpus, gpus)
    asked = cluster.workers or max(room, 1)
    if room < asked:
        raise ValueError(f"{cluster.where} has {cpu:g} CPU(s) and {gpu:g} GPU(s) on {len(alive)} node(s): it holds "
                         f"{room} worker(s) of {cluster.worker_cpus:g} CPU + {gpus:g} GPU, not the {asked} asked")
    return asked, gpus


# -- identity ------------------------------------------------------------------------------------------
def records(st: Store, sweep: str) -> dict[tuple, dict]:
    """A sweep's stored cells keyed by (tier, KV tier, prompt, policy): each run's row and its
    steps without the fields that may differ between two sweeps of the same cells
    (NOT_COMPARED: ids and the wall clock). Equal for a serial and a Ray sweep."""
    runs = st.runs(sweep=sweep)
    steps = st.steps()
    out: dict[tuple, dict] = {}
    for r in runs.to_dict("records"):
        key = cell_key(r)
        assert key not in out, f"cell {key} stored twice in sweep {sweep!r}"
        mine = steps[steps["run_id"] == r["run_id"]].to_dict("records")
        out[key] = dict(run=_plain({k: v for k, v in r.items() if k not in NOT_COMPARED["runs"]}),
                        steps=[_plain({k: v for k, v in s.items() if k not in NOT_COMPARED["steps"]}) for s in mine])
    return out


def _plain(d: dict) -> dict:
    """Comparable values: arrays as lists, missing values as None (NaN ≠ NaN)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        if isinstance(v, float) and math.isnan(v):
            v = None
        if v is not None and type(v).__name__ in ("NAType", "NaTType"):
            v = None
        out[k] = v
    return out


def differences(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[str]:
    """Where two `records` differ, one line each (empty: identical)."""
    lines = [f"cell {k} only in the first" for k in a.keys() - b.keys()]
    lines += [f"cell {k} only in the second" for k in b.keys() - a.keys()]
    for k in sorted(a.keys() & b.keys()):
        if a[k]["run"] != b[k]["run"]:
            field_ = next(f for f in a[k]["run"] if a[k]["run"][f] != b[k]["run"].get(f))
            lines.append(f"cell {k}: run field {field_} differs")
        elif a[k]["steps"] != b[k]["steps"]:
            sa, sb = a[k]["steps"], b[k]["steps"]
            i = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
            what = (f"step {i} field {next(f for f in sa[i] if sa[i][f] != sb[i].get(f))}"
                    if i < min(len(sa), len(sb)) else f"{len(sa)} vs {len(sb)} steps")
            lines.append(f"cell {k}: {what} differs")
    return lines
