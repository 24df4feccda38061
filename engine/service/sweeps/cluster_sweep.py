"""A profiling sweep on a Ray cluster (docs/scale.md): Ray schedules, SpecLab measures.

One actor per worker slot (a GPU, or a CPU here) loads the model pair once per tier and runs
cells, the `profiling.Job`s a serial `profile --sweep` runs, each through `service.generation.generate`
as the serial sweep does. Each result comes back to the driver as Arrow tables; the driver alone
writes DuckDB (the store's one-writer rule), cell by cell in completion order. Cells already
stored under the sweep's name are skipped exactly as `service.profile` skips them, so a rerun
resumes and adds nothing twice.

Faults: a worker that dies loses only its in-flight cell, which the driver resubmits to another
worker (actors restart, `max_restarts`; the driver, not Ray, retries the cell, so it never runs
twice at once); a cell that raises (bad input) is stored as failed with its one-line reason and
the sweep goes on; Stop finishes the cells in flight, Ctrl-C drops them, and every finished cell
is kept.

Cost tables and runs are keyed by the worker's device name and verify kernels
(`runtime.models.pair_device`): a heterogeneous cluster keeps one table per (pair, tier, KV tier,
device) and a learned policy reads the table of the device its cell runs on."""
from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.base.helpers import one_line
from engine.service.sweeps.cluster import (
    MAX_ATTEMPTS,
    MAX_RESTARTS,
    POLL_S,
    ClusterSpec,
    Finished,
    PairSpec,
    SweepResult,
    check_address,
    connect,
    local_env,
    plan_workers,
)
from engine.service.sweeps.serial import Job, failed_row, pending
from store import Store


# -- the worker --------------------------------------------------------------------------------------
@dataclass
class Preloaded:
    """The controllers a sweep's learned policies name, loaded by the driver (the workers never
    open the store); a name that could not be loaded raises the store's own message."""

    predictors: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)

    def __call__(self, name: str, version: int | None):
        if (name, version) in self.missing:
            raise ValueError(self.missing[(name, version)])
        assert (name, version) in self.predictors, f"controller {name} v{version} was not preloaded"
        return self.predictors[(name, version)]


class Worker:
    """A Ray actor's body (wrapped by `ray.remote` when a sweep starts): one pair at a time,
    loaded once per tier; every result is plain data or Arrow tables."""

    def __init__(self, pair: PairSpec, max_new_tokens: int) -> None:
        self.spec, self.max_new_tokens = pair, max_new_tokens
        self.tier: str | None = None
        self.pair = None

    def _pair(self, tier: str):
        if tier != self.tier:
            self.pair, self.tier = None, None  # one tier's models at a time
            self.pair, self.tier = self.spec.load(tier), tier
        return self.pair

    def describe(self, tier: str) -> dict:
        """Loads `tier`'s pair (a bad model fails now, in one line) and says what runs here."""
        from engine.oracles import available
        from engine.runtime.models import pair_device

        pair = self._pair(tier)
        return dict(pid=os.getpid(), host=socket.gethostname(), device=pair_device(pair),
                    target=pair.target_name, draft=pair.draft_name, draft_tier=pair.draft_tier,
                    proposers=list(available(pair)))

    def costs(self, tier: str, kv_tier: str):
        """Measures this device's cost table (service.cost_table's measurement) as Arrow rows."""
        import pyarrow as pa

        from engine.decode.costs import REPS
        from engine.lab.profiling import measure_costs

        pair = self._pair(tier)
        table = measure_costs(pair, kv_tier=kv_tier)
        return pa.Table.from_pylist(table.to_rows(REPS))

    def run(self, job: Job, context) -> tuple:
        """One cell: ("ok", pid, runs table, steps table) or ("failed", pid, its one-line reason)."""
        import pyarrow as pa

        from engine.service.generation import Request, generate

        try:
            pair = self._pair(job.tier)
            req = Request(job.prompt, job.policy, task=job.task, max_new_tokens=self.max_new_tokens, kv_tier=job.kv_tier)
            _, kept = generate(pair, req, None, context=context)
            row, steps = kept.row, kept.steps
        except Exception as e:  # noqa: BLE001 - bad input: stored as a failed cell, the sweep goes on
            return ("failed", os.getpid(), one_line(e))
        return ("ok", os.getpid(), pa.Table.from_pylist([row]), pa.Table.from_pylist(steps))


# -- the driver --------------------------------------------------------------------------------------
def check_reuse(st: Store, sweep: str, jobs: list[Job], max_new_tokens: int, names: dict | None = None) -> None:
    """A sweep name resumes only its own cells: stored runs of it that are not among `jobs`, or
    of another length or pair, are a ValueError (nothing is run, nothing stored changes)."""
    runs = st.runs(sweep=sweep)
    if not len(runs):
        return
    keys = {j.key for j in jobs}
    rows = runs.to_dict("records")
    other = [r for r in rows if (r["target_tier"], r["kv_tier"] if isinstance(r["kv_tier"], str) else "native",
                                 r["prompt"], r["policy"]) not in keys]
    if other:
        r = other[0]
        raise ValueError(f"sweep {sweep!r} already holds {len(other)} run(s) of other cells (e.g. {r['policy']} on "
                         f"{r['prompt'][:30]!r} at {r['target_tier']}): rerun it with its own cells or name this "
                         "sweep differently")
    lengths = {int(x) for x in runs["max_new_tokens"].dropna()}
    if lengths - {max_new_tokens}:
        raise ValueError(f"sweep {sweep!r} was run with max new tokens {sorted(lengths)[0]}, not {max_new_tokens}: "
                         "rerun it with its own length or name this sweep differently")
    if names is not None:
        pairs = set(zip(runs["target"], runs["draft"])) - {(names["target"], names["draft"])}
        if pairs:
            t, d = sorted(pairs)[0]
            raise ValueError(f"sweep {sweep!r} holds runs of {t} + {d}, not {names['target']} + {names['draft']}: "
                             "name this sweep differently")


class RaySweep:
    """One sweep on a cluster, driven from this process (the only writer of `st`). `run()` does
    it; `on_dispatch(job, pid)` and `on_cell(Finished)` report progress; `stop()` returning True
    ends it once the cells in flight are stored."""

    def __init__(self, st: Store, sweep: str, jobs: list[Job], pair: PairSpec, max_new_tokens: int,
                 cluster: ClusterSpec = ClusterSpec(), on_start: Callable[[int], None] = lambda n: None,
                 on_cell: Callable[[Finished], None] = lambda f: None,
                 on_dispatch: Callable[[Job, int], None] = lambda job, pid: None,
                 say: Callable[[str], None] = lambda m: None, stop: Callable[[], bool] = lambda: False) -> None:
        cluster.check()
        if not sweep.strip():
            raise ValueError("a sweep needs a name (its runs are stored under it; the same name resumes)")
        self.st, self.sweep, self.jobs, self.pair, self.max_new_tokens = st, sweep, list(jobs), pair, max_new_tokens
        self.cluster, self.on_start, self.on_cell, self.on_dispatch = cluster, on_start, on_cell, on_dispatch
        self.say, self.stop = say, stop
        self.result = SweepResult()
        self.actors: list = []
        self.info: list[dict] = []  # per worker: describe() (pid, device, names)
        self.alive: list[bool] = []
        self.deaths: list[int] = []
        self.contexts: dict[tuple, Any] = {}  # (tier, KV tier, device) → PolicyContext or None
        self.attempts: dict[tuple, int] = {}
        self.avoid: dict[tuple, set[int]] = {}

    # ----- the whole sweep ----------------------------------------------------------------------------
    def run(self) -> SweepResult:
        from engine.service.sweeps.serial import stored_keys

        t0 = time.monotonic()
        if self.cluster.address:  # a wrong address is said now, even when nothing is left to run
            check_address(self.cluster.address)
        check_reuse(self.st, self.sweep, self.jobs, self.max_new_tokens)
        todo = pending(self.jobs, stored_keys(self.st, self.sweep))
        self.on_start(len(todo))
        if not todo:
            return self.result
        import ray

        started = connect(self.cluster)
        try:
            self._start_workers(todo[0].tier)
            self.result.start_s = time.monotonic() - t0
            check_reuse(self.st, self.sweep, self.jobs, self.max_new_tokens, self.info[0])
            self._drive(deque(todo))
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            if started:
                ray.shutdown()
            self.result.wall_s = time.monotonic() - t0
        return self.result

    def _start_workers(self, tier: str) -> None:
        """One actor per worker slot, each with the first tier's pair loaded; ValueError in one
        line for a cluster that cannot hold them or a pair that does not load."""
        import ray

        n, gpus = plan_workers(self.cluster, ray.nodes())
        env = local_env() if not self.cluster.address else None
        remote = ray.remote(Worker).options(num_cpus=self.cluster.worker_cpus, num_gpus=gpus,
                                            max_restarts=MAX_RESTARTS, max_task_retries=0, runtime_env=env)
        self.say(f"starting {n} worker(s) of {self.cluster.worker_cpus:g} CPU + {gpus:g} GPU on {self.cluster.where}")
        self.actors = [remote.remote(self.pair, self.max_new_tokens) for _ in range(n)]
        refs = [a.describe.remote(tier) for a in self.actors]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.cluster.start_timeout_s)
        if waiting:
            raise ValueError(f"{len(waiting)} of {n} worker(s) did not start on {self.cluster.where} within "
                             f"{self.cluster.start_timeout_s:g} s (resources held by another job?)")
        try:
            self.info = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise ValueError(f"a worker cannot load the pair: {one_line(e.cause if e.cause else e)}") from None
        self.alive, self.deaths = [True] * n, [0] * n
        self.result.workers = self.info

    # ----- dispatching --------------------------------------------------------------------------------
    def _drive(self, queue: deque) -> None:
        """Keeps every alive worker busy with a cell, stores results as they come."""
        import ray

        in_flight: dict = {}  # ref → (worker, job)
        busy: set[int] = set()
        while queue or in_flight:
            if not self.stop():
                for w in [w for w in range(len(self.actors)) if self.alive[w] and w not in busy]:
                    job = self._next_for(w, queue)
                    if job is None:
                        continue
                    ref = self.actors[w].run.remote(job, self._context(job, w))
                    in_flight[ref] = (w, job)
                    busy.add(w)
                    self.on_dispatch(job, self.info[w]["pid"])
            elif not in_flight:
                self.result.stopped = True
                return
            if not in_flight:
                if not any(self.alive):
                    raise RuntimeError(f"every worker died; {len(queue)} cell(s) not run: rerun the sweep "
                                       f"{self.sweep!r} to resume")
                continue
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
            for ref in ready:
                w, job = in_flight.pop(ref)
                busy.discard(w)
                self._collect(ref, w, job, queue)

    def _next_for(self, w: int, queue: deque) -> Job | None:
        """The first queued cell this worker may take: one it has not died on, unless every
        alive worker has (then any); a cell of its loaded tier is not preferred: order is kept."""
        alive = {i for i, a in enumerate(self.alive) if a}
        for i, job in enumerate(queue):
            avoid = self.avoid.get(job.key, set())
            if w not in avoid or alive <= avoid:
                del queue[i]
                return job
        return None

    def _collect(self, ref, w: int, job: Job, queue: deque) -> None:
        """Stores a finished cell, or resubmits it when its worker died."""
        import ray

        self.attempts[job.key] = self.attempts.get(job.key, 0) + 1
        try:
            out = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as e:
            self._lost(w, job, queue, one_line(e, 160))
            return
        except ray.exceptions.RayTaskError as e:  # not an Exception the worker could catch
            out = ("failed", self.info[w]["pid"], one_line(e.cause if e.cause else e))
        self._store(w, job, out)

    def _lost(self, w: int, job: Job, queue: deque, why: str) -> None:
        """A worker died with `job` in flight: the cell goes back to the queue's front, for
        another worker; the actor restarts until MAX_RESTARTS, then is dropped."""
        self.deaths[w] += 1
        if self.deaths[w] > MAX_RESTARTS:
            self.alive[w] = False
        tries = self.attempts[job.key]
        if tries >= MAX_ATTEMPTS:
            self._store(w, job, ("failed", self.info[w]["pid"], f"its worker died {tries} times: {why}"))
            return
        self.result.retried += 1
        self.avoid.setdefault(job.key, set()).add(w)
        queue.appendleft(job)
        self.say(f"worker {w} died running {job.policy} on {job.prompt[:30]!r}; resubmitted")

    def _store(self, w: int, job: Job, out: tuple) -> None:
        """The driver's one write per cell (validated by the store, committed at once)."""
        pid = self.info[w]["pid"] = out[1]  # a restarted actor is a new process
        if out[0] == "ok":
            row, steps = out[2].to_pylist()[0], out[3].to_pylist()
            error = None
        else:
            row, steps, error = failed_row(job, self.info[w], out[2], self.max_new_tokens), [], out[2]
            self.result.failed += 1
        t0 = time.monotonic()
        self.st.add_run(dict(row, sweep=self.sweep), steps)
        self.result.store_s += time.monotonic() - t0
        self.result.ran += 1
        self.on_cell(Finished(job, w, pid, error, self.attempts[job.key]))

    # ----- learned policies ---------------------------------------------------------------------------
    def _context(self, job: Job, w: int):
        """The PolicyContext of the job's setting on this worker's device, made once per setting
        and device before its first cell (as `service.profile` makes it before a setting's runs):
        None when no cell of that setting needs one."""
        from engine.decode.policies import NEEDS_CONTEXT, parse_policy

        info = self.info[w]
        key = (job.tier, job.kv_tier, info["device"])
        if key not in self.contexts:
            learned = [j.policy for j in self.jobs if (j.tier, j.kv_tier) == key[:2]
                       and parse_policy(j.policy)[0] in NEEDS_CONTEXT]
            self.contexts[key] = self._make_context(key, info, learned, w) if learned else None
        return self.contexts[key]

    def _make_context(self, key: tuple, info: dict, specs: list[str], w: int):
        """Cost table (stored for this device, else measured on this worker and stored), the
        controllers the specs name (loaded here), the stored acceptance priors."""
        import ray

        from engine.decode.costs import CostTable
        from engine.decode.policies import PolicyContext, make_policy
        from engine.service.costs.tables import acceptance_priors, controller_loader, key_of, stored_costs

        tier, kv_tier, device = key
        cost_key = key_of(device=device, target=info["target"], draft=info["draft"], target_tier=tier,
                          draft_tier=info["draft_tier"], kv_tier=kv_tier)
        table = stored_costs(self.st, cost_key)
        if table is None or not set(info["proposers"]) <= set(table.proposers):
            self.say(f"measuring costs for {info['target']} at {tier}/{kv_tier} on {device} (once; stored)…")
            rows = ray.get(self.actors[w].costs.remote(tier, kv_tier)).to_pylist()
            self.st.add_costs(rows)
            table = CostTable.from_rows(rows)
        priors = acceptance_priors(self.st, cost_key, info["proposers"])
        load, pre = controller_loader(self.st), Preloaded()

        def record(name: str, version: int | None):
            try:
                pre.predictors[(name, version)] = load(name, version)
            except ValueError as e:
                pre.missing[(name, version)] = str(e)
                raise
            return pre.predictors[(name, version)]

        for spec in dict.fromkeys(specs):
            try:
                make_policy(spec, PolicyContext(costs=table, controller=record, priors=priors))
            except ValueError:
                pass  # the cell fails on its worker with the same message, and is stored as failed
        return PolicyContext(costs=table, controller=pre, alpha0=priors.get("draft"), priors=priors)


def profile_on_ray(st: Store, sweep: str, jobs: list[Job], pair: PairSpec, max_new_tokens: int,
                   cluster: ClusterSpec = ClusterSpec(), **callbacks: Any) -> SweepResult:
    """`service.profile` on a cluster: the sweep's jobs without a stored run, one cell per
    worker at a time, each stored by this process as it finishes. Returns what it did."""
    return RaySweep(st, sweep, jobs, pair, max_new_tokens, cluster, **callbacks).run()


