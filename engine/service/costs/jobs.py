"""A cost table measured in the background, after a run that had to start without one (a first
Generate on a fresh database reads a probe instead of waiting a minute for the table): one
measurement at a time per process, on a daemon thread, a context bucket per hold of the decode
slot (engine/lab/decode_lock.py), so that a Generate pressed meanwhile waits for one bucket at most. Any
session reads its status (the Live page shows a progress bar). Torch-free at import."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from engine.base.helpers import one_line
from engine.decode.costs import REPS
from engine.lab.decode_lock import decode_slot
from engine.service.costs.tables import cost_key, missing_buckets, stored_costs
from store import Store


@dataclass(frozen=True)
class CostStatus:
    """A snapshot: `done` of `total` context buckets measured, what it is for, how it ended."""

    label: str  # the pair and setting, for the page
    state: str  # running, finished, failed
    done: int
    total: int
    started_at: float  # time.monotonic()
    eta_s: float | None = None
    message: str = ""  # one line: the outcome, or why it failed

    @property
    def running(self) -> bool:
        return self.state == "running"


class CostMeasurer:
    """Measures and stores the buckets a pair's stored cost table lacks; every method is safe
    from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: CostStatus | None = None
        self._thread: threading.Thread | None = None

    def status(self) -> CostStatus | None:
        with self._lock:
            return self._status

    def wait(self, timeout_s: float | None = None) -> CostStatus | None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.status()

    def start(self, db: str, pair, kv_tier: str = "native", context: int | None = None) -> CostStatus | None:
        """Starts measuring what `db` lacks for runs of `pair` at `kv_tier` up to `context` tokens;
        None when nothing is lacking or a measurement already runs (one at a time)."""
        from engine.lab.whatif import tier_label

        with self._lock:
            if self._status is not None and self._status.running:
                return None
            with Store(db, wait_s=3.0) as st:
                buckets = missing_buckets(st, pair, kv_tier, context)
            if not buckets:
                return None
            label = f"{pair.target_name} at {tier_label(pair.target_tier, kv_tier)}"
            self._status = CostStatus(label, "running", 0, len(buckets), time.monotonic())
            self._thread = threading.Thread(target=self._run, args=(db, pair, kv_tier, buckets),
                                            name=f"cost table {label}", daemon=True)
            self._thread.start()
            return self._status

    def _run(self, db: str, pair, kv_tier: str, buckets: tuple[int, ...]) -> None:
        from engine.lab.profiling import measure_costs

        try:
            table = None
            for i, b in enumerate(buckets):
                with decode_slot(f"measuring the cost table (context {b})"):
                    part = measure_costs(pair, (b,), kv_tier=kv_tier)
                table = part if table is None else table.extended(part)
                self._update(done=i + 1, eta_s=self._eta(i + 1))
            with Store(db, wait_s=10.0) as st:
                stored = stored_costs(st, cost_key(pair, kv_tier))
                if stored is not None and table.buckets[0] > stored.buckets[-1]:
                    table = stored.extended(table)  # a table that lacked these buckets, extended
                st.add_costs(table.to_rows(REPS))
            self._update(state="finished", eta_s=None,
                         message=f"cost table measured for {self.status().label} ({table.describe()}) and stored: "
                                 "rakv and speckv read it from the next run")
        except BaseException as e:  # noqa: BLE001 - the page shows it as one line
            self._update(state="failed", eta_s=None, message=one_line(e))

    def _eta(self, done: int) -> float | None:
        s = self.status()
        if s is None or done == 0:
            return None
        # Later buckets are longer contexts: each costs more than the last, so the mean undershoots.
        per = (time.monotonic() - s.started_at) / done
        return per * (s.total - done) * 1.5

    def _update(self, **fields) -> None:
        with self._lock:
            if self._status is not None:
                self._status = replace(self._status, **fields)


# The process's measurer: every workbench session sees the same one.
MEASURER = CostMeasurer()
