"""Cross-request prefix KV reuse, as RAKV-ASD describes it (docs/architecture.md, "Prefix reuse").

An entry holds what a finished request left in the target's KV cache (its prompt and output, all
but the newest token), the target's next-token logits after the prompt, and the draft's state
over the same tokens. A 12-byte BLAKE2b digest of the pair's identity and the first 16 tokens
picks a bucket; the longest common prefix (LCP) with each entry in it is then checked token by
token, so a digest collision can never hand out another prompt's state. A hit of q tokens takes
min(q, len(prompt) − 1) positions and recomputes the rest (at least the last prompt token, whose
logits start the answer); an exact repeat of a stored prompt takes every position and the stored
logits. Entries are evicted least recently used first under a byte budget; one larger than the
whole budget is refused. One lock guards it: workbench sessions share a loaded pair and its cache.

A row-invariant draft's positions are path-independent (engine/invariance.py), so reusing them
leaves live runs replayable from traces; any other draft takes them only from an exact repeat
(`DraftModelProposer._reusable`). The target's reused positions were computed in
another request's batches; where the target's kernels round a row differently with the batch,
output can drift from a cold prefill, which `python -m engine divergence` measures."""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

DIGEST_TOKENS = 16  # tokens the bucket digest reads (RAKV-ASD)
DIGEST_BYTES = 12
DEFAULT_BUDGET = 512 << 20  # bytes (RAKV-ASD's 512 MiB)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values): [1, H_kv, S, D]


def digest(key: tuple, tokens: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(repr(key).encode(), digest_size=DIGEST_BYTES)
    h.update(array("q", tokens[:DIGEST_TOKENS]).tobytes())
    return h.digest()


def kv_of(cache, length: int) -> KV:
    """Copies of the first `length` positions of every layer of an HF-style cache."""
    return [(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone()) for layer in cache.layers]


def kv_bytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def fill(cache, kv: KV, length: int):
    """`cache` (empty) holding the first `length` positions of `kv`."""
    for i, (k, v) in enumerate(kv):
        cache.update(k[..., :length, :], v[..., :length, :], i)
    return cache


@dataclass(eq=False)
class Entry:
    key: tuple  # the pair it belongs to: target, draft, tiers, device
    tokens: tuple[int, ...]  # what the target's KV covers
    kv: KV  # the target's, over `tokens`
    n_prompt: int  # `logits` follow tokens[:n_prompt]
    logits: torch.Tensor  # [V] the target's next-token logits after the prompt
    draft_kv: KV | None = None  # the draft's, over tokens[:draft_len]
    draft_len: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = kv_bytes(self.kv) + kv_bytes(self.draft_kv or []) + self.logits.numel() * self.logits.element_size()


@dataclass(frozen=True)
class Hit:
    kind: str  # "miss" | "partial" | "exact"
    reused: int  # target positions taken from the entry
    entry: Entry | None = None

    @property
    def logits(self) -> torch.Tensor | None:
        """The stored next-token logits, for an exact repeat of a stored prompt."""
        return self.entry.logits if self.kind == "exact" else None

    def draft_positions(self) -> int:
        return min(self.reused, self.entry.draft_len) if self.entry is not None else 0


class PrefixCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET) -> None:
        if not budget_bytes > 0:
            raise ValueError(f"the prefix cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self._lock = threading.Lock()
        self._buckets: dict[bytes, list[Entry]] = {}
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # id(entry) → entry, oldest first
        self.bytes = self.peak_bytes = 0
        self.counters = dict(lookups=0, exact_hits=0, partial_hits=0, misses=0, reused_tokens=0,
                             stored=0, evictions=0, refused=0)

    def lookup(self, key: tuple, prompt: list[int]) -> Hit:
        """The entry sharing the longest prefix with `prompt` under this pair (verified token by
        token), and how many positions to take from it."""
        with self._lock:
            self.counters["lookups"] += 1
            best, best_q = None, 0
            for e in self._buckets.get(digest(key, prompt), ()):
                q = _lcp(e.tokens, prompt) if e.key == key else 0
                if q > best_q:
                    best, best_q = e, q
            if best is None:
                self.counters["misses"] += 1
                return Hit("miss", 0)
            self._lru.move_to_end(id(best))
            if best.n_prompt == len(prompt) == best_q:
                hit = Hit("exact", best_q, best)
            else:
                hit = Hit("partial", min(best_q, len(prompt) - 1), best)
            self.counters["exact_hits" if hit.kind == "exact" else "partial_hits"] += 1
            self.counters["reused_tokens"] += hit.reused
            return hit

    def put(self, entry: Entry) -> bool:
        """Stores `entry` (replacing one over the same tokens), evicting the least recently used
        until it fits; False, and nothing stored, when it alone exceeds the budget."""
        with self._lock:
            if entry.nbytes > self.budget:
                self.counters["refused"] += 1
                return False
            bucket = self._buckets.setdefault(digest(entry.key, entry.tokens), [])
            for old in [e for e in bucket if e.key == entry.key and e.tokens == entry.tokens]:
                self._drop(old)
            while self.bytes + entry.nbytes > self.budget:
                self._drop(next(iter(self._lru.values())))
                self.counters["evictions"] += 1
            self._buckets.setdefault(digest(entry.key, entry.tokens), []).append(entry)
            self._lru[id(entry)] = entry
            self.bytes += entry.nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self.counters["stored"] += 1
            return True

    def _drop(self, entry: Entry) -> None:
        bucket_key = digest(entry.key, entry.tokens)
        bucket = self._buckets[bucket_key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[bucket_key]
        del self._lru[id(entry)]
        self.bytes -= entry.nbytes

    def entries(self) -> list[Entry]:
        """Oldest first (the next to be evicted)."""
        with self._lock:
            return list(self._lru.values())

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, entries=len(self._lru), bytes=self.bytes, peak_bytes=self.peak_bytes,
                        budget_bytes=self.budget)


def _lcp(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
