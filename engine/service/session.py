"""A live decode on a thread of its own, for the workbench's Live page: the page starts it, polls
its snapshot to draw, and Stop sets an event the decode checks between two steps. The decode does
not run in the page's script because a Streamlit fragment's own button never preempts the
fragment's run (its rerun waits for the run to end): a Stop must reach a decode that is elsewhere.
Here it is heard within one step, and the run is then stored like any other. Leaving the page does
not end the run either.

The run takes the process's decode slot (engine/lab/decode_lock.py) one step at a time, in turns with
the other sessions' decodes, reads what its policy needs without measuring anything (a missing
cost table is probed in seconds, inside the slot; nothing else runs the models before the
prefill, so the opening takes no turn), and after the run, where the costs were probed or lack the
contexts the run reached, starts the background cost measurement (service/costs/jobs.py).
Torch-free at import."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.base.helpers import one_line
from engine.decode.policies import NEEDS_CONTEXT, parse_policy
from engine.lab.decode_lock import decode_slot, queued, stepped
from engine.service.costs.jobs import MEASURER
from engine.service.costs.tables import reach, would_probe
from engine.service.generation import Request, Stored, check, keep, open_generation, store_outcome

LIVE = "a live decode"  # what the decode slot says holds it


def load_for_turns(target: str | None, draft: str | None, target_tier: str, engine: str = "torch"):
    """The workbench's pair: loaded on the process's intra-op thread count, its layers passing a
    point where a long decode turn may pause (engine/runtime/preempt.py), then probed in the
    background, a hold of the decode slot per step behind the sessions' openings, for whether its
    decodes come out the same on one thread (engine/lab/thread_probe.py). Decode turns drop to one
    thread under CPU pressure only once every pair loaded passed (engine/runtime/kernels/threads.py)."""
    import torch

    from engine.runtime import preempt
    from engine.runtime.kernels import threads
    from engine.runtime.models import load_pair

    cores = threads.state().cores
    torch.set_num_threads(cores)  # a page's thread that began during a one-thread turn started on one
    pair = load_pair(target, draft, target_tier=target_tier, engine=engine)
    for model in (pair.target, pair.draft):  # a long turn may pause at a layer for a session's opening
        if model is not None:
            preempt.at_layers(model)
    label = f"{pair.target_name} + {pair.draft_name} ({pair.target_tier}, {pair.engine})"
    threads.note_pair(label, False)  # until the probe says otherwise
    threading.Thread(target=_probe_threads, args=(pair, label, cores), name=f"thread probe {label}",
                     daemon=True).start()
    return pair


def shared_prefix_cache(budget_bytes: int):
    """The prefix cache the workbench's sessions share for a pair: evictions spill to a temporary
    folder, raw, under four times the budget (engine/runtime/prefix_cache.spilling)."""
    from engine.runtime.prefix.cache import spilling

    return spilling(budget_bytes)


def device_label() -> str:
    """The device the workbench's models run on (CUDA when present)."""
    from engine.runtime.models import resolve_device

    return str(resolve_device(None))


def _probe_threads(pair, label: str, cores: int) -> None:
    from engine.lab.thread_probe import thread_invariant
    from engine.runtime.kernels.threads import note_pair

    try:
        invariant = thread_invariant(pair, cores, lambda: decode_slot(f"checking {label} on one thread"))
    except Exception:  # noqa: BLE001 - a pair the probe cannot run keeps every core
        invariant = False
    note_pair(label, invariant)


@dataclass
class LiveSnapshot:
    """What the page draws: the state (waiting, running, finished, stopped, failed), the steps so
    far (each a StepRecord's fields and the policy's `why`), the token ids, and at the end the
    summary and where the run was stored."""

    state: str
    steps: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    waiting_for: str = ""  # what holds the decode slot while this waits for it
    costs: str = ""  # where the policy's costs come from (costs.CostTable.describe)
    error: str = ""
    summary: dict | None = None
    stored: Stored | None = None
    seed: int | None = None
    kv_bytes_per_token: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    turns_ms: float = 0.0  # how long it waited, after its first turn, while other decodes took theirs

    @property
    def done(self) -> bool:
        return self.state in ("finished", "stopped", "failed")


class LiveRun:
    """One generation of one session, on a daemon thread. Every method is safe from any thread."""

    def __init__(self, pair, req: Request, db: str, prefix=None, history=None) -> None:
        check(req, pair.engine)  # a bad spec or setting fails here, in the page, before anything starts
        self.pair, self.req, self.db, self.prefix, self.history = pair, req, db, prefix, history
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._snap = LiveSnapshot("waiting")
        self._thread = threading.Thread(target=self._run, name="live decode", daemon=True)

    def start(self) -> "LiveRun":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the generation after the step in progress; what it made is kept and stored."""
        self._stop.set()

    def snapshot(self) -> LiveSnapshot:
        with self._lock:
            s = self._snap
            return LiveSnapshot(s.state, list(s.steps), list(s.token_ids), s.waiting_for, s.costs, s.error,
                                s.summary, s.stored, s.seed, s.kv_bytes_per_token, s.started_at, s.turns_ms)

    def shared(self) -> bool:
        """Whether other decodes wait for the model now (this run takes turns with them)."""
        return queued() > 0

    def wait(self, timeout_s: float | None = None) -> LiveSnapshot:
        self._thread.join(timeout_s)
        return self.snapshot()

    def _set(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self._snap, k, v)

    def _run(self) -> None:
        try:
            stamps: list[float] = []  # when it joined the queue for its first turn
            turns: list[float] = []  # each turn's wait for the model, the first one's first
            if would_probe(self.db, self.pair, self.req.policy, self.req.kv_tier):  # a probe runs the models
                t0 = time.monotonic()
                with decode_slot(LIVE, self._waiting, on_queued=stamps.append, opening=True):
                    self._turn(turns, (time.monotonic() - t0) * 1e3)
                    gen = self._open()
            else:  # nothing runs the models before the prefill, its first turn
                gen = self._open()
            self._set(costs=gen.policy.costs.describe() if hasattr(gen.policy, "costs") else "", seed=gen.seed)
            self._decode(gen, turns, stamps)
            kept = keep(gen, self.req)
            # How long this run waited for the model: for its first turn, and in its later turns
            # while other sessions' steps ran (bench load reads both).
            kept.row["config"] = dict(kept.row["config"], queued_at=stamps[0], queue_ms=round(turns[0], 1),
                                      turns_ms=round(sum(turns[1:]), 1))
            stored = store_outcome(self.db, kept.row, kept.steps) if self.db else Stored(None, "warning", "not stored: no database")
            self._set(state="stopped" if gen.summary.stop_reason == "stopped" else "finished",
                      summary=asdict(gen.summary), stored=stored, kv_bytes_per_token=gen.kv_bytes_per_token,
                      turns_ms=sum(turns[1:]))
            self._measure_after(gen)
        except BaseException as e:  # noqa: BLE001 - the page shows it as one line
            self._set(state="failed", error=one_line(e))

    def _open(self):
        return open_generation(self.pair, self.req, self.db, prefix=self.prefix, history=self.history, measure=False)

    def _waiting(self, busy: str) -> None:
        self._set(waiting_for=busy)

    def _turn(self, turns: list[float], ms: float) -> None:
        turns.append(ms)
        if len(turns) == 1:  # its first turn: it runs from here
            self._set(state="running", waiting_for="")

    def _decode(self, gen, turns: list[float], stamps: list[float]) -> None:
        first = not turns  # no turn taken for its opening
        it = stepped(gen, LIVE, self._waiting if first else lambda busy: None, lambda ms: self._turn(turns, ms),
                     stamps.append if first else lambda at: None, opening=first)
        for rec in it:
            row = asdict(rec)
            row["why"] = getattr(gen.policy, "why", "") if rec.step else "prefill"
            with self._lock:
                self._snap.steps.append(row)
                self._snap.token_ids.extend(rec.token_ids)
            if self._stop.is_set():
                it.close()  # Generation keeps what ran as a run stopped early
                break

    def _measure_after(self, gen) -> None:
        """Where the policy read probed costs, or a table short of the contexts this run reached,
        the table is measured now in the background (a Generate pressed meanwhile waits a bucket)."""
        name = parse_policy(self.req.policy)[0]
        if name not in NEEDS_CONTEXT or not self.db:
            return
        MEASURER.start(self.db, self.pair, self.req.kv_tier, reach(len(gen.prompt_ids), self.req.max_new_tokens))


def start_live(pair, req: Request, db: str, prefix=None, history=None) -> LiveRun:
    """A live run started on its own thread (the page keeps it in its session)."""
    return LiveRun(pair, req, db, prefix, history).start()
