"""Background profiling sweeps for the workbench: one at a time per process, on a daemon thread,
with a status any session can read (the Profile page polls it). Torch-free at import; no
streamlit: the page passes a loader of its cached pairs.

A sweep is `service.profile` (the CLI's `profile --sweep`: each run stored as it finishes, a
rerun of the same name resumes), optionally after `service.trace_prompts` over the same prompts
so that replay and retrain have traces. Every model call takes the process's decode slot
(engine/lab/decode_lock.py) per run, so a live decode waits at most one run. Stop is checked between runs:
the run in progress finishes and is stored."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from engine.base.helpers import one_line
from engine.lab.decode_lock import decode_slot, stepped
from engine.service import profile, tier_label, trace_prompts
from store import Store


@dataclass(frozen=True)
class SweepSpec:
    """What to run: the sweep's name (its runs' `sweep` column), its jobs (engine.lab.profiling.Job,
    tier-major as `sweep_jobs` makes them), the run length, and whether to trace the prompts first."""

    name: str
    jobs: tuple
    max_new_tokens: int
    trace: bool = False
    cluster: Any = None  # a service.sweeps.cluster.ClusterSpec: the runs on a Ray cluster; None: here, one by one
    pair: Any = None  # with a cluster: the service.sweeps.cluster.PairSpec its workers load


@dataclass(frozen=True)
class SweepStatus:
    """A snapshot of the sweep: `done` of `total` items (traces first when tracing, then runs;
    items stored by an earlier try of the same sweep count as done), `ran` of them made now."""

    name: str
    db: str
    state: str
    done: int
    total: int
    started_at: float  # time.time()
    current: str = ""  # what runs now, or what it waits for
    eta_s: float | None = None  # None until one item has been timed
    error: str = ""  # one line, when failed
    ran: int = 0
    stop_requested: bool = False
    finished_at: float | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    def line(self) -> str:
        """`3/12 runs · ETA 1:05 · now: fixed:4 on chat (fp32)`, for a progress bar."""
        eta = "ETA " + (format_eta(self.eta_s) if self.eta_s is not None else "…")
        now = "stopping after this run" if self.stop_requested else f"now: {self.current or 'starting'}"
        return f"{self.done}/{self.total} runs · {eta} · {now}"


def format_eta(seconds: float) -> str:
    """m:ss (h:mm:ss from an hour on)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def job_label(job: Any) -> str:
    """One line for a sweep job: policy, task, setting and the prompt's start."""
    prompt = job.prompt if len(job.prompt) <= 40 else job.prompt[:39] + "…"
    return f"{job.policy} on {job.task} ({tier_label(job.tier, job.kv_tier)}): {prompt!r}"


def trace_items(jobs: tuple) -> list[tuple[str, str, str, str]]:
    """(tier, KV tier, task, prompt) of every prompt of the jobs per setting, in the jobs' order."""
    return list(dict.fromkeys((j.tier, j.kv_tier, j.task, j.prompt) for j in jobs))


def check_spec(spec: SweepSpec) -> None:
    """One-line ValueErrors before anything is opened or started."""
    if not spec.name.strip():
        raise ValueError("a sweep needs a name (its runs are stored under it; the same name resumes)")
    if not spec.jobs:
        raise ValueError("nothing to run: choose at least one tier, KV tier, prompt and policy")
    if spec.cluster is not None and spec.pair is None:
        raise ValueError("a sweep on a cluster needs the pair its workers load (service.sweeps.cluster.PairSpec)")
    if spec.cluster is not None and spec.cluster.address:  # a wrong address is said on the page, not later
        from engine.service.sweeps.cluster import check_address

        check_address(spec.cluster.address)
    if spec.max_new_tokens < (2 if spec.trace else 1):
        raise ValueError(f"max new tokens must be ≥ {2 if spec.trace else 1}"
                         f"{' for a trace to have a position' if spec.trace else ''}, got {spec.max_new_tokens}")


class _Stopped(Exception):
    """Raised from the run guard once Stop was pressed: the sweep ends between two runs."""


class SweepRunner:
    """Runs one sweep at a time on a daemon thread; every method is safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards every field below
        self._status: SweepStatus | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Timing for the ETA: seconds per made trace / run, and the count of each kind left.
        self._seconds: dict[str, list[float]] = {"trace": [], "run": []}
        self._left: dict[str, int] = {"trace": 0, "run": 0}
        self._t0 = 0.0

    # ----- reading -----------------------------------------------------------------
    def status(self) -> SweepStatus | None:
        """The running sweep's status, else the last one's (None before any)."""
        with self._lock:
            if self._status is None or not self._status.running:
                return self._status
            return replace(self._status, eta_s=self._eta())

    def wait(self, timeout_s: float | None = None) -> SweepStatus | None:
        """Blocks until the sweep's thread ends (or `timeout_s`); then its status."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.status()

    def _eta(self) -> float | None:
        means = {k: sum(v) / len(v) for k, v in self._seconds.items() if v}
        if not means:
            return None
        fallback = next(iter(means.values()))  # a kind not timed yet: as long as the other
        return sum(n * means.get(k, fallback) for k, n in self._left.items())

    # ----- control -----------------------------------------------------------------
    def start(self, spec: SweepSpec, db: str, load: Callable[[str], object], wait_s: float = 3.0) -> SweepStatus:
        """Starts the sweep on its own read-write Store of `db` (opened here, so a file another
        process holds is an error now, not in the background). ValueError while one runs."""
        with self._lock:
            self._refuse_while_running()
            check_spec(spec)
            store = Store(db, wait_s=wait_s)
            if store.staged:  # runs would be staged, but costs and traces cannot be: refuse
                store.close()
                raise ValueError(f"{store.message.split(';')[0]}: a sweep needs it read-write; "
                                 "try again once that process closes it")
            n_traces = len(trace_items(spec.jobs)) if spec.trace else 0
            self._stop.clear()
            self._seconds = {"trace": [], "run": []}
            self._left = {"trace": n_traces, "run": len(spec.jobs)}
            self._status = SweepStatus(spec.name, db, "running", 0, n_traces + len(spec.jobs), time.time())
            self._thread = threading.Thread(target=self._run, args=(spec, store, load),
                                            name=f"sweep {spec.name}", daemon=True)
            self._thread.start()
            return self._status

    def check_free(self) -> None:
        """ValueError (the line `start` would give) while a sweep runs: check before loading models."""
        with self._lock:
            self._refuse_while_running()

    def _refuse_while_running(self) -> None:
        if self._status is not None and self._status.running:
            s = self._status
            raise ValueError(f"a sweep ({s.name}, {s.done}/{s.total} done) is already running: "
                             "wait for it or stop it")

    def stop(self) -> bool:
        """Asks the running sweep to stop after the run in progress; False when none runs."""
        with self._lock:
            if self._status is None or not self._status.running:
                return False
            self._stop.set()
            self._status = replace(self._status, stop_requested=True)
            return True

    # ----- the thread --------------------------------------------------------------
    def _run(self, spec: SweepSpec, store: Store, load: Callable[[str], object]) -> None:
        try:
            with store:
                if spec.trace:
                    self._trace(spec, store, load)
                if spec.cluster is not None:
                    self._on_cluster(spec, store)
                else:
                    profile(store, spec.name, list(spec.jobs), load, spec.max_new_tokens,
                            on_start=self._runs_pending, on_run=lambda: self._item_done("run", made=True),
                            say=lambda m: self._update(current=m), guard=self._guard, turns=self._turns)
            self._end("finished")
        except _Stopped:
            self._end("stopped")
        except BaseException as e:  # noqa: BLE001 - the page shows it as one line
            self._end("failed", one_line(e))

    def _on_cluster(self, spec: SweepSpec, store: Store) -> None:
        """The runs on a Ray cluster (service/sweeps/cluster_sweep.py), this thread the store's one writer. No
        decode slot: no model runs in this process. The ETA divides by the workers by itself: a
        run's time is the time between two stored cells. Stop lets the cells in flight finish."""
        from engine.service.sweeps.cluster_sweep import profile_on_ray

        self._update(current=f"starting workers on {spec.cluster.where}")
        self._t0 = time.monotonic()

        def stored(_) -> None:
            self._item_done("run", made=True)
            self._t0 = time.monotonic()

        res = profile_on_ray(store, spec.name, list(spec.jobs), spec.pair, spec.max_new_tokens, spec.cluster,
                             on_start=self._runs_pending, on_cell=stored, stop=self._stop.is_set,
                             on_dispatch=lambda job, pid: self._update(current=job_label(job)),
                             say=lambda m: self._update(current=m))
        if res.stopped:
            raise _Stopped()

    def _trace(self, spec: SweepSpec, store: Store, load: Callable[[str], object]) -> None:
        """Traces each prompt per setting that has no trace of this length yet (trace_prompts
        resumes), one per decode slot; a tier's pair loads once."""
        pairs: dict[str, object] = {}
        for tier, kv_tier, task, prompt in trace_items(spec.jobs):
            if tier not in pairs:
                pairs.clear()  # one tier's models at a time, as profile() does
                pairs[tier] = load(tier)
            self._starting(f"trace {task} ({tier_label(tier, kv_tier)})")
            made = trace_prompts(store, pairs[tier], [(task, prompt)], spec.max_new_tokens, kv_tier=kv_tier,
                                 turns=self._turns)
            self._item_done("trace", made=bool(made))

    @contextlib.contextmanager
    def _guard(self, what: Any) -> Iterator[None]:
        """Around whatever runs the models as a whole (a cost bucket, a run's opening): stop
        between items, then the decode slot."""
        if self._stop.is_set():
            raise _Stopped()
        with decode_slot(self._who(), on_wait=lambda who: self._update(current=f"waiting for {who}")):
            self._starting(what)  # a stop pressed while it waited for the slot
            yield

    def _starting(self, what: Any) -> None:
        """An item starts: a stop pressed before it ends the sweep here; the status names it."""
        if self._stop.is_set():
            raise _Stopped()
        self._update(current=what if isinstance(what, str) else job_label(what))
        self._t0 = time.monotonic()

    def _turns(self, steps: Iterable[Any]) -> Iterator[Any]:
        """A run's or a trace's steps, a hold of the decode slot each, in turns with the sessions'
        decodes (the status already says what runs)."""
        return stepped(steps, self._who())

    def _who(self) -> str:
        """What the decode slot's "busy" line names while this sweep holds it."""
        return f"profile sweep {self._status.name if self._status else '?'}"

    def _runs_pending(self, n: int) -> None:
        """profile() found `n` jobs without a stored run: the others count as done."""
        with self._lock:
            assert self._status is not None
            already = self._left["run"] - n
            self._left["run"] = n
            self._status = replace(self._status, done=self._status.done + already)

    def _item_done(self, kind: str, made: bool) -> None:
        with self._lock:
            assert self._status is not None
            if made:
                self._seconds[kind].append(time.monotonic() - self._t0)
            self._left[kind] -= 1
            self._status = replace(self._status, done=self._status.done + 1, ran=self._status.ran + int(made))

    def _update(self, **fields: Any) -> None:
        with self._lock:
            if self._status is not None:
                self._status = replace(self._status, **fields)

    def _end(self, state: str, error: str = "") -> None:
        self._update(state=state, error=error, current="", eta_s=None, finished_at=time.time())


# The process's runner: every workbench session sees (and may stop) the same sweep.
RUNNER = SweepRunner()
