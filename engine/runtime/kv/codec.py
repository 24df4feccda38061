"""Lossless speculative KV coding (docs/architecture.md, "KV coding"). One purpose, kept in one file
over the usual size: the encoder and the decoder must make the same table choices bit for bit, and
reading them side by side is how that stays true.

The target's KV is the output of a deterministic forward pass, so coding it costs only what a
cheap predictor (engine/runtime/kv/proxy.py) fails to predict. Encoder and decoder run the same
predictor over the same tokens and get μ; σ per (K/V, layer, head, channel) and a linear bias
per channel come from calibration text and are stored with the codec (`Stats`). Each stored
number x is then coded against a Gaussian N(μ, σ) integrated over x's own cell of the tier's
number grid (bf16, fp32, e4m3 codes, int8 codes), with constriction's range coder.

Why two stages: constriction's QuantizedGaussian decodes at ~165 ns a symbol here, 8× too slow
for 20 MB/s. Instead each x is split into
- a *coarse cell* k = floor(x / Δ) on a uniform grid Δ = 2^j a quarter of σ (or x's own
  spacing near μ, if coarser), coded as s = k - floor(μ/Δ) by a Categorical table picked from
  896 precomputed ones by (σ/Δ, frac(μ/Δ)) buckets: a table lookup decodes in ~30 ns;
- its *place* inside the cell, uniform over the grid values the cell holds (a float grid is
  uniform inside a binade, and a cell never crosses one: Δ and binade edges are powers of two);
  in the cell at zero, the binade first (geometric, P ∝ its width), then the mantissa.
Both stages together cost -log2 of the Gaussian's mass over x's rounding interval, up to the
Gaussian's curvature inside a quarter-σ cell (< 0.01 bit).

Windows of W tokens are coded apart (a window restores alone) and each carries checksums of its
μ and its payload: a different predictor, thread count or flipped byte is refused, never
decoded into wrong numbers."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.base.helpers import one_line
from engine.base.names import KV_TIER_CODES

try:  # an optional dependency of the engine: only coding needs it
    import constriction
except ImportError:  # pragma: no cover - requirements.txt pins it
    constriction = None

VERSION = 1
MAGIC = b"SKVC"
R = 96  # coarse offsets |s| < R are coded; ±R is the escape to a raw code
# A number's table: its ρ = σ/Δ bucket (quarter octaves over [2^-4, 8)) and, where ρ < 2, its
# frac(μ/Δ) bucket (eighths). Where ρ ≥ 2 the cell is under half a σ and one table averaged over
# frac moves the law by < Δ/2 (≤ 0.01 bit): it saves 7 coder calls in 8. 168 tables: a uint8 key,
# which numpy's radix sort orders in one pass.
RHO_MIN, RHO_STEPS, RHO_BUCKETS = -4, 4, 28
FRAC_BUCKETS = 8
RHO_FRAC = 5 * RHO_STEPS  # ρ buckets from here (ρ ≥ 2) have one table
TABLES = RHO_FRAC * FRAC_BUCKETS + RHO_BUCKETS - RHO_FRAC
DEPTH_CAP = 40  # binades coded under a zero cell; deeper values go raw
SIDE_R = 32  # side information (fp8 exponents, int8 scales): offsets from the predictor's, then raw
# magic, version, tier, grid, coded (0: the stored bytes as they are), start, tokens, payload
# bytes, then the digests of μ (zeros when not coded) and of the payload
WINDOW_HEADER = struct.Struct("<4sBBBBIIQ8s8s")


class CodecError(ValueError):
    """A stream that cannot be decoded as asked: corrupt, truncated, or coded against another μ."""


@dataclass(frozen=True)
class Grid:
    """The numbers a tier stores: floats with `mantissa` bits (None: integers), the exponent of the
    smallest normal, and the width of one raw code."""

    mantissa: int | None
    emin: int
    raw_bits: int


GRIDS = {"bf16": Grid(7, -126, 16), "fp16": Grid(10, -14, 16), "fp32": Grid(23, -126, 32),
         "e4m3": Grid(3, -6, 8), "int8": Grid(None, 0, 8)}
GRID_CODES = {name: i for i, name in enumerate(GRIDS)}
TIER_CODES = KV_TIER_CODES  # a window's header names its KV tier by code
RAW_DTYPES = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32, "e4m3": np.uint8, "int8": np.uint8}

E4M3_VALUES = np.array([  # all 256 e4m3fn codes as float64 (0x7F and 0xFF are NaN)
    (-1) ** (c >> 7) * (((c >> 3) & 15 and (8 + (c & 7)) * 2.0 ** (((c >> 3) & 15) - 10)) or (c & 7) * 2.0 ** -9)
    for c in range(256)])
E4M3_VALUES[[0x7F, 0xFF]] = np.nan


# ---- stored numbers: raw codes ⇄ float64 values --------------------------------------------

def values_of(raw: np.ndarray, grid: str) -> np.ndarray:
    """The numbers behind raw codes, float64 (exact for every grid)."""
    if grid == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if grid == "fp32":
        return raw.view(np.float32).astype(np.float64)
    if grid == "fp16":
        return raw.view(np.float16).astype(np.float64)
    if grid == "e4m3":
        return E4M3_VALUES[raw]
    return raw.view(np.int8).astype(np.float64)


def raw_of(values: np.ndarray, grid: str) -> np.ndarray:
    """Inverse of `values_of` for numbers on the grid."""
    if grid == "bf16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if grid == "fp32":
        return values.astype(np.float32).view(np.uint32)
    if grid == "fp16":
        return values.astype(np.float16).view(np.uint16)
    if grid == "e4m3":
        return _e4m3_code(values)
    return values.astype(np.int8).view(np.uint8)


@functools.cache
def _e4m3_lut() -> np.ndarray:
    """float32 bits >> 20 (sign, exponent, 3 mantissa bits: all an e4m3 value has) → e4m3 code."""
    lut = np.zeros(1 << 12, dtype=np.uint8)
    finite = np.flatnonzero(np.isfinite(E4M3_VALUES))
    lut[E4M3_VALUES[finite].astype(np.float32).view(np.uint32) >> 20] = finite
    return lut


def _e4m3_code(values: np.ndarray) -> np.ndarray:
    return _e4m3_lut()[values.astype(np.float32).view(np.uint32) >> 20]


# ---- the coarse-cell tables ----------------------------------------------------------------
# A number's table is picked by ρ = σ/Δ and frac(μ/Δ), both read off exactly (float bits, a
# power-of-two product), never through log2: a last-bit difference between two machines' libm
# would pick another table and decode garbage. The tables themselves are integer counts stored
# in the codec file, for the same reason.

RHO_BASE = (127 + RHO_MIN) * RHO_STEPS  # float32 bits >> 21: the exponent and 2 mantissa bits
RHO_SHIFT = 21


def _rho_centers() -> np.ndarray:
    """The geometric middle of each ρ bucket: [2^o (1 + i/4), 2^o (1 + (i+1)/4))."""
    b = np.arange(RHO_BUCKETS)
    o, i = RHO_MIN + b // RHO_STEPS, b % RHO_STEPS
    return 2.0 ** o * np.sqrt((1 + i / RHO_STEPS) * (1 + (i + 1) / RHO_STEPS))


def _table_index(rb: np.ndarray, fb: np.ndarray) -> np.ndarray:
    return np.where(rb < RHO_FRAC, rb * FRAC_BUCKETS + fb, rb + RHO_FRAC * (FRAC_BUCKETS - 1))


@dataclass(frozen=True)
class Shape:
    """The normalized residual's law: a zero-mean mixture of Gaussians (weights, scales)."""

    weights: tuple[float, ...] = (1.0,)
    scales: tuple[float, ...] = (1.0,)

    def cdf(self, z: np.ndarray) -> np.ndarray:
        from scipy.special import ndtr

        return sum(w * ndtr(z / s) for w, s in zip(self.weights, self.scales)) / sum(self.weights)


def build_tables(shape: Shape) -> np.ndarray:
    """Integer counts [TABLES, 2R + 1] of s + R for s in [-R, R] (±R: the escape)."""
    rho = _rho_centers()
    frac = (np.arange(FRAC_BUCKETS) + 0.5) / FRAC_BUCKETS
    edges = np.arange(-R + 1, R + 1, dtype=np.float64)  # inner cell edges
    c = shape.cdf((edges[None, None, :] - frac[None, :, None]) / rho[:, None, None])  # [NR, NF, 2R]
    n = c.shape[:2] + (1,)
    probs = np.diff(np.concatenate([np.zeros(n), c, np.ones(n)], -1), axis=-1)  # [NR, NF, 2R+1]
    rb, fb = np.meshgrid(np.arange(RHO_BUCKETS), np.arange(FRAC_BUCKETS), indexing="ij")
    out = np.zeros((TABLES, 2 * R + 1))
    np.add.at(out, _table_index(rb, fb).ravel(), probs.reshape(-1, 2 * R + 1))  # ρ ≥ 2: the frac average
    out /= out.sum(-1, keepdims=True)
    return np.maximum(np.round(out * (1 << 24)), 1).astype(np.int32)


@functools.cache
def _geometric(n: int) -> object:
    return constriction.stream.model.Categorical(0.5 ** np.arange(n, dtype=np.float64), perfect=False)


@functools.cache
def _side_table() -> object:
    d = np.abs(np.arange(-SIDE_R, SIDE_R + 1))
    return constriction.stream.model.Categorical(4.0 ** -d.astype(np.float64), perfect=False)


# ---- stats: what calibration fits, stored with the codec -----------------------------------

@dataclass
class Stats:
    """Per (K/V, layer, head, channel): bias α + β·μ and σ of what remains, in value units; fitted
    on calibration text for one target and one predictor. With them, the coarse tables."""

    fingerprint: str  # the target's (engine/runtime/kv/predictor.fingerprint)
    predictor: str
    alpha: np.ndarray  # [2, L, H, 1, D]
    beta: np.ndarray
    sigma: np.ndarray
    tables: np.ndarray  # [TABLES, 2R+1] int32 counts (build_tables)
    meta: dict = field(default_factory=dict)

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.sigma.shape[1], self.sigma.shape[2], self.sigma.shape[4]

    @functools.cached_property
    def models(self) -> list:
        cat = constriction.stream.model.Categorical
        return [cat(row.astype(np.float64), perfect=False) for row in self.tables]

    @functools.cached_property
    def digest(self) -> bytes:
        h = hashlib.blake2b(self.fingerprint.encode() + b"/" + self.predictor.encode(), digest_size=8)
        for a in (self.alpha, self.beta, self.sigma, self.tables):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()

    def save(self, path: Path) -> None:
        meta = dict(self.meta, fingerprint=self.fingerprint, predictor=self.predictor, version=VERSION)
        # Written beside, then renamed: a process fitting the same codec at the same time (two app
        # sessions, two test workers) must never read a half-written file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:  # np.savez would append .npz to a name without it
                np.savez(f, alpha=self.alpha, beta=self.beta, sigma=self.sigma, tables=self.tables,
                         meta=np.array(json.dumps(meta)))
            os.replace(tmp, path)
        finally:  # a failed write leaves no stray file beside the codecs (as store/staging.py's writes)
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> "Stats":
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k].astype(np.float64) for k in ("alpha", "beta", "sigma")}
                tables = z["tables"].astype(np.int32)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a SpecLab KV codec file ({one_line(str(e))})") from None
        if meta.get("version") != VERSION:
            raise ValueError(f"{path}: KV codec version {meta.get('version')}; this SpecLab reads {VERSION}")
        if tables.shape != (TABLES, 2 * R + 1) or (tables < 1).any():
            raise ValueError(f"{path}: KV codec tables have the wrong shape or empty entries")
        return cls(meta["fingerprint"], meta["predictor"], tables=tables, meta=meta, **arrays)


def fit(target: np.ndarray, mu: np.ndarray, fingerprint: str, predictor: str, shape: Shape = Shape()) -> Stats:
    """Stats from calibration KV: target and μ [2, L, H, S, D] in value units."""
    t, m = target.astype(np.float64), mu.astype(np.float64)
    r = t - m
    mm, rm = m.mean(3, keepdims=True), r.mean(3, keepdims=True)
    var = ((m - mm) ** 2).mean(3, keepdims=True)
    beta = np.where(var > 0, ((m - mm) * (r - rm)).mean(3, keepdims=True) / np.where(var > 0, var, 1), 0.0)
    alpha = rm - beta * mm
    sigma = (r - alpha - beta * m).std(3, keepdims=True)
    floor = max(float(np.median(sigma)) * 1e-3, 1e-30)  # a channel that never moved still gets a law
    return Stats(fingerprint, predictor, alpha, beta, np.maximum(sigma, floor), build_tables(shape),
                 meta=dict(calibration_tokens=int(target.shape[3]),
                           shape=[list(shape.weights), list(shape.scales)]))


# ---- what one window holds -------------------------------------------------------------------

@dataclass
class TierKV:
    """A KV block as a tier stores it: raw codes [2, L, H, S, D] on `grid`, and for fp8/int8 one
    side number per (K/V, layer, head, token) [2, L, H, S]: the e4m3 block's power-of-two
    exponent (int8) or the int8 block's bf16 scale (its raw bits, uint16)."""

    tier: str
    grid: str
    codes: np.ndarray
    side: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return self.codes.shape[3]

    def values(self) -> np.ndarray:
        """What attention reads, float64 [2, L, H, S, D]."""
        v = values_of(self.codes, self.grid)
        if self.tier == "fp8":
            return np.ldexp(v, self.side.astype(np.int64)[..., None])
        if self.tier == "int8":
            return v * values_of(self.side, "bf16")[..., None]
        return v

    def window(self, start: int, stop: int) -> "TierKV":
        side = None if self.side is None else self.side[..., start:stop]
        return TierKV(self.tier, self.grid, self.codes[..., start:stop, :], side)

    def equals(self, other: "TierKV") -> bool:
        if (self.tier, self.grid) != (other.tier, other.grid) or not np.array_equal(self.codes, other.codes):
            return False
        return (self.side is None) == (other.side is None) and (self.side is None or np.array_equal(self.side, other.side))


def concat(parts: list[TierKV]) -> TierKV:
    side = None if parts[0].side is None else np.concatenate([p.side for p in parts], -1)
    return TierKV(parts[0].tier, parts[0].grid, np.concatenate([p.codes for p in parts], 3), side)


def predicted_side(tier: str, mu: np.ndarray) -> np.ndarray:
    """The side numbers the predictor's own KV would get at `tier` (engine/runtime/kv/tiers.py's rule),
    computed with exactly rounded operations only (both sides must agree on every bit)."""
    amax = np.abs(mu.astype(np.float32)).max(-1)
    if tier == "fp8":
        m, e = np.frexp(amax / np.float32(448.0))  # v = m·2^e, m in [0.5, 1): ceil(log2 v) = e, or e-1 at m = 0.5
        e = e - (m == 0.5)
        return np.where(amax > 0, np.clip(e, -126, 127), -126).astype(np.int8)
    return raw_of(amax / np.float32(127), "bf16")


# ---- the coder ----------------------------------------------------------------------------------
CHUNK = 1 << 17  # numbers coded per pass: the passes' arrays stay in cache


def _exponent(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) for v > 0 (float32: read off the bits; a subnormal reads as -127)."""
    if v.dtype == np.float32:
        return ((v.view(np.int32) >> 23) & 0xFF) - 127
    return np.frexp(v)[1] - 1


def _pow2(e: np.ndarray, dtype, sign_of: np.ndarray | None = None) -> np.ndarray:
    """±2^e for normal exponents (float32: -126 … 127), the sign of `sign_of`'s, built from the
    bits: ldexp is 10× slower."""
    if dtype is np.float32:
        bits = (e.astype(np.int32) + 127) << 23
        return (bits if sign_of is None else bits | (sign_of.view(np.int32) & np.int32(-1 << 31))).view(np.float32)
    bits = (e.astype(np.int64) + 1023) << 52
    return (bits if sign_of is None else bits | (sign_of.view(np.int64) & np.int64(-1 << 63))).view(np.float64)


class _Cells:
    """Everything both sides derive from μ and σ alone, before any symbol: each number's cell
    width Δ = 2^j, predicted cell k0, and table (bucket), with the order that groups tables."""

    def __init__(self, grid: Grid, mu: np.ndarray, sigma: np.ndarray) -> None:
        ft = mu.dtype.type
        j = _exponent(sigma) - 2  # Δ at most a quarter of σ
        if grid.mantissa is None:
            j = np.maximum(j, 0)  # integers: no finer than 1
            shift = ft(0.5)
        else:
            e_mu = _exponent(np.abs(mu))
            # No finer than emin (cells ≥ 1 hold normal numbers only) nor than the grid's own
            # spacing u at μ; a cell [kΔ, (k+1)Δ) holds values u apart whose rounding intervals
            # cover [kΔ - u/2, (k+1)Δ - u/2) (mirrored below zero): the law moves by u/2.
            j = np.maximum(np.maximum(j, grid.emin), e_mu - grid.mantissa)
        self.j = np.minimum(j, 126 if ft is np.float32 else 1000).astype(np.int32)
        self.inv = _pow2(-self.j, ft)
        if grid.mantissa is None:
            t = (mu + shift) * self.inv
        else:  # u/2Δ, at least 2^-126 (a shift that small moves nothing)
            t = mu * self.inv + _pow2(np.maximum(np.maximum(e_mu, grid.emin) - grid.mantissa - 1 - self.j, -126), ft, sign_of=mu)
        self.k0 = np.floor(t)
        rho = (sigma * self.inv).astype(np.float32)
        # ρ < 8 by the choice of j; the floor catches ρ < 2^-4, where a number costs ~0 bits
        rb = np.maximum((rho.view(np.int32) >> RHO_SHIFT) - RHO_BASE, 0)
        fb = np.minimum(((t - self.k0) * FRAC_BUCKETS).astype(np.int32), FRAC_BUCKETS - 1)
        bucket = _table_index(rb, fb).astype(np.uint8)
        self.order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=TABLES)
        nz = np.flatnonzero(counts)
        ends = np.cumsum(counts)[nz]
        self.groups = list(zip(nz.tolist(), (ends - counts[nz]).tolist(), ends.tolist()))


def _zero_cell(grid: Grid, ax: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A magnitude under Δ = 2^j: (depth, mantissa). Depth d < j - emin is the binade
    [2^(j-1-d), 2^(j-d)); d = j - emin is the block under 2^emin (subnormals and zero), as wide
    as the binade above it, so a flat law gives depth d the probability 2^-(d+1)."""
    ft = ax.dtype.type
    normal = ax >= ft(2.0 ** grid.emin)
    e = np.where(normal, _exponent(np.where(normal, ax, ft(1))), grid.emin)
    depth = np.where(normal, j - 1 - e, j - grid.emin)
    unit = np.ldexp(ft(1), np.where(normal, e, grid.emin) - grid.mantissa).astype(ft)  # may be subnormal
    mant = ax / unit - np.where(normal, ft(2 ** grid.mantissa), ft(0))
    return depth, mant


def _from_zero_cell(grid: Grid, depth: np.ndarray, mant: np.ndarray, j: np.ndarray) -> np.ndarray:
    ft = mant.dtype.type
    sub = depth == j - grid.emin
    e = j - 1 - depth
    return np.where(sub, mant * ft(2.0 ** (grid.emin - grid.mantissa)),
                    (mant + ft(2 ** grid.mantissa)) * np.ldexp(ft(1), np.where(sub, 0, e) - grid.mantissa).astype(ft))


def _place_bits(grid: Grid, c_abs: np.ndarray) -> np.ndarray:
    """Bits that place a number inside a cell of magnitude index c_abs ≥ 1 (float grids): the
    cell holds 2^bits grid values, evenly spaced (it never crosses a binade)."""
    return np.maximum(0, grid.mantissa - _exponent(np.maximum(c_abs, 1)))


def _work_dtype(grid: Grid):
    return np.float64 if grid.mantissa is not None and grid.mantissa > 10 else np.float32


def _encode_chunk(enc, grid: Grid, x: np.ndarray, raw: np.ndarray, mu: np.ndarray, sigma: np.ndarray,
                  models: list) -> None:
    p = _Cells(grid, mu, sigma)
    ft = x.dtype.type
    if grid.mantissa is None:
        k = np.floor(x * p.inv)
    else:
        a = np.abs(x) * p.inv
        c = np.floor(a)
        k = np.copysign(c + ft(0.5), x) - ft(0.5)  # sign and magnitude: -1 - c below zero
    s = np.clip(k - p.k0, -R, R)
    esc = np.abs(s) == R
    sym = (s + R).astype(np.int32)[p.order]
    for b, lo, hi in p.groups:
        enc.encode(sym[lo:hi], models[b])
    if grid.mantissa is None:
        bits, place = p.j * ~esc, x - k * _pow2(p.j, ft)
    else:
        zero = np.flatnonzero(~esc & (c == 0))
        depth, mant = _zero_cell(grid, np.abs(x[zero]), p.j[zero])
        enc.encode(np.minimum(depth, DEPTH_CAP).astype(np.int32), _geometric(DEPTH_CAP + 1))
        esc[zero[depth >= DEPTH_CAP]] = True  # deeper than the table: raw
        bits = _place_bits(grid, c)
        place = (a - c) * _pow2(bits, ft)
        bits[zero], place[zero] = grid.mantissa, mant
        bits[esc] = 0
    use = bits > 0
    if use.any():
        enc.encode(place[use].astype(np.int32), constriction.stream.model.Uniform(), np.left_shift(1, bits[use]).astype(np.int32))
    _encode_raw(enc, raw[esc], grid.raw_bits)


def _decode_chunk(dec, grid: Grid, grid_name: str, mu: np.ndarray, sigma: np.ndarray, models: list) -> np.ndarray:
    p = _Cells(grid, mu, sigma)
    ft = mu.dtype.type
    sym = np.empty(mu.size, dtype=np.int32)
    for b, lo, hi in p.groups:
        sym[lo:hi] = dec.decode(models[b], hi - lo)
    s = np.empty(mu.size, dtype=ft)
    s[p.order] = sym - R
    esc = np.abs(s) == R
    k = p.k0 + s
    if grid.mantissa is None:
        bits = p.j * ~esc
    else:
        c = np.abs(k + ft(0.5)) - ft(0.5)
        zero = np.flatnonzero(~esc & (c == 0))
        depth = dec.decode(_geometric(DEPTH_CAP + 1), zero.size).astype(np.int32)
        esc[zero[depth >= DEPTH_CAP]] = True
        bits = _place_bits(grid, c)
        bits[zero] = grid.mantissa
        bits[esc] = 0
    use = bits > 0
    place = np.zeros(mu.size, dtype=ft)
    if use.any():
        place[use] = dec.decode(constriction.stream.model.Uniform(), np.left_shift(1, bits[use]).astype(np.int32))
    if grid.mantissa is None:
        x = k * _pow2(p.j, ft) + place
    else:
        mag = (c + place * _pow2(-bits, ft)) * _pow2(p.j, ft)
        mag[zero] = _from_zero_cell(grid, depth, place[zero], p.j[zero])
        x = np.copysign(mag, k + ft(0.5))  # -0.0 where the magnitude is 0 below zero
    x[esc] = 0
    raw = raw_of(x, grid_name)
    raw[esc] = _decode_raw(dec, int(esc.sum()), grid.raw_bits).astype(raw.dtype)
    return raw


def _encode_raw(enc, raw: np.ndarray, bits: int) -> None:
    v = raw.astype(np.uint64)
    for shift in range(0, bits, 16):
        enc.encode(((v >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.int32), constriction.stream.model.Uniform(1 << 16))


def _decode_raw(dec, n: int, bits: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.uint64)
    for shift in range(0, bits, 16):
        out |= dec.decode(constriction.stream.model.Uniform(1 << 16), n).astype(np.uint64) << np.uint64(shift)
    return out


def _side_dtype(tier: str):
    return (np.int8, np.uint8, 8) if tier == "fp8" else (np.uint16, np.uint16, 16)


def _encode_side(enc, tier: str, side: np.ndarray, pred: np.ndarray) -> None:
    _, unsigned, bits = _side_dtype(tier)
    d = np.clip(side.astype(np.int64) - pred.astype(np.int64), -SIDE_R, SIDE_R).ravel()
    enc.encode((d + SIDE_R).astype(np.int32), _side_table())
    _encode_raw(enc, side.ravel().view(unsigned)[np.abs(d) == SIDE_R], bits)


def _decode_side(dec, tier: str, pred: np.ndarray) -> np.ndarray:
    dtype, unsigned, bits = _side_dtype(tier)
    d = dec.decode(_side_table(), pred.size).astype(np.int64) - SIDE_R
    out = (pred.ravel().astype(np.int64) + d).astype(dtype)
    esc = np.abs(d) == SIDE_R
    out[esc] = _decode_raw(dec, int(esc.sum()), bits).astype(unsigned).view(dtype)
    return out.reshape(pred.shape)


def mu_digest(mu: np.ndarray) -> bytes:
    """8 bytes that change with any bit of μ: CRC-32 and Adler-32 (3× faster than BLAKE2 over
    μ, which is twice the KV's size; a mismatch here is an accident, not an attack)."""
    b = np.ascontiguousarray(mu, dtype=np.float32).data
    return struct.pack("<II", zlib.crc32(b), zlib.adler32(b))


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


def _side_bytes(kv: TierKV) -> bytes:
    return b"" if kv.side is None else np.ascontiguousarray(kv.side).tobytes()


def _header(kv: TierKV, coded: bool, start: int, payload: bytes, mu_hash: bytes) -> bytes:
    return WINDOW_HEADER.pack(MAGIC, VERSION, TIER_CODES[kv.tier], GRID_CODES[kv.grid], int(coded), start,
                              kv.tokens, len(payload), mu_hash, _digest(payload))


@dataclass(frozen=True)
class WindowHead:
    """A window's header, checked against what the reader expects."""

    coded: bool
    start: int
    tokens: int
    mu_hash: bytes
    payload: bytes  # checked against its digest
    size: int  # header + payload bytes

    @classmethod
    def read(cls, blob: bytes, tier: str, grid: str) -> "WindowHead":
        if len(blob) < WINDOW_HEADER.size:
            raise CodecError("KV window truncated: no complete header")
        magic, version, tcode, gcode, coded, start, tokens, n, mu_hash, pay_hash = WINDOW_HEADER.unpack_from(blob)
        if magic != MAGIC or version != VERSION:
            raise CodecError("not a SpecLab KV window (bad magic or version)")
        if tcode != TIER_CODES.get(tier) or gcode != GRID_CODES.get(grid):
            raise CodecError(f"KV window holds tier/grid codes {tcode}/{gcode}, asked to decode {tier}/{grid}")
        payload = blob[WINDOW_HEADER.size: WINDOW_HEADER.size + n]
        if len(payload) != n or _digest(payload) != pay_hash:
            raise CodecError(f"KV window at token {start}: payload checksum mismatch (corrupt or truncated)")
        return cls(bool(coded), start, tokens, mu_hash, payload, WINDOW_HEADER.size + n)


def encode_raw_window(kv: TierKV, start: int = 0) -> bytes:
    """The window's stored bytes as they are (coding off), with the same header and checksum."""
    payload = np.ascontiguousarray(kv.codes).tobytes() + _side_bytes(kv)
    return _header(kv, False, start, payload, bytes(8)) + payload


def decode_raw_window(head: WindowHead, tier: str, grid: str, shape: tuple[int, ...]) -> TierKV:
    """shape: the window's [2, L, H, S, D]."""
    if head.tokens != shape[3]:
        raise CodecError(f"KV window holds {head.tokens} tokens, expected {shape[3]}")
    dtype = np.dtype(RAW_DTYPES[grid])
    n_codes = int(np.prod(shape)) * dtype.itemsize
    side_dtype = {"fp8": np.dtype(np.int8), "int8": np.dtype(np.uint16)}.get(tier)
    n_side = 0 if side_dtype is None else int(np.prod(shape[:4])) * side_dtype.itemsize
    if len(head.payload) != n_codes + n_side:
        raise CodecError(f"KV window at token {head.start}: {len(head.payload)} payload bytes, "
                         f"a {tier} block of {shape} needs {n_codes + n_side} (another target?)")
    codes = np.frombuffer(head.payload, dtype=dtype, count=int(np.prod(shape))).reshape(shape).copy()
    side = None if side_dtype is None else np.frombuffer(head.payload, dtype=side_dtype, offset=n_codes).reshape(shape[:4]).copy()
    return TierKV(tier, grid, codes, side)


class KVCodec:
    """Codes TierKV windows against μ with `stats` (one target, one predictor)."""

    def __init__(self, stats: Stats) -> None:
        if constriction is None:
            raise ValueError("KV coding needs constriction: pip install constriction==0.5.0")
        self.stats = stats

    def _law(self, tier: str, grid: Grid, side: np.ndarray | None, mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """μ (bias-corrected) and σ in the units the tier stores (value / its side scale), flat."""
        st, ft = self.stats, _work_dtype(grid)
        m = mu.astype(ft)
        m += st.alpha.astype(ft) + st.beta.astype(ft) * m
        sig = np.broadcast_to(st.sigma.astype(ft), m.shape)
        if tier == "fp8":
            inv = np.ldexp(ft(1), -side.astype(np.int32))[..., None].astype(ft)
            m, sig = m * inv, sig * inv
        elif tier == "int8":
            scale = values_of(side, "bf16").astype(ft)[..., None]
            scale = np.where(scale > 0, scale, ft(1))
            m, sig = m / scale, sig / scale
        return m.ravel(), np.ascontiguousarray(sig).ravel()

    def check(self, mu: np.ndarray) -> None:
        L, H, D = self.stats.dims
        if mu.ndim != 5 or mu.shape[:3] != (2, L, H) or mu.shape[4] != D:
            raise ValueError(f"KV block {mu.shape} does not match the codec's target (2, {L}, {H}, S, {D})")

    def encode_window(self, kv: TierKV, mu: np.ndarray, start: int = 0) -> bytes:
        """kv and μ [2, L, H, S, D] over the same S tokens → header + payload."""
        self.check(mu)
        if kv.codes.shape != mu.shape:
            raise ValueError(f"KV {kv.codes.shape} and μ {mu.shape} cover different blocks")
        grid = GRIDS[kv.grid]
        x = values_of(kv.codes, kv.grid)
        if not np.isfinite(x).all() or (kv.tier == "int8" and not np.isfinite(values_of(kv.side, "bf16")).all()):
            raise ValueError("KV holds NaN or inf: it cannot be coded")
        enc = constriction.stream.queue.RangeEncoder()
        if kv.side is not None:
            _encode_side(enc, kv.tier, kv.side, predicted_side(kv.tier, mu))
        m, sig = self._law(kv.tier, grid, kv.side, mu)
        x, raw = x.astype(m.dtype).ravel(), kv.codes.ravel()
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, m.size, CHUNK):
                sl = slice(lo, lo + CHUNK)
                _encode_chunk(enc, grid, x[sl], raw[sl], m[sl], sig[sl], self.stats.models)
        payload = enc.get_compressed().tobytes()
        return _header(kv, True, start, payload, mu_digest(mu)) + payload

    def decode_window(self, blob: bytes, mu: np.ndarray, tier: str, grid: str) -> tuple[TierKV, int]:
        """The window at the start of `blob` (→ its TierKV and the bytes it took). Checks the
        μ and payload digests before decoding anything."""
        head = WindowHead.read(blob, tier, grid)
        return self.decode(head, mu, tier, grid), head.size

    def decode(self, head: WindowHead, mu: np.ndarray, tier: str, grid: str) -> TierKV:
        """A window whose header (and payload checksum) was read: its TierKV."""
        self.check(mu)
        if not head.coded:
            return decode_raw_window(head, tier, grid, mu.shape)
        if head.tokens != mu.shape[3]:
            raise CodecError(f"KV window holds {head.tokens} tokens, μ covers {mu.shape[3]}")
        if mu_digest(mu) != head.mu_hash:
            raise CodecError(f"KV window at token {head.start}: the predictor's μ differs from the encoder's "
                             "(another predictor, tier, kernel or thread count); refusing to decode")
        dec = constriction.stream.queue.RangeDecoder(np.frombuffer(head.payload, dtype=np.uint32).copy())
        side = _decode_side(dec, tier, predicted_side(tier, mu)) if tier in ("fp8", "int8") else None
        g = GRIDS[grid]
        m, sig = self._law(tier, g, side, mu)
        with np.errstate(over="ignore", invalid="ignore"):
            raw = np.concatenate([_decode_chunk(dec, g, grid, m[lo: lo + CHUNK], sig[lo: lo + CHUNK], self.stats.models)
                                  for lo in range(0, m.size, CHUNK)])
        return TierKV(tier, grid, raw.reshape(mu.shape), side)
