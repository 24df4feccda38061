"""The Runs page's data shaping, over Store.runs() and Store.steps() DataFrames: filters, the
acceptance-against-signal points and bins, the best fixed γ per tier × task, tokens/s per policy,
and the download bytes. pandas and numpy only (no torch, no streamlit), so it is tested alone."""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from datetime import date

import numpy as np
import pandas as pd

MAX_POINTS = 5000  # scatter points drawn at most (a browser slows past a few thousand)
_FIXED = re.compile(r"^fixed:(\d+)$")


# -- labels ------------------------------------------------------------------------------------------
def pair_labels(runs: pd.DataFrame) -> pd.Series:
    """`target ← draft` per run: the model pair, one name."""
    if not len(runs):
        return pd.Series([], dtype=object)
    return runs["target"].fillna("?").astype(str) + " ← " + runs["draft"].fillna("?").astype(str)


def tier_labels(runs: pd.DataFrame) -> pd.Series:
    """`fp32`, or `fp32/fp8` off the native KV tier (as engine/lab/whatif.py's tier_label names them)."""
    if not len(runs):
        return pd.Series([], dtype=object)
    kv = runs["kv_tier"].fillna("native") if "kv_tier" in runs else pd.Series("native", index=runs.index)
    tier = runs["target_tier"].fillna("?").astype(str)
    return tier.where(kv == "native", tier + "/" + kv.astype(str))


def tasks(runs: pd.DataFrame) -> pd.Series:
    """The task of each run, '-' where none was given (live runs have none)."""
    return runs["task"].fillna("-").astype(str) if len(runs) else pd.Series([], dtype=object)


def gamma_of(policy: str) -> int | None:
    """The fixed γ a policy decodes with: k for `fixed:k`, 0 for `ar`, None for adaptive ones."""
    if policy == "ar":
        return 0
    m = _FIXED.match(policy or "")
    return int(m.group(1)) if m else None


# -- filters ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Filters:
    """What the page's filter widgets chose; an empty tuple filters nothing."""

    pairs: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    policies: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    since: date | None = None  # inclusive, by the run's created_at date
    until: date | None = None  # inclusive


def options(runs: pd.DataFrame) -> dict[str, list]:
    """The choices each filter offers (sorted), and the first and last run date."""
    if not len(runs):
        return dict(pairs=[], tiers=[], policies=[], tasks=[], dates=(None, None))
    days = pd.to_datetime(runs["created_at"]).dt.date
    return dict(pairs=sorted(set(pair_labels(runs))), tiers=sorted(set(tier_labels(runs))),
                policies=sorted(set(runs["policy"].astype(str))), tasks=sorted(set(tasks(runs))),
                dates=(days.min(), days.max()))


def filter_runs(runs: pd.DataFrame, f: Filters) -> pd.DataFrame:
    """The runs that pass every chosen filter."""
    if not len(runs):
        return runs
    keep = np.ones(len(runs), dtype=bool)
    for chosen, values in ((f.pairs, pair_labels(runs)), (f.tiers, tier_labels(runs)),
                           (f.policies, runs["policy"].astype(str)), (f.tasks, tasks(runs))):
        if chosen:
            keep &= values.isin(chosen).to_numpy()
    days = pd.to_datetime(runs["created_at"]).dt.date
    if f.since is not None:
        keep &= (days >= f.since).to_numpy()
    if f.until is not None:
        keep &= (days <= f.until).to_numpy()
    return runs[keep]


def steps_of(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The steps of these runs, with each run's policy, tier and task beside them (for colour)."""
    if not len(steps) or not len(runs):
        return steps.iloc[0:0]
    meta = pd.DataFrame({"run_id": runs["run_id"].to_numpy(), "policy": runs["policy"].to_numpy(),
                         "tier": tier_labels(runs).to_numpy(), "task": tasks(runs).to_numpy()})
    cols = [c for c in steps.columns if c not in ("policy", "tier", "task")]
    return steps[cols].merge(meta, on="run_id", how="inner")


# -- acceptance against the draft's signals ----------------------------------------------------------------
def acceptance_points(steps: pd.DataFrame, cap: int = MAX_POINTS, seed: int = 0) -> pd.DataFrame:
    """Steps that drafted: acceptance (accepted / k_drafted) beside the draft's mean entropy and
    mean confidence, a seeded sample of at most `cap` (the same points on every rerun)."""
    cols = ["acceptance", "mean_entropy", "mean_confidence", "k_drafted", "policy", "tier", "task"]
    if not len(steps):
        return pd.DataFrame(columns=cols)
    s = steps[(steps["k_drafted"] > 0) & steps["mean_entropy"].notna() & steps["mean_confidence"].notna()]
    s = s.assign(acceptance=s["accepted"] / s["k_drafted"])
    if len(s) > cap:
        s = s.sample(n=cap, random_state=seed)
    return s[[c for c in cols if c in s.columns]].reset_index(drop=True)


def acceptance_bins(points: pd.DataFrame, signal: str, bins: int = 10) -> pd.DataFrame:
    """Mean acceptance per equal-width bin of `signal` (mean_entropy or mean_confidence):
    bin centre, mean acceptance, steps in the bin; empty bins left out. Bins of all the drafting
    steps show the trend a scatter of thousands of 0/1-ish points hides."""
    if signal not in ("mean_entropy", "mean_confidence"):
        raise ValueError(f"bin acceptance by mean_entropy or mean_confidence, not {signal!r}")
    out_cols = [signal, "acceptance", "steps"]
    if not len(points):
        return pd.DataFrame(columns=out_cols)
    x = points[signal].astype(float).to_numpy()
    lo, hi = float(np.min(x)), float(np.max(x))
    if hi <= lo:  # one value: one bin
        return pd.DataFrame({signal: [lo], "acceptance": [float(points["acceptance"].mean())], "steps": [len(points)]})
    edges = np.linspace(lo, hi, bins + 1)
    idx = np.clip(np.digitize(x, edges[1:-1]), 0, bins - 1)
    g = pd.DataFrame({"bin": idx, "acceptance": points["acceptance"].to_numpy()}).groupby("bin")["acceptance"]
    mean, count = g.mean(), g.size()
    centres = (edges[:-1] + edges[1:]) / 2
    return pd.DataFrame({signal: centres[mean.index], "acceptance": mean.to_numpy(), "steps": count.to_numpy()})


# -- γ and speed -----------------------------------------------------------------------------------------
def gamma_speeds(runs: pd.DataFrame) -> pd.DataFrame:
    """tokens/s per (tier, task, γ) over the runs of fixed-γ policies (`ar` is γ 0): all tokens
    over all wall time, so a long run weighs what it cost."""
    cols = ["tier", "task", "gamma", "tokens_per_s", "runs"]
    if not len(runs):
        return pd.DataFrame(columns=cols)
    g = runs["policy"].astype(str).map(gamma_of)
    ok = g.notna() & (runs["wall_ms"] > 0) if "wall_ms" in runs else g.notna()
    if "error" in runs:
        ok &= runs["error"].isna()
    if not ok.any():
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame({"tier": tier_labels(runs)[ok], "task": tasks(runs)[ok], "gamma": g[ok].astype(int),
                       "n_tokens": runs["n_tokens"][ok], "wall_ms": runs["wall_ms"][ok]})
    agg = df.groupby(["tier", "task", "gamma"], as_index=False).agg(
        n_tokens=("n_tokens", "sum"), wall_ms=("wall_ms", "sum"), runs=("n_tokens", "size"))
    agg["tokens_per_s"] = agg["n_tokens"] / (agg["wall_ms"] / 1e3)
    return agg[cols]


def best_gamma(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (tier, task): the γ of the fastest fixed-γ policy (0 = ar), its tokens/s, and how
    many γ values were measured there (one γ alone is no choice)."""
    cols = ["tier", "task", "best_gamma", "tokens_per_s", "gammas"]
    speeds = gamma_speeds(runs)
    if not len(speeds):
        return pd.DataFrame(columns=cols)
    i = speeds.groupby(["tier", "task"])["tokens_per_s"].idxmax()
    best = speeds.loc[i, ["tier", "task", "gamma", "tokens_per_s"]].rename(columns={"gamma": "best_gamma"})
    n = speeds.groupby(["tier", "task"]).size().rename("gammas").reset_index()
    return best.merge(n, on=["tier", "task"]).reset_index(drop=True)[cols]


def best_gamma_grid(best: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(best γ, tokens/s) as tier × task grids for the heatmap (NaN where nothing was measured)."""
    if not len(best):
        return pd.DataFrame(), pd.DataFrame()
    gamma = best.pivot(index="tier", columns="task", values="best_gamma").astype(float)
    tps = best.pivot(index="tier", columns="task", values="tokens_per_s").astype(float)
    return gamma, tps


def speed_by_policy(runs: pd.DataFrame) -> pd.DataFrame:
    """tokens/s per (policy, tier): all tokens over all wall time, with the run count and the
    median of the runs' own tokens/s (one slow run shows as the gap between the two)."""
    cols = ["policy", "tier", "tokens_per_s", "median_run_tokens_per_s", "runs"]
    if not len(runs):
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame({"policy": runs["policy"].astype(str), "tier": tier_labels(runs),
                       "n_tokens": runs["n_tokens"], "wall_ms": runs["wall_ms"], "tps": runs["tokens_per_s"]})
    df = df[df["wall_ms"] > 0]
    agg = df.groupby(["policy", "tier"], as_index=False).agg(
        n_tokens=("n_tokens", "sum"), wall_ms=("wall_ms", "sum"),
        median_run_tokens_per_s=("tps", "median"), runs=("tps", "size"))
    agg["tokens_per_s"] = agg["n_tokens"] / (agg["wall_ms"] / 1e3)
    return agg.sort_values(["tier", "tokens_per_s"], ascending=[True, False]).reset_index(drop=True)[cols]


# -- downloads ---------------------------------------------------------------------------------------------
def to_csv_bytes(df: pd.DataFrame) -> bytes:
    """CSV (UTF-8); list columns are written as their Python text."""
    return df.to_csv(index=False).encode("utf-8")


def to_parquet_bytes(df: pd.DataFrame) -> bytes:
    """Parquet via pyarrow, list columns kept as lists (what a notebook wants back)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False), buf)
    return buf.getvalue()
