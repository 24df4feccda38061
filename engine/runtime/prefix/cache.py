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

A row-invariant draft's positions are path-independent (engine/runtime/invariance.py), so reusing them
leaves live runs replayable from traces; any other draft takes them only from an exact repeat
(`DraftModelProposer._reusable`). The target's reused positions were computed in
another request's batches; where the target's kernels round a row differently with the batch,
output can drift from a cold prefill, which `python -m engine divergence` measures.

With a `Spill`, an evicted entry does not vanish: its target KV moves to a slow tier (files or
host memory behind a link, engine/runtime/kv/offload.py) in windows, raw or coded, and a stub keeps its
tokens and logits in the bucket; a later hit restores it (pipelined, every window checked) and
takes it back into memory. The draft's state is not spilled (the draft reads the prompt again).
The spill tier has its own byte budget and LRU; a stub whose restore fails is dropped, a miss.

With a `PrefixDisk` (engine/runtime/prefix/disk.py), every stored entry is also written to a folder
that outlives the process, and a lookup that memory cannot answer exactly asks the folder: the CLI
runs one request a process, and this is how its next run takes the prefix."""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.kv.offload import KV, Offloaded, SlowTier, drop, offload, restore

if TYPE_CHECKING:
    from engine.runtime.kv.calibration import CodecKit
from engine.runtime.kv.tiers import Quantized

DIGEST_TOKENS = 16  # tokens the bucket digest reads (RAKV-ASD)
DIGEST_BYTES = 12
DEFAULT_BUDGET = 512 << 20  # bytes (RAKV-ASD's 512 MiB)


def digest(key: tuple, tokens: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(repr(key).encode(), digest_size=DIGEST_BYTES)
    h.update(array("q", tokens[:DIGEST_TOKENS]).tobytes())
    return h.digest()


def kv_of(cache, length: int) -> KV:
    """Copies of the first `length` positions of every layer of an HF-style cache; of a cache at
    a lossy KV tier, its stored form (the tier's bytes, not the dequantized values)."""
    if getattr(cache, "tier", "native") != "native":
        return cache.stored(length)
    return [(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone()) for layer in cache.layers]


def _nbytes(t: torch.Tensor | Quantized | None) -> int:
    if isinstance(t, Quantized):
        return _nbytes(t.codes) + _nbytes(t.scale)
    return 0 if t is None else t.numel() * t.element_size()


def kv_bytes(kv: KV) -> int:
    return sum(_nbytes(k) + _nbytes(v) for k, v in kv)


def fill(cache, kv: KV, length: int):
    """`cache` (empty, at the tier `kv` was taken at) holding the first `length` positions of `kv`."""
    if kv and isinstance(kv[0][0], Quantized):
        return cache.restore(kv, length)
    for i, (k, v) in enumerate(kv):
        cache.update(k[..., :length, :], v[..., :length, :], i)
    return cache


@dataclass
class Spill:
    """Where evicted entries go: a slow tier, its byte budget, the window W they move in, and
    optionally a codec kit (engine/runtime/kv/calibration.py) to code them against the predictor."""

    slow: SlowTier
    budget_bytes: int
    window: int = 256
    kit: CodecKit | None = None

    def __post_init__(self) -> None:
        if not self.budget_bytes > 0 or self.window < 1:
            raise ValueError(f"a spill tier needs a budget > 0 bytes and W ≥ 1, got {self.budget_bytes}, {self.window}")


@dataclass(eq=False)
class Entry:
    key: tuple  # the pair it belongs to: target, draft, tiers, device
    tokens: tuple[int, ...]  # what the target's KV covers
    kv: KV  # the target's, over `tokens`
    n_prompt: int  # `logits` follow tokens[:n_prompt]
    logits: torch.Tensor  # [V] the target's next-token logits after the prompt
    draft_kv: KV | None = None  # the draft's, over tokens[:draft_len]
    draft_len: int = 0
    kv_tier: str = "native"  # the tier `kv`'s stored form is at
    spilled: Offloaded | None = None  # set while `kv` lives in the spill tier (kv is then None)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = kv_bytes(self.kv or []) + kv_bytes(self.draft_kv or []) + self.logits.numel() * self.logits.element_size()


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
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET, spill: Spill | None = None,
                 disk: Any = None) -> None:  # a prefix.disk.PrefixDisk (it imports this module)
        if not budget_bytes > 0:
            raise ValueError(f"the prefix cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.spill = spill
        self.disk = disk  # entries kept across processes (the CLI's); None: this process only
        self._lock = threading.Lock()
        self._buckets: dict[bytes, list[Entry]] = {}
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # id(entry) → entry, oldest first
        self._spilled: OrderedDict[int, Entry] = OrderedDict()  # stubs whose KV is in the spill tier
        self.bytes = self.peak_bytes = self.spill_bytes = 0
        self._names = 0
        self.counters = dict(lookups=0, exact_hits=0, partial_hits=0, misses=0, reused_tokens=0,
                             stored=0, evictions=0, refused=0, spilled=0, spill_hits=0, spill_dropped=0,
                             spill_errors=0, disk_hits=0)

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
            if best is not None and best.spilled is not None and not self._unspill(best):
                best, best_q = None, 0  # its restore failed: the stub is gone
            exact = best is not None and best.n_prompt == len(prompt) == best_q
            if self.disk is not None and not exact:
                found = self.disk.find(key, prompt, beat=(best_q, False))
                if found is not None:  # kept in memory too, when it fits: the next lookup is cheap
                    best, best_q = found, _lcp(found.tokens, prompt)
                    self._take_in(found)
                    self.counters["disk_hits"] += 1
            if best is None:
                self.counters["misses"] += 1
                return Hit("miss", 0)
            if id(best) in self._lru:  # not when a disk entry over the memory budget is used once
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
        until it fits; False, and nothing stored in memory, when it alone exceeds the budget. With
        a disk tier it is written there too, under the disk's own budget."""
        with self._lock:
            if self.disk is not None:  # first: a spill on admission would empty entry.kv
                self.disk.save(entry)
            if entry.nbytes > self.budget:
                self.counters["refused"] += 1
                return False
            bucket = self._buckets.setdefault(digest(entry.key, entry.tokens), [])
            for old in [e for e in bucket if e.key == entry.key and e.tokens == entry.tokens]:
                self._drop(old)
            self._admit(entry)
            self._buckets.setdefault(digest(entry.key, entry.tokens), []).append(entry)
            self.counters["stored"] += 1
            return True

    def _admit(self, entry: Entry) -> None:
        """Into memory (the entry is already in its bucket, or about to be), evicting the least
        recently used, which spill when a spill tier is set."""
        while self.bytes + entry.nbytes > self.budget:
            old = next(iter(self._lru.values()))
            self._spill_out(old) if self.spill is not None else self._drop(old)
            self.counters["evictions"] += 1
        self._lru[id(entry)] = entry
        self.bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _drop(self, entry: Entry) -> None:
        bucket_key = digest(entry.key, entry.tokens)
        bucket = self._buckets[bucket_key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[bucket_key]
        if entry.spilled is not None:
            del self._spilled[id(entry)]
            self.spill_bytes -= entry.nbytes
            drop(entry.spilled, self.spill.slow)
            entry.spilled = None
        else:
            del self._lru[id(entry)]
            self.bytes -= entry.nbytes

    def _spill_out(self, entry: Entry) -> None:
        """Moves an entry's target KV from memory into the spill tier; it stays findable."""
        sp = self.spill
        del self._lru[id(entry)]
        self.bytes -= entry.nbytes
        n = len(entry.tokens)
        self._names += 1
        coded = sp.kit is not None
        entry.spilled = offload(entry.kv, entry.tokens, entry.kv_tier, sp.slow, f"prefix{id(self):x}-{self._names}",
                                min(sp.window, n), sp.kit.codec(entry.kv_tier) if coded else None,
                                sp.kit.mu(entry.kv_tier) if coded else None)
        entry.kv, entry.draft_kv, entry.draft_len = None, None, 0
        entry.nbytes = entry.spilled.stored_bytes + entry.logits.numel() * entry.logits.element_size()
        self._spilled[id(entry)] = entry
        self.spill_bytes += entry.nbytes
        self.counters["spilled"] += 1
        while self.spill_bytes > sp.budget_bytes:
            self._drop(next(iter(self._spilled.values())))
            self.counters["spill_dropped"] += 1

    def _unspill(self, entry: Entry) -> bool:
        """Brings a spilled entry's KV back into memory; False (and the stub dropped) when its
        restore fails or it no longer fits."""
        sp, off = self.spill, entry.spilled
        coded = off.coded
        try:
            kv = restore(off, sp.slow, sp.kit.codec(entry.kv_tier) if coded else None,
                         sp.kit.mu(entry.kv_tier) if coded else None)
        except ValueError:  # CodecError among them: corrupt, missing or mismatched windows
            self.counters["spill_errors"] += 1
            self._drop(entry)
            return False
        self._drop(entry)  # out of the spill tier (and its bucket) …
        entry.kv = kv
        entry.nbytes = kv_bytes(kv) + entry.logits.numel() * entry.logits.element_size()
        if not self._take_in(entry):  # … and back into memory and its bucket
            return False
        self.counters["spill_hits"] += 1
        return True

    def _take_in(self, entry: Entry) -> bool:
        """An entry from a slower tier into memory and its bucket; False when it alone exceeds
        the budget."""
        if entry.nbytes > self.budget:
            return False
        self._admit(entry)
        self._buckets.setdefault(digest(entry.key, entry.tokens), []).append(entry)
        return True

    def entries(self) -> list[Entry]:
        """Oldest first (the next to be evicted)."""
        with self._lock:
            return list(self._lru.values())

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters, entries=len(self._lru), bytes=self.bytes, peak_bytes=self.peak_bytes,
                       budget_bytes=self.budget, spilled_entries=len(self._spilled), spill_bytes=self.spill_bytes)
            if self.disk is not None:
                out["disk"] = self.disk.stats()
            return out


def spilling(budget_bytes: int, spill_factor: int = 4, folder: str | None = None, window: int = 256) -> PrefixCache:
    """A prefix cache whose evictions spill, raw, to files in `folder` (a temporary folder that
    goes with the cache, by default) under `spill_factor` × its memory budget. Raw, not coded: on
    a local disk the coded restore loses (`bench kv`: coding pays below ~0.05 Gbit/s on 2 CPU
    cores, where the predictor's forward dominates)."""
    import tempfile

    tmp = None if folder is not None else tempfile.TemporaryDirectory(prefix="speclab-spill-")
    cache = PrefixCache(budget_bytes, Spill(SlowTier(folder or tmp.name), spill_factor * int(budget_bytes), window))
    cache._tmp = tmp  # removed with the cache
    return cache


def _lcp(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
