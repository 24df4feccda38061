"""The seed notes' preset for the KV tuner (a band of tier, coding, W and γ per context and link)
and the places where a measured recommendation contradicts it. Plain Python."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from engine.service.kv.figures import (
    FAST_GBIT_S,
    GAMMA_SLACK,
    GOALS,
    MAX_CONTEXT,
    MAX_LINK_GBIT_S,
    SEED_MEMORY_RATIO,
    SLOW_LINK_GBIT_S,
    WINDOW_SLACK,
    fmt,
    ratio_of,
)


# -- the seed notes' preset ----------------------------------------------------------------------
@dataclass(frozen=True)
class SeedBand:
    label: str
    window: tuple[int, int]
    gamma: tuple[int, int]


# (exclusive upper context bound, band): < 8K, 8K–64K, > 64K.
SEED_BANDS: tuple[tuple[float, SeedBand], ...] = (
    (8192, SeedBand("< 8K", (512, 1024), (2, 4))),
    (65536 + 1, SeedBand("8K–64K", (1024, 2048), (4, 6))),
    (math.inf, SeedBand("> 64K", (2048, 4096), (6, 8))),
)


def seed_band(context: int) -> SeedBand:
    """The seed's context band: contexts < 8K, 8K–64K (inclusive), > 64K."""
    return next(band for bound, band in SEED_BANDS if context < bound)


@dataclass(frozen=True)
class Recommendation:
    """One tuning: the KV tier, coding on/off, W, the γ range, and for each choice the figure that
    decided it (`why`, keyed kv_tier, coded, window, gamma). `figures` keeps the numbers behind them
    (bits, acceptance, tok/s, modelled restores) for `contradictions` and the page; `notes` says what
    the measurement lacked."""

    kv_tier: str
    coded: bool
    window: int
    gamma_lo: int
    gamma_hi: int
    why: dict[str, str]
    source: str  # "measured" | "seed"
    context: int = 0
    link_gbit_s: float = 0.0
    goal: str = ""
    window_range: tuple[int, int] | None = None  # the seed's W range; None for a measured W
    figures: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-safe values (an infinite break-even becomes None)."""
        return _json_safe(asdict(self))


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Mapping):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def check_inputs(context: int, link_gbit_s: float, goal: str) -> None:
    """User input, refused in one precise line (ValueError)."""
    if isinstance(context, bool) or not isinstance(context, numbers.Integral) and not (
            isinstance(context, float) and context.is_integer()):
        raise ValueError(f"context must be a whole number of tokens, got {context!r}")
    if not 1 <= context <= MAX_CONTEXT:
        raise ValueError(f"context must be from 1 to {MAX_CONTEXT} tokens, got {int(context)}")
    if isinstance(link_gbit_s, bool) or not isinstance(link_gbit_s, numbers.Real) \
            or not math.isfinite(link_gbit_s) or not 0 < link_gbit_s <= MAX_LINK_GBIT_S:
        raise ValueError(f"link bandwidth must be > 0 and ≤ {MAX_LINK_GBIT_S:g} Gbit/s, got {link_gbit_s!r}")
    if goal not in GOALS:
        raise ValueError(f"unknown goal {goal!r}; use one of {', '.join(GOALS)}")


def seed_preset(context: int, link_gbit_s: float, goal: str) -> Recommendation:
    """The seed notes' rules, with nothing measured: W and γ by context band; memory → FP8 KV plus
    speculative coding (6–8×); latency → FP16 (native) KV plus adaptive γ, no coding, except on a
    cross-datacenter link (< 10 Gbit/s): the full coding pipeline, which the notes ask for when the
    ratio is at least B_fast/B_slow (B_fast = 100 Gbit/s, the fast tier)."""
    check_inputs(context, link_gbit_s, goal)
    context = int(context)
    band = seed_band(context)
    need = FAST_GBIT_S / link_gbit_s
    slow = link_gbit_s < SLOW_LINK_GBIT_S
    kv, coded, kv_why, coded_why = {
        "memory": ("fp8", True, "seed: FP8 KV plus speculative coding for memory (6–8× under FP16)",
                   "seed: speculative coding for memory"),
        "latency": ("native", slow, "seed: FP16 (native) KV plus adaptive γ for latency",
                    f"seed: full coding pipeline on a cross-datacenter link (< {SLOW_LINK_GBIT_S:g} Gbit/s) when "
                    f"the ratio ≥ B_fast/B_slow = {FAST_GBIT_S:g}/{link_gbit_s:g} = {need:.3g}×" if slow else
                    f"seed: no coding for latency on a fast link (≥ {SLOW_LINK_GBIT_S:g} Gbit/s)"),
    }[goal]
    lo, hi = band.window
    return Recommendation(
        kv_tier=kv, coded=coded, window=min(lo, context), gamma_lo=band.gamma[0], gamma_hi=band.gamma[1],
        why=dict(kv_tier=kv_why, coded=coded_why,
                 window=f"seed: W {lo}–{hi} for contexts {band.label}" + (f" (capped at the context, {context})"
                                                                          if context < lo else ""),
                 gamma=f"seed: γ {band.gamma[0]}–{band.gamma[1]} for contexts {band.label}"),
        source="seed", context=context, link_gbit_s=float(link_gbit_s), goal=goal, window_range=band.window,
        figures=dict(band=band.label, required_ratio=need if slow and goal == "latency" else None),
    )


# -- where the measurement contradicts the seed ----------------------------------------------------
def _gamma_text(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _contradict_kv(ours: Recommendation, seed: Recommendation) -> list[str]:
    if ours.kv_tier == seed.kv_tier:
        return []
    rule = {"memory": "fp8 KV + coding for memory", "latency": "native (FP16) KV for latency"}[ours.goal]
    return [f"seed: {rule}; measured: {ours.why.get('kv_tier', ours.kv_tier)}"]


def _contradict_coding(ours: Recommendation, seed: Recommendation) -> list[str]:
    f, out = ours.figures, []
    be = f.get("breakeven_gbit_s", {})
    be_v = be.get("measured") if be.get("measured") is not None else be.get("modelled")
    r = f.get("restore", {})
    times = (f" ({fmt(r.get('raw_s'))} s raw vs {fmt(r.get('coded_s'))} s coded for {ours.context} tokens)"
             if r.get("raw_s") is not None and r.get("coded_s") is not None else "")
    link = f"{ours.link_gbit_s:g} Gbit/s"
    if seed.coded and not ours.coded and ours.link_gbit_s < SLOW_LINK_GBIT_S and ours.goal == "latency":
        out.append(f"seed: coding for cross-datacenter links; measured break-even {fmt(be_v)} Gbit/s, below this "
                   f"{link} link: raw transfer restores faster{times}")
    elif seed.coded and not ours.coded:
        out.append(f"seed: coding for {ours.goal}; measured: {ours.why.get('coded', 'coding does not pay')}")
    elif ours.coded and not seed.coded:
        out.append(f"seed: no coding for latency on a fast link; measured: coded restore is faster at {link} "
                   f"(break-even {fmt(be_v)} Gbit/s){times}")
    need = seed.figures.get("required_ratio")
    tb = f.get("bits", {}).get(ours.kv_tier, {})
    ratio = ratio_of(tb.get("raw"), tb.get("coded"))
    if need and ours.coded and ratio is not None and ratio < need:
        out.append(f"seed: code a cross-datacenter link when the ratio ≥ B_fast/B_slow = {need:.3g}×; measured: "
                   f"{ours.kv_tier}+coding at {ratio:.2g}× already restores faster than raw{times}")
    return out


def _contradict_ratio(ours: Recommendation) -> list[str]:
    if ours.goal != "memory":
        return []
    b = ours.figures.get("bits", {})
    native, fp8 = b.get("native", {}).get("raw"), b.get("fp8", {}).get("coded")
    ratio = ratio_of(native, fp8)
    lo, hi = SEED_MEMORY_RATIO
    if ratio is None or lo <= ratio <= hi:
        return []
    return [f"seed: FP8 + coding {lo:g}–{hi:g}× under FP16; measured fp8+coding {ratio:.1f}× "
            f"({fmt(fp8)} vs {fmt(native)} bits/scalar)"]


def _contradict_window(ours: Recommendation, seed: Recommendation) -> list[str]:
    lo, hi = seed.window_range or (seed.window, seed.window)
    if not ours.figures.get("window_decided") or lo <= ours.window <= hi:
        return []
    rows = ours.figures.get("restore_by_window", [])
    inside = [r for r in rows if lo <= r["window"] <= hi and r.get("coded_s") is not None]
    if not inside:  # the seed's range was not measured, or does not fit the context: nothing to hold against it
        return []
    mine = next((r for r in rows if r["window"] == ours.window), {})
    theirs = min(inside, key=lambda r: r["coded_s"])
    if mine.get("coded_s") is None or theirs["coded_s"] <= (1 + WINDOW_SLACK) * mine["coded_s"]:
        return []
    return [f"seed: W {lo}–{hi} for {seed.figures.get('band', '')}; measured best W {ours.window} at "
            f"{ours.link_gbit_s:g} Gbit/s (restore {fmt(mine.get('coded_s'))} s vs {fmt(theirs['coded_s'])} s at "
            f"W {theirs['window']})"]


def _contradict_gamma(ours: Recommendation, seed: Recommendation) -> list[str]:
    if not ours.figures.get("gamma_measured") or not (ours.gamma_hi < seed.gamma_lo or ours.gamma_lo > seed.gamma_hi):
        return []
    tps = ours.figures.get("tokens_per_s", {})
    at = f"{ours.figures.get('target_tier', '')}/{ours.kv_tier}"
    rule = f"seed: γ {seed.gamma_lo}–{seed.gamma_hi} for {seed.figures.get('band', '')}"
    seed_pol = next((p for p in (f"fixed:{g}" for g in range(seed.gamma_lo, seed.gamma_hi + 1)) if p in tps), None)
    if ours.gamma_hi == 0:
        vs = ratio_of(tps.get(seed_pol), tps.get("ar")) if seed_pol else None
        return [f"{rule}; measured: speculation does not pay at {at} (best γ 0"
                + (f", {seed_pol} {vs:.2f}× ar" if vs is not None else "") + ")"]
    best = max(tps, key=tps.get) if tps else None
    return [f"{rule}; measured: γ {_gamma_text(ours.gamma_lo, ours.gamma_hi)} within {GAMMA_SLACK:.0%} of the best at {at}"
            + (f" ({best} {tps[best]:.3g} tok/s" + (f"; {seed_pol} {tps[seed_pol] / tps[best]:.2f}× of it" if seed_pol else "")
               + ")" if best else "")]


def contradictions(ours: Recommendation, seed: Recommendation) -> list[str]:
    """Where our measurement contradicts the seed's rule, one line each: the KV tier, coding, the
    seed's memory ratio, W, γ. Nothing for a recommendation that is itself the seed's."""
    if ours.source != "measured":
        return []
    return (_contradict_kv(ours, seed) + _contradict_coding(ours, seed) + _contradict_ratio(ours)
            + _contradict_window(ours, seed) + _contradict_gamma(ours, seed))


def _cells() -> dict[str, tuple[str, Callable[[Recommendation], str]]]:
    """Row label → (`why` key, the cell's text of a recommendation)."""
    def coding(r: Recommendation) -> str:
        return "on" if r.coded else "off"

    def window(r: Recommendation) -> str:
        return f"{r.window_range[0]}–{r.window_range[1]}" if r.window_range else str(r.window)

    return {"KV tier": ("kv_tier", lambda r: r.kv_tier), "coding": ("coded", coding), "W": ("window", window),
            "γ": ("gamma", lambda r: _gamma_text(r.gamma_lo, r.gamma_hi))}


def comparison_rows(ours: Recommendation, seed: Recommendation) -> list[dict[str, str]]:
    """The two-column table: choice | measured | seed | why (ours)."""
    return [dict(choice=name, measured=fn(ours), seed=fn(seed), why=ours.why.get(key, ""))
            for name, (key, fn) in _cells().items()]


def seed_rows(seed: Recommendation) -> list[dict[str, str]]:
    """The seed preset alone, before anything is measured: choice | seed | why (the seed's rule)."""
    return [dict(choice=name, seed=fn(seed), why=seed.why.get(key, "")) for name, (key, fn) in _cells().items()]
