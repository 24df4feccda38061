"""Timing that can be believed (docs/architecture.md, "Costs"): medians of functions timed in turns,
each call checked for a disturbance, rounds added where they disagree, and the whole measurement
checked for a busy machine.

- A call is *disturbed* when this process was not running for much of it: its CPU time over its
  wall time (all threads, `time.process_time`) falls far below that function's usual share. A
  neighbour taking a core, a page fault storm or a sleep all look alike, and the call is timed
  again instead of entering the median.
- Rounds *disagree* when a point's interquartile range is a large share of its median: more rounds
  are timed for those points (in turns among themselves), up to twice the planned number.
- The machine is *busy* when other processes used CPU time during the measurement (Linux's
  /proc/stat, all CPUs, less this process's own): a cost table measured beside another job priced
  a plain fp32 step at 1,488 ms where the engine's steps took 210-255 ms.

Torch-free: the caller passes `sync` (a device's queue wait)."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# A call whose CPU share is under this fraction of its function's median share was disturbed.
DISTURBED_SHARE = 0.6
# Calls shorter than this are not judged: the clocks' granularity and a thread's wake-up dominate.
JUDGED_MS = 2.0
# A point whose interquartile range exceeds this share of its median gets more rounds. Quiet 2-core
# machines here time a forward with an IQR of 15-30% of its median (no process disturbing it): above
# that, the rounds disagree.
SPREAD_LIMIT = 0.30
# Other processes' CPU, in cores on average over a measurement, above which the machine was busy;
# $SPECLAB_BUSY_CORES overrides it (the test suite's two workers keep each other "busy" by design).
BUSY_CORES = 0.25
PROC_STAT = Path("/proc/stat")


@dataclass
class Timed:
    """What `timed_medians` measured: per point its median ms and relative spread (IQR / median),
    how many calls were refused as disturbed and how many rounds were added for disagreement."""

    medians: list[float]
    spreads: list[float]
    disturbed: int = 0
    added_rounds: int = 0
    samples: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def spread(self) -> float:
        """The widest relative spread among points timed at JUDGED_MS or more: how far a figure
        that decides anything may be off (a 50 µs lookup's jitter is a large share of nothing)."""
        return max((s for s, m in zip(self.spreads, self.medians) if m >= JUDGED_MS), default=0.0)


def relative_spread(ts: Sequence[float]) -> float:
    """Interquartile range over median (0 for fewer than 4 samples: no quartiles to speak of)."""
    if len(ts) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(ts, n=4)
    med = statistics.median(ts)
    return (q3 - q1) / med if med > 0 else 0.0


class _Clock:
    """Times one call: wall ms and the process's CPU share over it."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        self.sync()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        self.sync()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return wall * 1e3, (cpu / wall if wall > 0 else 0.0)


def timed_medians(timed: Sequence[tuple[Callable[[], object], Callable[[], object] | None]], reps: int, warmup: int,
                  sync: Callable[[], None] = lambda: None, rounds_of: Callable[[int], set[int] | None] = lambda i: None,
                  spread_limit: float = SPREAD_LIMIT) -> Timed:
    """Medians of (timed, then untimed) pairs called in turns: each round calls every pair (the
    second function sets up the next call: a proposer's verify) and times the first. `rounds_of(i)`
    gives the rounds pair i runs in (None: all; long reads run in a few). A disturbed call is timed
    again once in the same round; points whose rounds disagree get up to `reps` more rounds."""
    clock = _Clock(sync)
    times: list[list[float]] = [[] for _ in timed]
    shares: list[list[float]] = [[] for _ in timed]
    disturbed = 0

    def call(i: int, keep: bool) -> None:
        nonlocal disturbed
        fn, then = timed[i]
        ms, share = clock(fn)
        if keep and _is_disturbed(ms, share, shares[i]):
            disturbed += 1
            if then is not None:
                then()
            ms, share = clock(fn)  # once more: a second disturbance in a row is the machine's pace
        if keep:
            times[i].append(ms)
            shares[i].append(share)
        if then is not None:
            then()

    for r in range(warmup + reps):
        for i in range(len(timed)):
            if (few := rounds_of(i)) is None or r in few:
                call(i, r >= warmup)
    added = 0
    for _ in range(reps):  # rounds of the points that disagree, in turns among themselves
        wide = [i for i, ts in enumerate(times) if rounds_of(i) is None and relative_spread(ts) > spread_limit
                and statistics.median(ts) >= JUDGED_MS]
        if not wide:
            break
        added += 1
        for i in wide:
            call(i, True)
    return Timed([statistics.median(ts) for ts in times], [relative_spread(ts) for ts in times], disturbed, added,
                  times)


def _is_disturbed(ms: float, share: float, seen: list[float]) -> bool:
    """A call whose CPU share fell well under its function's usual one (judged once 3 are known)."""
    if ms < JUDGED_MS or len(seen) < 3:
        return False
    return share < DISTURBED_SHARE * statistics.median(seen)


# -- a busy machine -------------------------------------------------------------------------------
def _busy_cpu_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (idle and iowait left out);
    None where /proc/stat cannot be read (not Linux)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Neighbours:
    """Other processes' CPU use over a span: started at construction, read by `cores()`."""

    _wall: float = field(default_factory=time.perf_counter)
    _ours: float = field(default_factory=time.process_time)
    _all: float | None = field(default_factory=lambda: _busy_cpu_s())

    def cores(self) -> float | None:
        """Other processes' CPU time over the span, in cores on average; None where unknown."""
        now = _busy_cpu_s()
        wall = time.perf_counter() - self._wall
        if now is None or self._all is None or wall <= 0:
            return None
        theirs = (now - self._all) - (time.process_time() - self._ours)
        return max(theirs, 0.0) / wall


def busy_limit() -> float:
    """Other processes' cores above which a measurement is refused ($SPECLAB_BUSY_CORES or BUSY_CORES)."""
    raw = os.environ.get("SPECLAB_BUSY_CORES", "")
    try:
        return float(raw) if raw else BUSY_CORES
    except ValueError:
        raise ValueError(f"SPECLAB_BUSY_CORES must be a number of cores, got {raw!r}") from None


class MachineBusy(ValueError):
    """A measurement taken while other processes used the CPU: not to be stored."""

    def __init__(self, what: str, cores: float) -> None:
        super().__init__(f"{what} not kept: other processes used {cores:.2f} of a core on average while it ran "
                         f"(more than {busy_limit():g}); measure again when the machine is idle")
        self.cores = cores
