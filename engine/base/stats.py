"""Intervals for the benchmarks' ratios: a speed ratio over a set of prompts, and how far it
could move were the prompts drawn again (the bootstrap over prompts, percentile interval)."""
from __future__ import annotations

import math

import numpy as np

BOOTSTRAP_DRAWS = 2000  # the interval's ends move by < 0.2% between seeds at this many draws
SEED = 0  # a fixed draw: the same runs always print the same interval


def speed_ratio(tokens_a: np.ndarray, ms_a: np.ndarray, tokens_b: np.ndarray, ms_b: np.ndarray) -> float:
    """(Σ tokens_a / Σ ms_a) / (Σ tokens_b / Σ ms_b): tokens per second of A over B's, the same
    prompts, each prompt weighed by its time as the benchmark's totals weigh it."""
    return float((tokens_a.sum() / ms_a.sum()) / (tokens_b.sum() / ms_b.sum()))


def ratio_ci95(tokens_a, ms_a, tokens_b, ms_b, draws: int = BOOTSTRAP_DRAWS, strata=None) -> tuple[float, float]:
    """The 95% percentile interval of `speed_ratio` over prompts drawn with replacement; each
    array holds one value per prompt, aligned (prompt i of A is prompt i of B: the pairing is
    what makes the interval narrow, a prompt's own difficulty cancels in its ratio). strata: a
    label per prompt (its task) where the sample holds a fixed number of each: each draw then
    takes that many of each, as the sample was made, and the spread between tasks, which no draw
    of the design could change, stays out of the interval."""
    arrays = [np.asarray(x, dtype=float) for x in (tokens_a, ms_a, tokens_b, ms_b)]
    n = len(arrays[0])
    assert n > 0 and all(len(x) == n for x in arrays), [len(x) for x in arrays]
    rng = np.random.default_rng(SEED)
    if strata is None:
        idx = rng.integers(0, n, size=(draws, n))  # [draws, n]
    else:
        labels = np.asarray(list(strata))
        assert len(labels) == n, (len(labels), n)
        groups = [np.flatnonzero(labels == g) for g in dict.fromkeys(labels.tolist())]
        idx = np.concatenate([g[rng.integers(0, len(g), size=(draws, len(g)))] for g in groups], axis=1)
    ta, ma, tb, mb = (x[idx].sum(axis=1) for x in arrays)  # [draws] each
    ratios = (ta / ma) / (tb / mb)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def prompts_for(interval: tuple[float, float], ratio: float, n: int, half_width: float = 0.03) -> int:
    """Prompts the bootstrap over `n` prompts would need for its 95% interval around `ratio` to be
    within ±half_width of it: an interval's width shrinks as 1/√n (the spread of the per-prompt
    ratios, which it measures, staying what it is). n itself when it already is."""
    lo, hi = interval
    assert n > 0 and ratio > 0 and hi >= lo, (interval, ratio, n)
    widest = max(hi - ratio, ratio - lo) / ratio  # the interval is not symmetric: its wider side
    return max(n, math.ceil(n * (widest / half_width) ** 2))


def geomean(values) -> float:
    """The geometric mean (of per-task ratios: a 2× task and a 0.5× task average to 1×)."""
    v = np.asarray(list(values), dtype=float)
    assert len(v) and (v > 0).all(), v
    return float(np.exp(np.log(v).mean()))
