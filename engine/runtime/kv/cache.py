"""A KV cache whose per-layer buffers grow by doubling, at a KV tier (engine/runtime/kv/tiers.py).

HF's DynamicLayer appends with `torch.cat`, re-copying the whole cache on every forward, a
cost that grows with the context. Here an append copies only the new tokens and a roll-back (`crop`) is a length change.
At `native` attention reads the same values, so outputs are bit-identical (tested against HF generate).

At a lossy tier (`fp8`, `int8`) a layer's buffers hold the tier's stored form, the codes and the
per-(token, head) scales, so the memory is the tier's; `update` quantizes only the new tokens
and returns what attention reads: the whole context dequantized to the model's dtype, made anew
at each forward and dropped after it (vLLM's fp8 KV cache dequantizes inside attention the same
way). Each token is quantized on its own, so a token's stored form does not depend on how many
tokens the forward that wrote it read (docs/architecture.md, "KV tiers")."""
from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from engine.runtime.kv.tiers import Quantized, check_tier, dequantize, quantize

MIN_CAPACITY = 256  # tokens; the first prompt usually fits without a regrowth


class GrowingLayer(DynamicLayer):
    """One layer's keys and values at `tier`. `keys`/`values` read what attention reads (at a
    lossy tier, dequantized on each read: use `stored` for the codes and scales)."""

    def __init__(self, tier: str = "native", dtype: torch.dtype | None = None) -> None:
        self.tier = check_tier(tier)
        self.dtype = dtype  # the model's: what attention reads (taken from the first update)
        self._k: torch.Tensor | None = None  # codes [B, H, capacity, D] (native: the values)
        self._v: torch.Tensor | None = None
        self._ks: torch.Tensor | None = None  # scales [B, H, capacity, 1]; None at native
        self._vs: torch.Tensor | None = None
        self._len = 0
        super().__init__()

    # `keys`/`values` are HF's attributes; base-class code only ever sets them to None.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._read(self._k, self._ks) if self._k is not None else None

    @keys.setter
    def keys(self, value) -> None:
        assert value is None, "a GrowingLayer's keys change through update, crop and restore"

    @property
    def values(self) -> torch.Tensor | None:
        return self._read(self._v, self._vs) if self._v is not None else None

    @values.setter
    def values(self, value) -> None:
        assert value is None, "a GrowingLayer's values change through update, crop and restore"

    def _read(self, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        n = self._len
        if self.tier == "native":
            return codes[..., :n, :]
        return dequantize(Quantized(codes[..., :n, :], scale[..., :n, :]), self.tier, self.dtype)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def _grow(self, need: int, k: Quantized, v: Quantized) -> None:
        cap = max(need, MIN_CAPACITY, 2 * (self._k.shape[-2] if self._k is not None else 0))

        def grown(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            b, h, _, d = like.shape
            new = like.new_empty(b, h, cap, d)
            if self._len:
                new[..., : self._len, :] = old[..., : self._len, :]
            return new

        self._k, self._v = grown(self._k, k.codes), grown(self._v, v.codes)
        if k.scale is not None:
            self._ks, self._vs = grown(self._ks, k.scale), grown(self._vs, v.scale)

    def _append(self, k: Quantized, v: Quantized) -> None:
        need = self._len + k.codes.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            self._grow(need, k, v)
        self._k[..., self._len : need, :] = k.codes
        self._v[..., self._len : need, :] = v.codes
        if k.scale is not None:
            self._ks[..., self._len : need, :] = k.scale
            self._vs[..., self._len : need, :] = v.scale
        self._len = need

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(quantize(key_states, self.tier), quantize(value_states, self.tier))
        return self.keys, self.values

    def stored(self, n: int) -> tuple[Quantized, Quantized]:
        """Copies of the stored form of the first `n` tokens: (keys, values), each codes
        [B, H, n, D] and scales [B, H, n, 1] (None at native, whose codes are the values)."""
        assert 0 <= n <= self.get_seq_length(), (n, self.get_seq_length())

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[..., :n, :].clone()

        return Quantized(part(self._k), part(self._ks)), Quantized(part(self._v), part(self._vs))

    def restore(self, k: Quantized, v: Quantized) -> None:
        """Appends tokens in the stored form (`stored`'s, from a layer at the same tier): what
        attention then reads is exactly what the layer that stored them read."""
        if (k.scale is None) != (self.tier == "native"):
            raise ValueError(f"stored KV with{'out' if k.scale is None else ''} scales cannot fill a "
                             f"{self.tier} KV cache")
        if not self.is_initialized:
            self.device, self.is_initialized = k.codes.device, True
            self.dtype = k.codes.dtype if self.tier == "native" else self.dtype
            if self.dtype is None:
                raise ValueError("restoring a lossy KV tier needs the model's dtype (new_cache(model, tier))")
        self._append(k, v)

    def bytes_per_token(self) -> int:
        """Bytes this layer holds per token (keys and values, every head, codes and scales)."""
        if self._k is None:
            return 0
        per = lambda t: 0 if t is None else t[..., :1, :].numel() * t.element_size()  # noqa: E731
        return per(self._k) + per(self._v) + per(self._ks) + per(self._vs)

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        assert tokens_to_remove <= 0, "transformers ≥ 5 crops by a negative count"
        if tokens_to_remove == 0 or not self.is_initialized or self._k is None:
            return
        self._len = max(0, self._len + tokens_to_remove)

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """After a tree verify: the tokens at `start + rows` (increasing) move to `start`, … and the
        rest past `start` are dropped. Each token is stored on its own, so a move is exact at every tier."""
        assert rows == sorted(rows) and (not rows or start + rows[-1] < self._len), (start, rows, self._len)
        src = torch.tensor([start + r for r in rows], device=self._k.device)
        for buf in (self._k, self._v, self._ks, self._vs):
            if buf is not None and len(rows):
                buf[..., start : start + len(rows), :] = buf.index_select(-2, src)
        self._len = start + len(rows)

    def reset(self) -> None:
        self._k = self._v = self._ks = self._vs = None
        self._len = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a GrowingLayer holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a GrowingLayer holds one sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a GrowingLayer holds one sequence")


class GrowingCache(DynamicCache):
    def __init__(self, tier: str = "native", dtype: torch.dtype | None = None) -> None:
        self.tier = check_tier(tier)
        Cache.__init__(self, layer_class_to_replicate=functools.partial(GrowingLayer, tier, dtype))

    def stored(self, n: int) -> list[tuple[Quantized, Quantized]]:
        """Per layer, copies of the stored form (codes and scales) of the first `n` tokens: what
        the KV codec encodes and the prefix cache keeps."""
        return [layer.stored(n) for layer in self.layers]

    def restore(self, kv: list[tuple[Quantized, Quantized]], n: int | None = None) -> "GrowingCache":
        """Appends the first `n` (default all) tokens of `stored`'s output, layer by layer."""
        for i, (k, v) in enumerate(kv):
            while len(self.layers) <= i:
                self.layers.append(self.layer_class_to_replicate())
            self.layers[i].restore(*(_first(q, n) for q in (k, v)))
        return self

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Every layer's `keep_rows`: the accepted path of a tree verify, the other nodes dropped."""
        for layer in self.layers:
            layer.keep_rows(start, rows)

    def bytes_per_token(self) -> int:
        """Bytes held per token over all layers: engine/runtime/kv/tiers.py's `bytes_per_token`."""
        return sum(layer.bytes_per_token() for layer in self.layers)


def _first(q: Quantized, n: int | None) -> Quantized:
    if n is None:
        return q
    return Quantized(q.codes[..., :n, :], None if q.scale is None else q.scale[..., :n, :])


def held_bytes_per_token(cache) -> int:
    """Bytes per token a cache holds: a GrowingCache's at its tier, HF's own (native) from its
    keys and values."""
    if isinstance(cache, GrowingCache):
        return cache.bytes_per_token()
    return sum(t[..., :1, :].numel() * t.element_size() for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.numel()
               for t in (layer.keys, layer.values))


def new_cache(model: torch.nn.Module, tier: str = "native") -> Cache:
    """A growing cache at `tier` for all-full-attention models; HF's own cache for the rest
    (sliding windows, linear attention), whose layers manage their size themselves and hold
    the native tier only."""
    check_tier(tier)
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if set(layer_types) == {"full_attention"} and not getattr(cfg, "sliding_window", None):
        return GrowingCache(tier, getattr(model, "dtype", None))
    if tier != "native":
        raise ValueError(f"KV tier {tier} needs a model whose layers all attend to the whole context "
                         f"({cfg.model_type} has sliding-window or linear-attention layers); use the native KV tier")
    return DynamicCache(config=model.config)
