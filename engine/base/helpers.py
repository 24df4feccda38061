"""Small helpers every layer shares, torch-free: the default database, one-line errors (the
store's formatter), the median timer, comma lists."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

from store.errors import one_line  # noqa: F401  (re-exported: one formatter for every layer)

DEFAULT_DB = "speclab.duckdb"


def default_db() -> str:
    """The database every command, page and benchmark uses unless told: $SPECLAB_DB, else
    speclab.duckdb in the working directory."""
    return os.environ.get("SPECLAB_DB") or DEFAULT_DB


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 0,
              sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of `fn()` in ms over `reps` timed calls after `warmup` untimed ones.
    `sync` waits for queued device work (CUDA is asynchronous) before each clock read."""
    return medians_ms([fn], reps, warmup, sync)[0]


def medians_ms(fns: Sequence[Callable[[], object]], reps: int, warmup: int = 0,
               sync: Callable[[], None] = lambda: None) -> list[float]:
    """`median_ms` of each of `fns`, timed in turns (one call of each per round): on a shared
    machine whose speed drifts over seconds, timing one function after another would put the
    drift into their ratios (a verify of 2 tokens measured "cheaper" than one of 1)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (None: the same); a list that ends while
    the other goes on differs at its end."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
