"""KV offload and prefetch: a context's KV moves to a slow tier and back, window by window
(docs/architecture.md, "KV offload").

A window of W tokens leaves as the tier's stored form (engine/runtime/kv/tiers.py), either as it is or
coded against the predictor (engine/runtime/kv/codec.py), and lands in a slow tier: files in a folder,
or host memory behind a link of modelled bandwidth and latency. A restore is pipelined: a
fetch thread has window i+1 in flight (the link or the disk, which free the GIL) while the
caller's thread runs the predictor over window i's tokens and decodes it. The whole restore is
checked before any of it is used: a window that fails its checksum, a μ that differs, or a
manifest from another target raises, and the caller's cache is untouched.

The predictor reads the context in the same windows on both sides (`MuStream`): μ at a token
depends on how many tokens each forward read, so encoder and decoder must chunk alike; the μ
digest in each window catches any other difference (a kernel, a thread count)."""
from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.runtime.kv.cache import GrowingCache, GrowingLayer
from engine.runtime.kv.codec import (
    RAW_DTYPES,
    CodecError,
    KVCodec,
    TierKV,
    WindowHead,
    concat,
    decode_raw_window,
    encode_raw_window,
)
from engine.runtime.kv.pipeline import Link
from engine.runtime.kv.tiers import Quantized, bytes_per_token, check_tier

GRID_OF_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TORCH_RAW = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}
FP8_CODES = "e4m3"

# Per layer (keys, values), each [1, H, S, D]: a native cache's tensors, or a lossy tier's
# stored form (codes and scales), as `GrowingCache.stored` and `prefix_cache.kv_of` give them.
KV = list[tuple[torch.Tensor | Quantized, torch.Tensor | Quantized]]


# ---- stored form ⇄ the codec's blocks ---------------------------------------------------------

def _as_quantized(t: torch.Tensor | Quantized) -> Quantized:
    return t if isinstance(t, Quantized) else Quantized(t, None)


def tier_kv(kv: KV, tier: str) -> TierKV:
    """The codec's [2, L, H, S, D] block of a cache's stored form (batch 1)."""
    pairs = [(_as_quantized(k), _as_quantized(v)) for k, v in kv]
    codes = torch.stack([torch.stack([k.codes[0], v.codes[0]]) for k, v in pairs], 1)  # [2, L, H, S, D]
    if tier == "native":
        grid = GRID_OF_DTYPE.get(codes.dtype)
        if grid is None:
            raise ValueError(f"a native KV cache of {codes.dtype} cannot be offloaded (bf16, fp16, fp32)")
        return TierKV(tier, grid, codes.contiguous().view(TORCH_RAW[grid]).numpy().view(np.dtype(f"u{codes.element_size()}")))
    side = torch.stack([torch.stack([k.scale[0, ..., 0], v.scale[0, ..., 0]]) for k, v in pairs], 1)  # [2, L, H, S]
    if tier == "fp8":
        return TierKV(tier, FP8_CODES, codes.contiguous().view(torch.uint8).numpy(), side.contiguous().numpy())
    return TierKV(tier, "int8", codes.contiguous().view(torch.uint8).numpy(),
                  side.contiguous().view(torch.int16).numpy().view(np.uint16))


def stored_form(kv: TierKV) -> KV:
    """Inverse of `tier_kv`: per layer (keys, values) as a cache at kv.tier restores them."""
    codes = torch.from_numpy(np.ascontiguousarray(kv.codes))
    if kv.tier == "native":
        codes = codes.view({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kv.grid])
        return [(codes[0, i][None], codes[1, i][None]) for i in range(codes.shape[1])]
    if kv.tier == "fp8":
        codes, side = codes.view(torch.float8_e4m3fn), torch.from_numpy(np.ascontiguousarray(kv.side))
    else:
        codes = codes.view(torch.int8)
        side = torch.from_numpy(np.ascontiguousarray(kv.side).view(np.int16)).view(torch.bfloat16)
    return [(Quantized(codes[0, i][None], side[0, i][None, ..., None]), Quantized(codes[1, i][None], side[1, i][None, ..., None]))
            for i in range(codes.shape[1])]


# ---- μ, window by window ---------------------------------------------------------------------

class _TapLayer(GrowingLayer):
    """A growing layer that keeps the last keys and values it was handed, before its tier
    quantizes them: the predictor's μ for those tokens."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.last = (key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


class MuStream:
    """The predictor's KV over a context, read window by window: float32 [2, L, H, n, D] for the
    next n tokens after those already read. Both sides of the codec read the same windows.

    The predictor's own cache is at the target's KV tier: at a lossy tier the target attends to
    quantized keys and values, and a predictor that does the same follows it (on the
    embedded target's fp8 cache, 2.72 → 2.59 bits a scalar with the same statistics, 1024
    held-out tokens)."""

    def __init__(self, model: torch.nn.Module, tier: str = "native") -> None:
        self.model, self.tier = model, tier
        self.body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.cache = GrowingCache(tier, model.dtype)
        self.cache.layer_class_to_replicate = functools.partial(_TapLayer, tier, model.dtype)
        self.read = 0

    @torch.inference_mode()
    def next(self, ids: list[int]) -> np.ndarray:
        self.body(input_ids=torch.tensor([ids], device=self.model.device), cache=self.cache, use_cache=True)
        self.read += len(ids)
        return np.stack([np.stack([layer.last[0][0].float().cpu().numpy(), layer.last[1][0].float().cpu().numpy()])
                         for layer in self.cache.layers], 1)


# ---- slow tiers ---------------------------------------------------------------------------------

class SlowTier:
    """Where offloaded windows live: files in `folder`, or host memory when it is None; `link`
    (if any) makes every fetch wait its modelled transfer time."""

    def __init__(self, folder: Path | str | None = None, link: Link | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.link = link
        self._mem: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, blob: bytes) -> None:
        if self.folder is None:
            with self._lock:
                self._mem[name] = blob
        else:
            tmp = self.folder / f".{name}.tmp"
            tmp.write_bytes(blob)
            tmp.replace(self.folder / name)  # a reader never sees half a window

    def get(self, name: str) -> bytes:
        t0 = time.perf_counter()
        if self.folder is None:
            with self._lock:
                blob = self._mem.get(name)
        else:
            path = self.folder / name
            blob = path.read_bytes() if path.exists() else None
        if blob is None:
            raise CodecError(f"offloaded KV window {name} is missing from the slow tier")
        if self.link is not None:
            time.sleep(max(0.0, self.link.seconds(len(blob)) - (time.perf_counter() - t0)))
        return blob

    def delete(self, name: str) -> None:
        if self.folder is None:
            with self._lock:
                self._mem.pop(name, None)
        else:
            (self.folder / name).unlink(missing_ok=True)


# ---- offload and restore ---------------------------------------------------------------------

@dataclass
class Offloaded:
    """What a restore needs besides the windows: which tokens, tier, grid, shape and coding."""

    name: str
    tokens: tuple[int, ...]
    tier: str
    grid: str
    dims: tuple[int, int, int]  # layers, KV heads, head dim
    window: int
    codec_digest: bytes | None  # the codec's stats digest; None when not coded
    sizes: list[int] = field(default_factory=list)  # bytes of each window as stored

    @property
    def coded(self) -> bool:
        return self.codec_digest is not None

    def windows(self) -> list[tuple[int, int]]:
        n = len(self.tokens)
        return [(lo, min(lo + self.window, n)) for lo in range(0, n, self.window)]

    def part(self, i: int) -> str:
        return f"{self.name}.{i:05d}.kvw"

    @property
    def raw_bytes(self) -> int:
        """The stored form's bytes (codes and side numbers), what a raw transfer moves."""
        native_bytes = np.dtype(RAW_DTYPES[self.grid]).itemsize
        return int(bytes_per_token(self.tier, *self.dims, native_bytes)) * len(self.tokens)

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes)


def check_window(window: int, tokens: int) -> None:
    if not 1 <= window <= max(tokens, 1):
        raise ValueError(f"the prefetch window W must be between 1 and the context's {tokens} tokens, got {window}")


@dataclass
class Timing:
    """Seconds a restore spent per window: fetching (its own thread), μ and decoding (the
    caller's), and the whole restore on the wall."""

    fetch: list[float] = field(default_factory=list)
    mu: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    wall: float = 0.0


def _check_fresh(mu: MuStream, tier: str) -> None:
    """Both sides read μ from the first token, with the predictor's cache at the KV's tier."""
    if mu.tier != tier or mu.read:
        raise ValueError(f"the μ stream must be fresh and at the KV's tier {tier} (it is at {mu.tier}, {mu.read} tokens read)")


def offload(kv: KV, tokens: list[int] | tuple[int, ...], tier: str, slow: SlowTier, name: str, window: int,
            codec: KVCodec | None = None, mu: MuStream | None = None) -> Offloaded:
    """Moves `kv` (a cache's stored form over `tokens`) into `slow` in windows of `window`
    tokens, coded against `mu` when `codec` is given. Returns the manifest a restore reads."""
    block = tier_kv(kv, check_tier(tier))
    if block.tokens != len(tokens):
        raise ValueError(f"the KV covers {block.tokens} tokens, {len(tokens)} were named")
    check_window(window, len(tokens))
    if (codec is None) != (mu is None):
        raise ValueError("coding needs both a codec and the predictor's μ stream")
    if mu is not None:
        _check_fresh(mu, tier)
    _, L, H, _, D = block.codes.shape
    off = Offloaded(name, tuple(tokens), tier, block.grid, (L, H, D), window,
                    None if codec is None else codec.stats.digest)
    for i, (lo, hi) in enumerate(off.windows()):
        part = block.window(lo, hi)
        blob = encode_raw_window(part, lo) if codec is None else codec.encode_window(part, mu.next(list(tokens[lo:hi])), lo)
        slow.put(off.part(i), blob)
        off.sizes.append(len(blob))
    return off


def restore(off: Offloaded, slow: SlowTier, codec: KVCodec | None = None, mu: MuStream | None = None,
            timing: Timing | None = None) -> KV:
    """The stored form back, pipelined: window i+1 is fetched while window i is decoded. Every
    window is checked before the result is returned; on any error nothing is returned."""
    if off.coded:
        if codec is None or mu is None:
            raise ValueError("this KV was offloaded coded: restoring it needs its codec and predictor")
        if codec.stats.digest != off.codec_digest:
            raise CodecError("the KV was coded with another codec (another target, predictor or calibration)")
        _check_fresh(mu, off.tier)
        if codec.stats.dims != off.dims:
            raise CodecError(f"the codec's target has KV {codec.stats.dims}, the offloaded KV {off.dims}")
    timing = timing if timing is not None else Timing()
    t_start = time.perf_counter()
    spans = off.windows()
    inbox: queue.Queue = queue.Queue(maxsize=1)  # one window waiting + one in flight: bounded memory
    stop = threading.Event()

    def fetch() -> None:
        for i in range(len(spans)):
            if stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                item = slow.get(off.part(i))
            except Exception as e:  # noqa: BLE001 - handed to the decoding thread, which raises it
                item = e
            timing.fetch.append(time.perf_counter() - t0)
            inbox.put(item)
            if isinstance(item, Exception):
                return

    thread = threading.Thread(target=fetch, name="kv-prefetch", daemon=True)
    thread.start()
    L, H, D = off.dims
    parts: list[TierKV] = []
    try:
        for lo, hi in spans:
            t0 = time.perf_counter()
            m = mu.next(list(off.tokens[lo:hi])) if off.coded else None  # needs no data: overlaps the fetch
            t1 = time.perf_counter()
            blob = inbox.get()
            if isinstance(blob, Exception):
                raise blob
            t2 = time.perf_counter()
            head = WindowHead.read(blob, off.tier, off.grid)
            if head.start != lo or head.coded != off.coded:
                raise CodecError(f"KV window {len(parts)} is not the one the manifest names (order or coding)")
            if off.coded:
                part = codec.decode(head, m, off.tier, off.grid)
            else:
                part = decode_raw_window(head, off.tier, off.grid, (2, L, H, hi - lo, D))
            timing.mu.append(t1 - t0)
            timing.decode.append(time.perf_counter() - t2)
            parts.append(part)
    finally:
        stop.set()
        while thread.is_alive():  # let the fetcher finish its put, then it sees `stop`
            try:
                inbox.get(timeout=0.05)
            except queue.Empty:
                pass
    timing.wall = time.perf_counter() - t_start
    return stored_form(concat(parts))


def drop(off: Offloaded, slow: SlowTier) -> None:
    for i in range(len(off.windows())):
        slow.delete(off.part(i))
