"""A KV cache whose per-layer buffers grow by doubling.

HF's DynamicLayer appends with `torch.cat`, re-copying the whole cache on every forward, a
cost that grows with the context. Here an append copies only the new tokens and a roll-back (`crop`) is a length change.
The attention reads the same values, so outputs are bit-identical (tested against HF generate)."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_CAPACITY = 256  # tokens; the first prompt usually fits without a regrowth


class GrowingLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None
        self._len = 0
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def _grow(self, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cap = max(need, MIN_CAPACITY, 2 * (self._k.shape[-2] if self._k is not None else 0))
        b, h, _, d = key_states.shape
        k = key_states.new_empty(b, h, cap, d)
        v = value_states.new_empty(b, h, cap, value_states.shape[-1])
        if self._len:
            k[..., : self._len, :] = self._k[..., : self._len, :]
            v[..., : self._len, :] = self._v[..., : self._len, :]
        self._k, self._v = k, v

    def _expose(self) -> None:
        self.keys = self._k[..., : self._len, :]
        self.values = self._v[..., : self._len, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        need = self._len + key_states.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            self._grow(need, key_states, value_states)
        self._k[..., self._len : need, :] = key_states
        self._v[..., self._len : need, :] = value_states
        self._len = need
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        assert tokens_to_remove <= 0, "transformers ≥ 5 crops by a negative count"
        if tokens_to_remove == 0 or not self.is_initialized or self._k is None:
            return
        self._len = max(0, self._len + tokens_to_remove)
        self._expose()

    def reset(self) -> None:
        self._k = self._v = None
        self._len = 0
        super().reset()


class GrowingCache(DynamicCache):
    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def new_cache(model: torch.nn.Module) -> Cache:
    """A growing cache for all-full-attention models; HF's own cache for the rest (sliding
    windows, linear attention), whose layers manage their size themselves."""
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if set(layer_types) == {"full_attention"} and not getattr(cfg, "sliding_window", None):
        return GrowingCache()
    return DynamicCache(config=model.config)
