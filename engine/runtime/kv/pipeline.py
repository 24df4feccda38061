"""The restore pipeline, modelled (plain Python: the tuner and the pages use it without torch).

A link moves windows one after another; the restoring thread computes μ of window i (it needs
no data) once window i-1 is done, then decodes window i when it has arrived (engine/runtime/kv/offload.py
runs exactly this, with a fetch thread for the link)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Link:
    """A modelled link: each transfer waits latency + bytes / bandwidth."""

    gbit_s: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbit_s > 0 or self.latency_ms < 0:
            raise ValueError(f"a link needs a bandwidth > 0 Gbit/s and a latency ≥ 0 ms, got {self.gbit_s}, {self.latency_ms}")

    def seconds(self, nbytes: int) -> float:
        return self.latency_ms / 1e3 + nbytes * 8 / (self.gbit_s * 1e9)


def pipelined_seconds(transfer: list[float], mu: list[float], decode: list[float]) -> float:
    """A restore's makespan: the link moves windows one after another; the caller's thread
    computes μ of window i (no data needed) after window i-1 is done, then decodes window i
    once it has arrived and its μ is ready."""
    link_free = done = 0.0
    for t, m, d in zip(transfer, mu, decode):
        link_free += t
        done = max(done + m, link_free) + d
    return done


def crossing_gbit_s(gap: Callable[[float], float]) -> float:
    """The bandwidth where `gap(b)` (coded − raw restore seconds, rising with b) crosses zero,
    by bisection on log bandwidth: inf if coding always wins, 0 if it never does."""
    lo, hi = 1e-4, 1e5
    if gap(hi) < 0:
        return float("inf")
    if gap(lo) > 0:
        return 0.0
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return (lo * hi) ** 0.5


def breakeven_gbit_s(coded_sizes: list[int], raw_sizes: list[int], mu: list[float], decode: list[float],
                     latency_ms: float = 0.0) -> float:
    """The link bandwidth above which moving the raw stored bytes restores faster than the
    coded pipeline (below it coding wins)."""
    def gap(b: float) -> float:
        link = Link(b, latency_ms)
        return pipelined_seconds([link.seconds(n) for n in coded_sizes], mu, decode) - sum(link.seconds(n) for n in raw_sizes)

    return crossing_gbit_s(gap)
