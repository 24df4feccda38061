"""Intra-op threads that give way while the CPU is wanted elsewhere.

torch runs each op on an OpenMP team of one thread per core, whose members meet at the op's end.
When other work wants those cores (other sessions' pages, browsers on the same machine, a
neighbour process), the scheduler parks a member and the whole team waits for it, op after op: a
decode turn then takes many times its share of the CPU, and every session in the decode queue
waits behind it (docs/benchmarks.md, bench load). On one thread nothing waits at a barrier.

So each decode turn of the workbench (engine/lab/decode_lock.stepped) runs under `turn_threads()`: while
the kernel says some task waited for a CPU for at least CONTENDED of the last second
(/proc/pressure/cpu, sampled by a daemon thread), the turn runs on one thread, and turns stay
there HOLD_S after the pressure was last seen. Outputs do not change: turns leave all the cores
only while every pair the process loaded reads bitwise the same on one thread and on all (the
workbench probes each pair as it loads it: engine/lab/thread_probe.py). Without PSI, on a GPU, or
with one core, turns keep every core.

Between two turns of a running decode the workbench also gives way (`give_way`): while some task
waited for a CPU nearly all of the last second (EXTREME), the decode's next turn waits (for how
long at most, engine/lab/decode_lock.stepped says), so pages that sessions opened (and their browsers,
where they share the machine) get the cores first. Its first turn never waits, nor does anyone
queued behind it: the decode waits before it queues."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

# Some task waited this share of the last second for a CPU: the cores are oversubscribed most of
# the time, not only while a page draws (one browser beside a decode stays under it; eight do not).
CONTENDED = 0.5
# Some task waited this share of the last second for a CPU: the cores are taken by more than the
# decode can share them with (a burst of sessions' pages drawn at once; docs/benchmarks.md).
EXTREME = 0.9
HOLD_S = 1.0  # once pressure is seen, turns stay on one thread this long (one noisy second is not calm)
PERIOD_S = 0.1  # how often the pressure is sampled: a turn's decision reads no older than this
WINDOW_S = 1.0  # the span the share is taken over: long enough for the PSI counter's ticks to mean something
_PSI = "/proc/pressure/cpu"


def cpu_stall_s(path: str = _PSI) -> float | None:
    """Seconds some task has waited for a CPU since boot (PSI's "some total"); None where the
    kernel does not say (no PSI, or switched off)."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
        if not fields or fields[0] != b"some":
            return None
        return int(fields[-1].split(b"=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


class Pressure:
    """The share of the last WINDOW_S in which some task waited for a CPU, from samples of a
    stall counter taken every PERIOD_S by a daemon thread (started by the first `share()`)."""

    def __init__(self, read: Callable[[], float | None] = cpu_stall_s, clock: Callable[[], float] = time.monotonic,
                 period_s: float = PERIOD_S, window_s: float = WINDOW_S) -> None:
        self._read, self._clock, self.period_s, self.window_s = read, clock, period_s, window_s
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.available = read() is not None

    def sample(self) -> None:
        """One sample of the counter; those older than the window's span go."""
        stall = self._read()
        if stall is None:
            return
        now = self._clock()
        with self._lock:
            self._samples.append((now, stall))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()

    def share(self) -> float:
        """Stalled seconds per second over the samples held (0.0 before two samples)."""
        if self._thread is None and self.available:
            self._thread = threading.Thread(target=self._loop, name="cpu pressure", daemon=True)
            self._thread.start()
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def _loop(self) -> None:
        while True:
            self.sample()
            time.sleep(self.period_s)


class TurnThreads:
    """The thread count of the next decode turn: all the cores, or one while the CPU is under
    pressure (and HOLD_S after). One per process: decode turns run one at a time (the decode slot)."""

    def __init__(self, cores: int, pressure: Pressure, clock: Callable[[], float] = time.monotonic,
                 contended: float = CONTENDED, hold_s: float = HOLD_S) -> None:
        self.cores, self.pressure, self._clock = cores, pressure, clock
        self.contended, self.hold_s = contended, hold_s
        self._single_until = float("-inf")
        self.turns: dict[int, int] = {}  # turns run at each thread count

    @property
    def enabled(self) -> bool:
        return self.cores > 1 and self.pressure.available

    def next(self) -> int:
        if not self.enabled:
            return self.cores
        now = self._clock()
        if self.pressure.share() >= self.contended:
            self._single_until = now + self.hold_s
        n = 1 if now < self._single_until else self.cores
        self.turns[n] = self.turns.get(n, 0) + 1
        return n

    def give_way(self, most_s: float, sleep: Callable[[float], None] = time.sleep, extreme: float = EXTREME) -> float:
        """Waits while the CPU's pressure is at least `extreme`, at most `most_s`; returns the
        seconds waited."""
        if not self.enabled:
            return 0.0
        t0 = self._clock()
        while self.pressure.share() >= extreme:
            left = most_s - (self._clock() - t0)
            if left < 0.01:  # shorter is not worth a wake-up
                break
            sleep(min(self.pressure.period_s, left))
        return self._clock() - t0


_LOCK = threading.Lock()
_STATE: list[TurnThreads | None] = [None]
_PAIRS: dict[str, bool] = {}  # each pair the process loaded (by its label): reads the same on any thread count


def state() -> TurnThreads:
    with _LOCK:
        if _STATE[0] is None:
            _STATE[0] = TurnThreads(torch.get_num_threads(), Pressure())
        return _STATE[0]


def note_pair(label: str, invariant: bool) -> None:
    """A pair loaded (the workbench's: engine.service.ready_pair): turns may leave the cores only
    while every pair noted was found thread-invariant."""
    with _LOCK:
        _PAIRS[label] = invariant


def may_drop() -> bool:
    """Whether a turn may run on fewer threads: some pair noted, and every one invariant."""
    with _LOCK:
        return bool(_PAIRS) and all(_PAIRS.values())


def give_way(most_s: float, turns: Callable[[], TurnThreads] = state) -> float:
    """Before a running decode's next turn in the workbench (a pair noted, every one invariant:
    a CLI's decode never waits): TurnThreads.give_way. Returns the seconds waited."""
    return turns().give_way(most_s) if may_drop() else 0.0


@contextlib.contextmanager
def turn_threads(turns: Callable[[], TurnThreads] = state) -> Iterator[int]:
    """One decode turn on the thread count the CPU's pressure calls for; yields it. The calling
    thread gets its own count back after (OpenMP's count is per thread)."""
    t = turns()
    n = t.next() if may_drop() else t.cores
    if n == torch.get_num_threads():
        yield n
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(t.cores)
