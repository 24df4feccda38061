"""The joint KV tuner (issue 12): from a stored `bench kv` measurement, which KV tier to hold, whether
to code it, the restore window W and the range of draft lengths γ, for one context length, link
bandwidth and goal; beside the seed notes' preset, and where the measurement contradicts it.

Plain Python on purpose (no torch, no numpy): the CLI's `tune`, the KV & prefetch page and the tests
read a measurement's JSON (`kv_measurements.result`, written by `bench/kv.py`) and model restores with
the arithmetic of engine/kv/offload.py's `pipelined_seconds`, re-done here so that nothing here needs
a model. Every key of a measurement may be missing: a choice that lacks its figure falls back to the
seed's rule and says so (in `why` and `notes`), never a KeyError.

The rules (`recommend`):

- **memory**: the tier × coding with the fewest bits per scalar whose draft acceptance stays within
  `ACCEPTANCE_SLACK` (0.03) of native's at the target tier; a cheaper option that loses more is
  skipped (and named). Native is always allowed; a lossy tier whose acceptance was not measured is not
  (it cannot be vouched for).
- **latency**: the KV tier whose best measured tokens/s (over `ar` and `fixed:k`) at the target tier
  is highest; native on a tie or when no tok/s was stored. Coding only if the modelled restore of the
  whole context at this link is faster coded than raw.
- **W**: among the measured `by_window` widths that fit the context (W ≤ context), the one whose
  modelled coded restore at this link is shortest (ties: the larger W, fewer windows). A raw restore
  at latency 0 does not depend on W, so uncoded, W is the measured width nearest the seed's range.
- **γ**: every γ (`ar` = 0, `fixed:k` = k) whose tokens/s at the chosen KV tier is within
  `GAMMA_SLACK` (3 %) of the best; the range is their min..max.

The restore model (`restore_seconds`): N context tokens in windows of W; the link moves windows one
after another at `link_gbit_s` (latency 0); per window the caller computes μ (the predictor) and
decodes, `mu_s_per_token·w` and `decode_s_per_token·w`; coded makespan = `pipelined_seconds`, raw =
the sum of the transfers. A window's coded size and decode time scale from the tier's headline figures
by the `by_window` row of that W (its bits and decode MB/s against the headline ones), and by the
predictor's figures when another predictor than the measured best is chosen."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from engine.base.names import EMBEDDED_LABEL, KV_TIERS
from engine.runtime.kv.pipeline import crossing_gbit_s, pipelined_seconds

GOALS = ("latency", "memory")
SOURCES = ("measured", "seed")
MAX_CONTEXT = 1 << 22  # 4 Mi tokens: beyond any model this workbench loads
MAX_LINK_GBIT_S = 10_000.0  # 10 Tbit/s
FAST_GBIT_S = 100.0  # B_fast of the seed notes: the fast tier a slow link is compared with
SLOW_LINK_GBIT_S = 10.0  # below this a link counts as cross-datacenter (the seed's "slow" case)
ACCEPTANCE_SLACK = 0.03  # a lossy KV tier may cost this much draft acceptance against native
GAMMA_SLACK = 0.03  # γ values within 3 % of the best tok/s are equally good
WINDOW_SLACK = 0.03  # a W whose modelled restore is within 3 % of the best is no contradiction
SEED_MEMORY_RATIO = (6.0, 8.0)  # the seed's claim: FP8 KV plus speculative coding, 6–8× under FP16


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


# -- reading a measurement (every key may be missing) --------------------------------------------
def _num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, Mapping) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _map(d: Any, key: str) -> Mapping:
    v = d.get(key) if isinstance(d, Mapping) else None
    return v if isinstance(v, Mapping) else {}


def _rows(d: Any, key: str) -> list[Mapping]:
    v = d.get(key) if isinstance(d, Mapping) else None
    return [r for r in v if isinstance(r, Mapping)] if isinstance(v, list) else []


# Headline keys of the measurement, per (tier, coded), when `tiers[t]` lacks them.
_HEADLINE_BITS = {("native", True): "native_bits", ("fp8", False): "fp8_bits", ("fp8", True): "fp8_bits_coded",
                  ("int8", False): "int8_bits", ("int8", True): "int8_bits_coded"}
# The coded bits of a tier in a `predictors[p]`, `by_window` or `by_context` row.
_CODED_KEY = {"native": "native_bits", "fp8": "fp8_bits_coded", "int8": "int8_bits_coded"}


def bits(m: Mapping, tier: str, coded: bool, predictor: str | None = None) -> float | None:
    """Bits per scalar at rest of `tier`, raw or coded (coded: with `predictor`, default the best)."""
    best = m.get("best_predictor")
    if coded and predictor and predictor != best:
        return _num(_map(_map(m, "predictors"), predictor), _CODED_KEY[tier])
    own = _num(_map(_map(m, "tiers"), tier), "bits_coded" if coded else "bits")
    return own if own is not None else _num(m, _HEADLINE_BITS.get((tier, coded), ""))


def zstd_bits(m: Mapping, tier: str) -> float | None:
    return _num(m, f"zstd19_{tier}_bits")


def speeds(m: Mapping, predictor: str | None = None) -> dict[str, float | None]:
    """Encode/decode MB/s of the predictor (default the measured best's headline figures)."""
    p = _map(_map(m, "predictors"), predictor) if predictor and predictor != m.get("best_predictor") else {}
    return {k: _num(p, k) if p else _num(m, k) for k in ("encode_mb_s", "decode_mb_s")}


def _x(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0.0) else None


def bits_rows(m: Mapping, predictor: str | None = None) -> list[dict[str, Any]]:
    """Per KV tier: bits per scalar raw and coded (the predictor's), zstd-19 beside, and each as a
    ratio to native raw (the seed's "× under FP16")."""
    native = bits(m, "native", False)
    out = []
    for t in KV_TIERS:
        raw, coded, z = bits(m, t, False), bits(m, t, True, predictor), zstd_bits(m, t)
        out.append(dict(kv_tier=t, raw_bits=raw, coded_bits=coded, zstd19_bits=z,
                        raw_ratio=_x(native, raw), coded_ratio=_x(native, coded), zstd19_ratio=_x(native, z)))
    return out


@dataclass(frozen=True)
class TierCost:
    """What restoring one token of a tier costs: bytes raw and coded at rest, μ and decode seconds."""

    raw_bytes: float | None
    coded_bytes: float | None
    mu_s: float
    decode_s: float


def _window_row(m: Mapping, window: int | None) -> Mapping:
    return next((r for r in _rows(m, "by_window") if _num(r, "window") == window), {}) if window else {}


def tier_cost(m: Mapping, tier: str, predictor: str | None = None, window: int | None = None
              ) -> tuple[TierCost, list[str]]:
    """The tier's per-token restore inputs at window `window` and `predictor`, and what was scaled or
    assumed. The headline figures are the best predictor's at the measured window; another predictor
    scales the coded size by its bits and the decode time by its MB/s, a `by_window` row the same way
    (a tier without its own bits in that row follows native's)."""
    t = _map(_map(m, "tiers"), tier)
    notes: list[str] = []
    coded = _num(t, "coded_bytes_per_token")
    decode = _num(t, "decode_s_per_token")
    mu = _num(t, "mu_s_per_token")
    if mu is None or decode is None:
        notes.append(f"{tier}: μ/decode seconds per token not stored (taken as 0)")
    decode = decode or 0.0
    best = m.get("best_predictor")
    ref_bits, ref_speed = bits(m, tier, True), speeds(m)["decode_mb_s"]
    if predictor and predictor != best and coded is not None:
        p_bits, p_speed = bits(m, tier, True, predictor), speeds(m, predictor)["decode_mb_s"]
        coded = coded * p_bits / ref_bits if p_bits and ref_bits else coded
        decode = decode * ref_speed / p_speed if ref_speed and p_speed else decode
        if not (p_bits and ref_bits):
            notes.append(f"{tier}: no bits for predictor {predictor}: the best predictor's size used")
    row = _window_row(m, window)
    if row and coded is not None and window != _num(m, "window"):
        key, base = _CODED_KEY[tier], ref_bits
        if _num(row, key) is None:  # the sweep did not measure this tier: follow native's change
            key, base = "native_bits", bits(m, "native", True)
        w_bits = _num(row, key)
        coded = coded * w_bits / base if w_bits and base else coded
        w_speed = _num(row, "decode_mb_s")
        decode = decode * ref_speed / w_speed if w_speed and ref_speed else decode
    return TierCost(_num(t, "bytes_per_token"), coded, mu or 0.0, decode), notes


def windows(context: int, window: int) -> list[int]:
    """Window sizes covering `context` tokens: full windows of W, then the rest."""
    full, rest = divmod(context, max(1, min(window, context)))
    return [min(window, context)] * full + ([rest] if rest else [])


def _link_s(nbytes: float, gbit_s: float) -> float:
    return nbytes * 8 / (gbit_s * 1e9)


def restore_seconds(cost: TierCost, context: int, window: int, link_gbit_s: float, coded: bool) -> float | None:
    """Modelled restore of `context` tokens in windows of W over the link (latency 0): raw = the
    transfers back to back; coded = the pipelined makespan. None when the size was not measured."""
    size = cost.coded_bytes if coded else cost.raw_bytes
    if size is None:
        return None
    ws = windows(context, window)
    transfer = [_link_s(size * w, link_gbit_s) for w in ws]
    if not coded:
        return sum(transfer)
    return pipelined_seconds(transfer, [cost.mu_s * w for w in ws], [cost.decode_s * w for w in ws])


def modelled_breakeven(cost: TierCost, context: int, window: int) -> float | None:
    """The link bandwidth above which raw restores faster than coded (offload.py's
    `breakeven_gbit_s`, on the model): inf if coding always wins, 0 if it never does."""
    if cost.raw_bytes is None or cost.coded_bytes is None:
        return None

    return crossing_gbit_s(lambda b: restore_seconds(cost, context, window, b, True)
                           - restore_seconds(cost, context, window, b, False))


def measured_breakeven(m: Mapping, tier: str) -> float | None:
    """The bench's own break-even for the tier (at its context and window)."""
    return _num(_map(_map(m, "tiers"), tier), "breakeven_gbit_s")


def measured_windows(m: Mapping) -> list[int]:
    ws = sorted({int(w) for w in (_num(r, "window") for r in _rows(m, "by_window")) if w and w >= 1})
    return ws or ([int(_num(m, "window"))] if _num(m, "window") else [])


# -- acceptance and γ ----------------------------------------------------------------------------
def gamma_of(policy: str) -> int | None:
    """γ of a stored policy name: ar = 0, fixed:k = k; others (adaptive) None."""
    if policy == "ar":
        return 0
    name, _, k = policy.partition(":")
    return int(k) if name == "fixed" and k.isdigit() else None


def acceptance_rows(m: Mapping) -> list[dict[str, Any]]:
    """The stored acceptance entries, flat: target tier, KV tier, acceptance, best γ, best vs ar and
    tok/s per policy."""
    out = []
    for r in _rows(m, "acceptance"):
        tps = {str(k): _num(_map(r, "tokens_per_s"), k) for k in _map(r, "tokens_per_s")}
        out.append(dict(target_tier=r.get("target_tier"), kv_tier=r.get("kv_tier"), acceptance=_num(r, "acceptance"),
                        best_gamma=_num(r, "best_gamma"), best_vs_ar=_num(r, "best_vs_ar"),
                        **{f"tok/s {k}": v for k, v in tps.items()}))
    return out


def _acceptance_at(m: Mapping, target_tier: str) -> dict[str, Mapping]:
    """KV tier → the acceptance entry at this target tier (the newest entry wins)."""
    return {r["kv_tier"]: r for r in _rows(m, "acceptance")
            if r.get("target_tier") == target_tier and r.get("kv_tier") in KV_TIERS}


def _gamma_tps(entry: Mapping) -> dict[int, float]:
    out = {}
    for policy, v in _map(entry, "tokens_per_s").items():
        g, x = gamma_of(str(policy)), _num(_map(entry, "tokens_per_s"), policy)
        if g is not None and x is not None:
            out[g] = x
    return out


def _policy(g: int) -> str:
    return "ar" if g == 0 else f"fixed:{g}"


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else ("∞" if math.isinf(x) else format(x, spec))


# -- the recommendation --------------------------------------------------------------------------
@dataclass
class _Ctx:
    """One `recommend` call's inputs and what it has learnt so far."""

    m: Mapping
    context: int
    link: float
    goal: str
    target_tier: str
    acc: dict[str, Mapping]
    why: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def label(self, tier: str) -> str:
        return f"{self.target_tier}/{tier}"


def _option(tier: str, coded: bool) -> str:
    return f"{tier}{'+coding' if coded else ' raw'}"


def _memory_tier(c: _Ctx) -> tuple[str, bool]:
    """Fewest bits per scalar among tier × coding within the acceptance slack of native."""
    native_raw = bits(c.m, "native", False)
    native_acc = _num(c.acc.get("native"), "acceptance")

    def refusal(tier: str) -> str | None:  # why a lossy tier may not be chosen; None: it may
        acc = _num(c.acc.get(tier), "acceptance")
        if tier == "native":
            return None
        if acc is None or native_acc is None:
            return f"acceptance at {c.label(tier if acc is None else 'native')} not measured"
        return None if acc >= native_acc - ACCEPTANCE_SLACK else f"acceptance {acc:.2f}, {native_acc - acc:.2f} below native"

    options = sorted(((b, t, coded) for t in KV_TIERS for coded in (True, False)
                      if (b := bits(c.m, t, coded)) is not None), key=lambda o: (o[0], KV_TIERS.index(o[1])))
    chosen = next((o for o in options if refusal(o[1]) is None), None)
    if chosen is None:
        c.notes.append("no admissible KV tier with measured bits per scalar: native raw by default")
        c.why["kv_tier"] = "no admissible tier with measured bits per scalar: native (the model's dtype)"
        c.why["coded"] = "no coded size measured for native"
        return "native", False
    b, t, coded = chosen
    skipped = [f"{_option(t_, k)} {_fmt(b_)} skipped: {refusal(t_)}" for b_, t_, k in options[:options.index(chosen)]
               if refusal(t_) is not None]
    ratio, acc = _x(native_raw, b), _num(c.acc.get(t), "acceptance")
    acc_text = (f"; acceptance at {t} {_fmt(acc, '.2f')} vs native {_fmt(native_acc, '.2f')}" if t != "native"
                else f"; acceptance at native {_fmt(native_acc, '.2f')}")
    c.why["kv_tier"] = (f"{_option(t, coded)} {_fmt(b)} bits/scalar vs native {_fmt(native_raw)}"
                        + (f" ({ratio:.1f}× smaller)" if ratio else "") + acc_text
                        + ("; " + "; ".join(skipped) if skipped else ""))
    c.why["coded"] = (f"coded {_fmt(bits(c.m, t, True))} vs raw {_fmt(bits(c.m, t, False))} bits/scalar at {t}: "
                      + ("fewer bits at rest" if coded else "coding does not shrink it"))
    return t, coded


def _latency_tier(c: _Ctx) -> str:
    """The KV tier with the best measured tok/s at the target tier (native on a tie)."""
    best = {t: max(_gamma_tps(e).items(), key=lambda kv: kv[1], default=None) for t, e in c.acc.items()}
    best = {t: b for t, b in best.items() if b is not None}
    c.figures["best_tokens_per_s"] = {t: {"policy": _policy(g), "tokens_per_s": v} for t, (g, v) in best.items()}
    if not best:
        c.notes.append(f"no tok/s per γ stored at {c.target_tier}: native (the seed's) for latency")
        c.why["kv_tier"] = f"no tok/s measured at {c.target_tier}: native, as the seed says"
        return "native"
    tier = max(best, key=lambda t: (best[t][1], -KV_TIERS.index(t)))
    others = ", ".join(f"{t} {v:.3g} ({_policy(g)})" for t, (g, v) in best.items() if t != tier)
    g, v = best[tier]
    c.why["kv_tier"] = f"{tier} fastest at {c.target_tier}: {v:.3g} tok/s ({_policy(g)})" + (f" vs {others}" if others else "")
    return tier


def _restore_by_window(c: _Ctx, tier: str) -> list[dict[str, Any]]:
    """Modelled restore of the context at each measured W that fits it (W ≤ context)."""
    ws = [w for w in measured_windows(c.m) if w <= c.context] or [c.context]
    out = []
    for w in ws:
        cost, notes = tier_cost(c.m, tier, window=w)
        c.notes.extend(n for n in notes if n not in c.notes)
        out.append(dict(window=w, coded_s=restore_seconds(cost, c.context, w, c.link, True),
                        raw_s=restore_seconds(cost, c.context, w, c.link, False)))
    return out


def _nearest_to(ws: Sequence[int], lo: int, hi: int) -> int:
    return min(ws, key=lambda w: (0 if lo <= w <= hi else min(abs(w - lo), abs(w - hi)), -w))


def _window_and_coding(c: _Ctx, tier: str, want_coded: bool | None) -> tuple[int, bool]:
    """W (and, for latency, coding): the measured W with the shortest modelled coded restore; coded
    for latency only when that restore beats the raw transfer at this link. `want_coded` is the
    memory goal's fixed decision (None: decide here)."""
    rows = _restore_by_window(c, tier)
    c.figures["restore_by_window"] = rows
    timed = [r for r in rows if r["coded_s"] is not None]
    band = seed_band(c.context)
    if not measured_windows(c.m):
        c.notes.append("no W sweep (by_window) stored")
    best = min(timed, key=lambda r: (r["coded_s"], -r["window"])) if timed else None
    cost, _ = tier_cost(c.m, tier, window=best["window"] if best else None)
    be_meas, be_model = measured_breakeven(c.m, tier), None
    if best is not None:
        be_model = modelled_breakeven(cost, c.context, best["window"])
    c.figures["breakeven_gbit_s"] = {"measured": be_meas, "modelled": be_model}
    be = f"break-even {_fmt(be_meas if be_meas is not None else be_model)} Gbit/s"
    coded = want_coded
    if coded is None:  # latency: coded only if faster here
        if best is not None and best["raw_s"] is not None:
            coded = best["coded_s"] < best["raw_s"]
            c.why["coded"] = (f"{tier} restore of {c.context} tokens at {c.link:g} Gbit/s: coded {_fmt(best['coded_s'])} s "
                              f"vs raw {_fmt(best['raw_s'])} s at W {best['window']} ({be})")
        elif be_meas is not None:
            coded = c.link < be_meas
            c.why["coded"] = f"no restore model for {tier}: {be} measured, link {c.link:g} Gbit/s"
        else:
            coded = c.link < SLOW_LINK_GBIT_S
            c.why["coded"] = f"no restore figures for {tier}: the seed's rule (coding below {SLOW_LINK_GBIT_S:g} Gbit/s)"
            c.notes.append(f"no restore figures for {tier}")
    elif best is not None and best["raw_s"] is not None:
        c.why["coded"] += f"; restore at {c.link:g} Gbit/s coded {_fmt(best['coded_s'])} s vs raw {_fmt(best['raw_s'])} s"
    c.figures["restore"] = dict(best or {}, tier=tier)
    if coded and best is not None:
        c.figures["window_decided"] = True
        runner = sorted(timed, key=lambda r: (r["coded_s"], -r["window"]))[1:2]
        c.why["window"] = (f"W {best['window']}: coded restore {_fmt(best['coded_s'])} s at {c.link:g} Gbit/s for "
                           f"{c.context} tokens" + (f" (next W {runner[0]['window']}: {_fmt(runner[0]['coded_s'])} s)"
                                                   if runner else ""))
        return best["window"], True
    c.figures["window_decided"] = False
    ws = [r["window"] for r in rows]
    w = _nearest_to(ws, *band.window)
    c.why["window"] = (f"W {w}: a raw restore at latency 0 does not depend on W; the measured W nearest the "
                       f"seed's {band.window[0]}–{band.window[1]}" + (" (≤ the context)" if w < band.window[0] else ""))
    return w, bool(coded)


def _gamma_range(c: _Ctx, tier: str) -> tuple[int, int]:
    """γ values within GAMMA_SLACK of the best tok/s at the chosen KV tier: their min..max."""
    entry = c.acc.get(tier, {})
    tps = _gamma_tps(entry)
    band = seed_band(c.context)
    c.figures["tokens_per_s"] = {_policy(g): v for g, v in sorted(tps.items())}
    c.figures["gamma_measured"] = bool(tps)
    if not tps:
        g = _num(entry, "best_gamma")
        if g is not None:
            c.why["gamma"] = (f"best γ {int(g)} at {c.label(tier)} (best vs ar {_fmt(_num(entry, 'best_vs_ar'))}); "
                              "no tok/s per γ stored")
            c.figures["gamma_measured"] = True
            return int(g), int(g)
        c.notes.append(f"no tok/s per γ at {c.label(tier)}: the seed's γ range")
        c.why["gamma"] = f"not measured at {c.label(tier)}: the seed's γ {band.gamma[0]}–{band.gamma[1]}"
        return band.gamma
    top = max(tps.values())
    good = sorted(g for g, v in tps.items() if v >= (1 - GAMMA_SLACK) * top)
    best = max(tps, key=lambda g: (tps[g], -g))
    listing = ", ".join(f"{_policy(g)} {v:.3g}" for g, v in sorted(tps.items()))
    c.why["gamma"] = (f"γ {'–'.join(map(str, sorted({good[0], good[-1]})))} within {GAMMA_SLACK:.0%} of the best "
                      f"({_policy(best)} {top:.3g} tok/s) at {c.label(tier)}; tok/s: {listing}")
    return good[0], good[-1]


def recommend(measurement: Mapping, context: int, link_gbit_s: float, goal: str,
              target_tier: str | None = None) -> Recommendation:
    """Our recommendation from one stored measurement (its `result` JSON); the rules are in the
    module docstring. `target_tier` picks the acceptance entries (default the measurement's own)."""
    check_inputs(context, link_gbit_s, goal)
    if not isinstance(measurement, Mapping):
        raise ValueError(f"a KV measurement is a JSON object, got {type(measurement).__name__}")
    m = measurement
    own = m.get("target_tier") if isinstance(m.get("target_tier"), str) else None
    tier_of_acc = target_tier or own or "an unnamed target tier"
    acc = _acceptance_at(m, tier_of_acc)
    c = _Ctx(m, int(context), float(link_gbit_s), goal, tier_of_acc, acc)
    if not acc and own and own != tier_of_acc and _acceptance_at(m, own):
        c.notes.append(f"no acceptance measured at {tier_of_acc}: using {own}'s")
        c.target_tier, c.acc = own, _acceptance_at(m, own)
    elif not acc:
        c.notes.append(f"no acceptance measured at {tier_of_acc}")
    c.figures["bits"] = {t: {"raw": bits(m, t, False), "coded": bits(m, t, True)} for t in KV_TIERS}
    c.figures["acceptance"] = {t: _num(c.acc.get(t), "acceptance") for t in KV_TIERS}
    decide: dict[str, Callable[[_Ctx], tuple[str, bool | None]]] = {
        "memory": _memory_tier, "latency": lambda c_: (_latency_tier(c_), None)}
    tier, want_coded = decide[goal](c)
    window, coded = _window_and_coding(c, tier, want_coded)
    lo, hi = _gamma_range(c, tier)
    c.figures["target_tier"] = c.target_tier
    return Recommendation(kv_tier=tier, coded=coded, window=window, gamma_lo=lo, gamma_hi=hi, why=c.why,
                          source="measured", context=c.context, link_gbit_s=c.link, goal=goal,
                          figures=c.figures, notes=tuple(c.notes))


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
    times = (f" ({_fmt(r.get('raw_s'))} s raw vs {_fmt(r.get('coded_s'))} s coded for {ours.context} tokens)"
             if r.get("raw_s") is not None and r.get("coded_s") is not None else "")
    link = f"{ours.link_gbit_s:g} Gbit/s"
    if seed.coded and not ours.coded and ours.link_gbit_s < SLOW_LINK_GBIT_S and ours.goal == "latency":
        out.append(f"seed: coding for cross-datacenter links; measured break-even {_fmt(be_v)} Gbit/s, below this "
                   f"{link} link: raw transfer restores faster{times}")
    elif seed.coded and not ours.coded:
        out.append(f"seed: coding for {ours.goal}; measured: {ours.why.get('coded', 'coding does not pay')}")
    elif ours.coded and not seed.coded:
        out.append(f"seed: no coding for latency on a fast link; measured: coded restore is faster at {link} "
                   f"(break-even {_fmt(be_v)} Gbit/s){times}")
    need = seed.figures.get("required_ratio")
    tb = f.get("bits", {}).get(ours.kv_tier, {})
    ratio = _x(tb.get("raw"), tb.get("coded"))
    if need and ours.coded and ratio is not None and ratio < need:
        out.append(f"seed: code a cross-datacenter link when the ratio ≥ B_fast/B_slow = {need:.3g}×; measured: "
                   f"{ours.kv_tier}+coding at {ratio:.2g}× already restores faster than raw{times}")
    return out


def _contradict_ratio(ours: Recommendation) -> list[str]:
    if ours.goal != "memory":
        return []
    b = ours.figures.get("bits", {})
    native, fp8 = b.get("native", {}).get("raw"), b.get("fp8", {}).get("coded")
    ratio = _x(native, fp8)
    lo, hi = SEED_MEMORY_RATIO
    if ratio is None or lo <= ratio <= hi:
        return []
    return [f"seed: FP8 + coding {lo:g}–{hi:g}× under FP16; measured fp8+coding {ratio:.1f}× "
            f"({_fmt(fp8)} vs {_fmt(native)} bits/scalar)"]


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
            f"{ours.link_gbit_s:g} Gbit/s (restore {_fmt(mine.get('coded_s'))} s vs {_fmt(theirs['coded_s'])} s at "
            f"W {theirs['window']})"]


def _contradict_gamma(ours: Recommendation, seed: Recommendation) -> list[str]:
    if not ours.figures.get("gamma_measured") or not (ours.gamma_hi < seed.gamma_lo or ours.gamma_lo > seed.gamma_hi):
        return []
    tps = ours.figures.get("tokens_per_s", {})
    at = f"{ours.figures.get('target_tier', '')}/{ours.kv_tier}"
    rule = f"seed: γ {seed.gamma_lo}–{seed.gamma_hi} for {seed.figures.get('band', '')}"
    seed_pol = next((p for p in (f"fixed:{g}" for g in range(seed.gamma_lo, seed.gamma_hi + 1)) if p in tps), None)
    if ours.gamma_hi == 0:
        vs = _x(tps.get(seed_pol), tps.get("ar")) if seed_pol else None
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


def comparison_rows(ours: Recommendation, seed: Recommendation) -> list[dict[str, str]]:
    """The two-column table: choice | measured | seed | why (ours)."""
    def coding(r: Recommendation) -> str:
        return "on" if r.coded else "off"

    def window(r: Recommendation) -> str:
        return f"{r.window_range[0]}–{r.window_range[1]}" if r.window_range else str(r.window)

    cells: dict[str, tuple[str, Callable[[Recommendation], str]]] = {
        "KV tier": ("kv_tier", lambda r: r.kv_tier), "coding": ("coded", coding), "W": ("window", window),
        "γ": ("gamma", lambda r: _gamma_text(r.gamma_lo, r.gamma_hi)),
    }
    return [dict(choice=name, measured=fn(ours), seed=fn(seed), why=ours.why.get(key, ""))
            for name, (key, fn) in cells.items()]


# -- the page's series ---------------------------------------------------------------------------
def restore_rows(m: Mapping, tier: str, predictor: str | None, window: int, context: int) -> list[dict[str, Any]]:
    """Per stored restore bandwidth: the bench's measured raw/coded seconds for `tier` (at its own
    context and window) and the model's at this context, W and predictor."""
    cost, _ = tier_cost(m, tier, predictor, window)
    out = []
    for r in _rows(m, "restore"):
        b = _num(r, "gbit_s")
        if not b or b <= 0:
            continue
        out.append(dict(gbit_s=b, measured_raw_s=_num(r, f"{tier}_raw_s"), measured_coded_s=_num(r, f"{tier}_coded_s"),
                        modelled_raw_s=restore_seconds(cost, context, window, b, False),
                        modelled_coded_s=restore_seconds(cost, context, window, b, True)))
    return sorted(out, key=lambda r: r["gbit_s"])


def window_rows(m: Mapping, tier: str, context: int, link_gbit_s: float) -> list[dict[str, Any]]:
    """The W sweep: ratio to native raw of each coded tier it measured, decode MB/s, the bench's
    restore at 1 Gbit/s, and the modelled coded restore of this context at this link."""
    native = bits(m, "native", False)
    out = []
    for r in sorted(_rows(m, "by_window"), key=lambda r: _num(r, "window") or 0):
        w = _num(r, "window")
        if not w:
            continue
        cost, _ = tier_cost(m, tier, window=int(w))
        out.append(dict(window=int(w), **{f"{t} coded ×": _x(native, _num(r, k)) for t, k in _CODED_KEY.items()},
                        decode_mb_s=_num(r, "decode_mb_s"), restore_s_1gbit=_num(r, "restore_s_1gbit"),
                        modelled_coded_s=restore_seconds(cost, context, min(int(w), context), link_gbit_s, True)))
    return out


def context_rows(m: Mapping) -> list[dict[str, Any]]:
    """The context sweep: ratio to native raw of each coded tier it measured, and decode MB/s."""
    native = bits(m, "native", False)
    return [dict(context=int(_num(r, "context")), **{f"{t} coded ×": _x(native, _num(r, k)) for t, k in _CODED_KEY.items()},
                 decode_mb_s=_num(r, "decode_mb_s"))
            for r in sorted(_rows(m, "by_context"), key=lambda r: _num(r, "context") or 0) if _num(r, "context")]


def missing(m: Mapping) -> list[str]:
    """The top-level sections a page or the CLI would show that this measurement lacks."""
    sections = ("tiers", "restore", "by_window", "by_context", "acceptance", "predictors")
    return [k for k in sections if not m.get(k)]


# -- from the store ------------------------------------------------------------------------------
def result_of(row: Mapping) -> dict:
    """A stored row's `result` as a dict (DuckDB hands JSON back as text)."""
    r = row.get("result")
    if isinstance(r, str):
        try:
            r = json.loads(r)
        except ValueError as e:
            raise ValueError(f"KV measurement {row.get('measurement_id')} has unreadable JSON ({e})") from None
    if not isinstance(r, Mapping):
        raise ValueError(f"KV measurement {row.get('measurement_id')} holds no result object")
    return dict(r)


def target_name(target: str | None) -> str:
    """What measurements are stored under: the embedded target's label for None/''/embedded."""
    return EMBEDDED_LABEL if target in (None, "", "embedded") else str(target)


def no_measurement(target: str | None) -> str:
    return (f"no KV measurements for {target_name(target)} yet: run `python -m engine bench kv` "
            "(or press Measure on the KV & prefetch page)")


def newest_measurement(store: Any, target: str | None, target_tier: str | None = None) -> tuple[dict, list[str]]:
    """The newest `kind='bench'` row for the target at `target_tier` (any tier when None; another
    tier, with a note, when that one has none), with its result parsed; ValueError when none."""
    rows = store.kv_measurements(target=target_name(target), kind="bench")
    if not len(rows):
        raise ValueError(no_measurement(target))
    records = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
    notes = []
    mine = [r for r in records if target_tier is None or r.get("target_tier") == target_tier]
    if not mine:
        mine = records
        notes.append(f"no KV measurement of {target_name(target)} at {target_tier}: using the newest at "
                     f"{records[-1].get('target_tier')}")
    row = dict(mine[-1])
    row["result"] = result_of(row)
    return row, notes


def tune_row(row: Mapping, context: int, link_gbit_s: float, goal: str, target_tier: str | None = None
             ) -> tuple[Recommendation, Recommendation, list[str]]:
    """(ours, seed, contradictions) for one stored row."""
    seed = seed_preset(context, link_gbit_s, goal)
    ours = recommend(result_of(row), context, link_gbit_s, goal, target_tier or row.get("target_tier"))
    return ours, seed, contradictions(ours, seed)


def tune(store: Any, target: str | None, target_tier: str | None, context: int, link_gbit_s: float, goal: str
         ) -> tuple[Recommendation, Recommendation, list[str]]:
    """(ours, seed, contradictions) from the newest stored bench measurement of the target (at the
    tier, else any tier, noted in ours.notes). Inputs are checked before the store is read."""
    check_inputs(context, link_gbit_s, goal)
    row, notes = newest_measurement(store, target, target_tier)
    ours, seed, contra = tune_row(row, context, link_gbit_s, goal, target_tier)
    figures = dict(ours.figures, measurement_id=row.get("measurement_id"), created_at=str(row.get("created_at")),
                   device=row.get("device"), measured_target_tier=row.get("target_tier"))
    ours = replace(ours, figures=figures, notes=tuple(notes) + ours.notes)
    return ours, seed, contra
