"""The figures of a stored `bench kv` measurement, read leniently (every key may be missing: a
figure that is absent is None, never a KeyError), and the restore model over them
(`restore_seconds`; the model is described in service/kv/tuner.py). Plain Python."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from engine.base.names import KV_TIERS, WEIGHT_TIERS
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


# -- reading a measurement (every key may be missing) --------------------------------------------
def num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, Mapping) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def mapping(d: Any, key: str) -> Mapping:
    v = d.get(key) if isinstance(d, Mapping) else None
    return v if isinstance(v, Mapping) else {}


def rows_of(d: Any, key: str) -> list[Mapping]:
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
        return num(mapping(mapping(m, "predictors"), predictor), _CODED_KEY[tier])
    own = num(mapping(mapping(m, "tiers"), tier), "bits_coded" if coded else "bits")
    return own if own is not None else num(m, _HEADLINE_BITS.get((tier, coded), ""))


def zstd_bits(m: Mapping, tier: str) -> float | None:
    return num(m, f"zstd19_{tier}_bits")


# A rate whose bytes would have taken less than this cannot have been timed: megabytes of KV are not
# range-coded in a microsecond. A stored measurement may still hold one (an encode time less another
# pass's μ seconds, floored at 1e-9 s), and a page must not show it.
MIN_TIMED_S = 1e-6


def raw_bytes(m: Mapping) -> float | None:
    """The raw bytes of native KV a measurement coded at its main context (what its MB/s divide)."""
    per_token, tokens = num(mapping(mapping(m, "tiers"), "native"), "bytes_per_token"), num(m, "context_tokens")
    return per_token * tokens if per_token is not None and tokens is not None else None


def timed_rate(m: Mapping, mb_s: float | None) -> bool:
    """Whether `mb_s` could have been timed: its bytes took at least MIN_TIMED_S (True when the
    bytes are not stored: nothing to hold it against)."""
    nbytes = raw_bytes(m)
    return mb_s is None or nbytes is None or mb_s <= 0 or nbytes / (mb_s * 1e6) >= MIN_TIMED_S


def speeds(m: Mapping, predictor: str | None = None) -> dict[str, float | None]:
    """Encode/decode MB/s of the predictor (default the measured best's headline figures); a rate
    that no clock could have timed (`timed_rate`) is None, not a figure."""
    p = mapping(mapping(m, "predictors"), predictor) if predictor and predictor != m.get("best_predictor") else {}
    out = {k: num(p, k) if p else num(m, k) for k in ("encode_mb_s", "decode_mb_s")}
    return {k: v if timed_rate(m, v) else None for k, v in out.items()}


def speed_notes(m: Mapping, predictor: str | None = None) -> list[str]:
    """Why a stored MB/s is not shown (see `speeds`)."""
    p = mapping(mapping(m, "predictors"), predictor) if predictor and predictor != m.get("best_predictor") else {}
    p = p or m  # as `speeds` reads it
    return [f"{name} MB/s not shown: {fmt(num(p, key))} MB/s would mean the {fmt(raw_bytes(m))} bytes took under "
            f"{MIN_TIMED_S * 1e6:g} µs, which no clock timed (the encode was timed less the restore's predictor "
            "seconds); measure again for the figure"
            for key, name in (("encode_mb_s", "Encode"), ("decode_mb_s", "Decode")) if not timed_rate(m, num(p, key))]


def axis_range(values: list[float | None], pad: float = 0.15) -> list[float] | None:
    """A y range for a series of non-negative figures (ratios, MB/s): from 0 to `pad` above the
    largest, so that a flat series draws as a flat line rather than plotly's autorange zooming
    into its last digits (3.462–3.46206); None when there is nothing finite to show."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    lo, hi = min(xs), max(xs)
    if lo < 0:  # not a magnitude: pad around it instead
        half = max((hi - lo) / 2, abs(hi + lo) / 2 * 0.05, 1e-9) * (1 + pad)
        return [(hi + lo) / 2 - half, (hi + lo) / 2 + half]
    return [0.0, hi * (1 + pad) if hi > 0 else 1.0]


def flat_series(rows: list[Mapping], keys: list[str], rel: float = 0.005) -> dict[str, float]:
    """The series (columns of `rows`) that do not move by more than `rel` of their size: worth a
    word ("3.46× at every W") beside the chart, since a line cannot say it changes nothing."""
    out = {}
    for k in keys:
        xs = [num(r, k) for r in rows]
        xs = [x for x in xs if x is not None]
        if len(xs) > 1 and max(xs) - min(xs) <= rel * max(abs(x) for x in xs):
            out[k] = sum(xs) / len(xs)
    return out


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0.0) else None


def bits_rows(m: Mapping, predictor: str | None = None) -> list[dict[str, Any]]:
    """Per KV tier: bits per scalar raw and coded (the predictor's), zstd-19 beside, and each as a
    ratio to native raw (the seed's "× under FP16")."""
    native = bits(m, "native", False)
    out = []
    for t in KV_TIERS:
        raw, coded, z = bits(m, t, False), bits(m, t, True, predictor), zstd_bits(m, t)
        out.append(dict(kv_tier=t, raw_bits=raw, coded_bits=coded, zstd19_bits=z,
                        raw_ratio=ratio_of(native, raw), coded_ratio=ratio_of(native, coded), zstd19_ratio=ratio_of(native, z)))
    return out


@dataclass(frozen=True)
class TierCost:
    """What restoring one token of a tier costs: bytes raw and coded at rest, μ and decode seconds."""

    raw_bytes: float | None
    coded_bytes: float | None
    mu_s: float
    decode_s: float


def _window_row(m: Mapping, window: int | None) -> Mapping:
    return next((r for r in rows_of(m, "by_window") if num(r, "window") == window), {}) if window else {}


def tier_cost(m: Mapping, tier: str, predictor: str | None = None, window: int | None = None
              ) -> tuple[TierCost, list[str]]:
    """The tier's per-token restore inputs at window `window` and `predictor`, and what was scaled or
    assumed. The headline figures are the best predictor's at the measured window; another predictor
    scales the coded size by its bits and the decode time by its MB/s, a `by_window` row the same way
    (a tier without its own bits in that row follows native's)."""
    t = mapping(mapping(m, "tiers"), tier)
    notes: list[str] = []
    coded = num(t, "coded_bytes_per_token")
    decode = num(t, "decode_s_per_token")
    mu = num(t, "mu_s_per_token")
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
    if row and coded is not None and window != num(m, "window"):
        key, base = _CODED_KEY[tier], ref_bits
        if num(row, key) is None:  # the sweep did not measure this tier: follow native's change
            key, base = "native_bits", bits(m, "native", True)
        w_bits = num(row, key)
        coded = coded * w_bits / base if w_bits and base else coded
        w_speed = num(row, "decode_mb_s")
        decode = decode * ref_speed / w_speed if w_speed and ref_speed else decode
    return TierCost(num(t, "bytes_per_token"), coded, mu or 0.0, decode), notes


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
    return num(mapping(mapping(m, "tiers"), tier), "breakeven_gbit_s")


def measured_windows(m: Mapping) -> list[int]:
    ws = sorted({int(w) for w in (num(r, "window") for r in rows_of(m, "by_window")) if w and w >= 1})
    return ws or ([int(num(m, "window"))] if num(m, "window") else [])


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
    for r in rows_of(m, "acceptance"):
        tps = {str(k): num(mapping(r, "tokens_per_s"), k) for k in mapping(r, "tokens_per_s")}
        out.append(dict(target_tier=r.get("target_tier"), kv_tier=r.get("kv_tier"), acceptance=num(r, "acceptance"),
                        best_gamma=num(r, "best_gamma"), best_vs_ar=num(r, "best_vs_ar"),
                        **{f"tok/s {k}": v for k, v in tps.items()}))
    return out


def acceptance_tiers(m: Mapping) -> list[str]:
    """The weight tiers a measurement holds acceptance at, in WEIGHT_TIERS order."""
    have = {r.get("target_tier") for r in rows_of(m, "acceptance")}
    others = sorted(t for t in have if isinstance(t, str) and t not in WEIGHT_TIERS)
    return [t for t in WEIGHT_TIERS if t in have] + others


def acceptance_note(m: Mapping, target_tier: str | None) -> str | None:
    """Why there is no acceptance to show at `target_tier`, naming the tiers there is one at and
    the tier the KV was coded at (a quick measurement skips acceptance: `--quick`)."""
    have, coded_at = acceptance_tiers(m), m.get("target_tier") or "an unnamed tier"
    if not have:
        return (f"No acceptance in this measurement: the KV was coded with the target at {coded_at}, and the "
                "quick run (the page's Measure) skips acceptance to stay near its minutes; "
                "`python -m engine bench kv` measures it at fp32 and bf16.")
    if target_tier and target_tier not in have:
        return (f"No acceptance at {target_tier} in this measurement, only at {', '.join(have)} "
                f"(the KV coded at {coded_at}); `python -m engine bench kv --acceptance-tiers {target_tier}` "
                "measures it.")
    return None


def acceptance_at(m: Mapping, target_tier: str) -> dict[str, Mapping]:
    """KV tier → the acceptance entry at this target tier (the newest entry wins)."""
    return {r["kv_tier"]: r for r in rows_of(m, "acceptance")
            if r.get("target_tier") == target_tier and r.get("kv_tier") in KV_TIERS}


def gamma_tps(entry: Mapping) -> dict[int, float]:
    out = {}
    for policy, v in mapping(entry, "tokens_per_s").items():
        g, x = gamma_of(str(policy)), num(mapping(entry, "tokens_per_s"), policy)
        if g is not None and x is not None:
            out[g] = x
    return out


def policy_of(g: int) -> str:
    return "ar" if g == 0 else f"fixed:{g}"


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else ("∞" if math.isinf(x) else format(x, spec))


# -- the page's series ---------------------------------------------------------------------------
def restore_rows(m: Mapping, tier: str, predictor: str | None, window: int, context: int) -> list[dict[str, Any]]:
    """Per stored restore bandwidth: the bench's measured raw/coded seconds for `tier` (at its own
    context and window) and the model's at this context, W and predictor."""
    cost, _ = tier_cost(m, tier, predictor, window)
    out = []
    for r in rows_of(m, "restore"):
        b = num(r, "gbit_s")
        if not b or b <= 0:
            continue
        out.append(dict(gbit_s=b, measured_raw_s=num(r, f"{tier}_raw_s"), measured_coded_s=num(r, f"{tier}_coded_s"),
                        modelled_raw_s=restore_seconds(cost, context, window, b, False),
                        modelled_coded_s=restore_seconds(cost, context, window, b, True)))
    return sorted(out, key=lambda r: r["gbit_s"])


def window_rows(m: Mapping, tier: str, context: int, link_gbit_s: float) -> list[dict[str, Any]]:
    """The W sweep: ratio to native raw of each coded tier it measured, decode MB/s, the bench's
    restore at 1 Gbit/s, and the modelled coded restore of this context at this link."""
    native = bits(m, "native", False)
    out = []
    for r in sorted(rows_of(m, "by_window"), key=lambda r: num(r, "window") or 0):
        w = num(r, "window")
        if not w:
            continue
        cost, _ = tier_cost(m, tier, window=int(w))
        out.append(dict(window=int(w), **{f"{t} coded ×": ratio_of(native, num(r, k)) for t, k in _CODED_KEY.items()},
                        decode_mb_s=num(r, "decode_mb_s"), restore_s_1gbit=num(r, "restore_s_1gbit"),
                        modelled_coded_s=restore_seconds(cost, context, min(int(w), context), link_gbit_s, True)))
    return out


def context_rows(m: Mapping) -> list[dict[str, Any]]:
    """The context sweep: ratio to native raw of each coded tier it measured, and decode MB/s."""
    native = bits(m, "native", False)
    return [dict(context=int(num(r, "context")), **{f"{t} coded ×": ratio_of(native, num(r, k)) for t, k in _CODED_KEY.items()},
                 decode_mb_s=num(r, "decode_mb_s"))
            for r in sorted(rows_of(m, "by_context"), key=lambda r: num(r, "context") or 0) if num(r, "context")]


def missing(m: Mapping) -> list[str]:
    """The top-level sections a page or the CLI would show that this measurement lacks."""
    sections = ("tiers", "restore", "by_window", "by_context", "acceptance", "predictors")
    return [k for k in sections if not m.get(k)]
