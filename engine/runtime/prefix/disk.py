"""The prefix cache's disk tier: entries that outlive the process (docs/architecture.md, "Prefix reuse").

The CLI runs one request per process, so an in-memory prefix cache never sees a second request;
this tier lets the next process take what the last one left. An entry is one safetensors file in
the folder (no pickle: the arrays, and a JSON string in the header), holding what an in-memory
`Entry` holds: the target's KV over its tokens in the KV tier's stored form (laid out as the KV
offload's file tier lays it out, `offload.tier_kv`, and read back with `offload.stored_form`), the
next-token logits after the prompt, and the draft's KV when it can be laid out the same way
(otherwise the draft reads the prompt again, as after a spill).

Names: `<bucket>-<entry>.safetensors`, the bucket the in-memory cache's digest of the key and the
first 16 tokens, the entry a digest of the key, the prompt length and every token; the key is
`TargetVerifier.key()` plus the pair's identity (`pair_identity`: what else decides the stored
bits in another process). A lookup reads the headers in the prompt's bucket, verifies the common
prefix token by token, then reads the best entry whole and checks its checksum (SHA-256 over the
header's JSON and every array's name, dtype, shape and bytes) before any of it is used. A corrupt,
truncated or mismatched entry is removed with one warning line and the lookup goes on as if it
were absent. Writes go to a temporary file renamed into place, so another process never reads
half an entry. The folder keeps a byte budget: after each write the least recently used entries
(recency: the file's mtime, set at every write and hit) go until the rest fit."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from engine.runtime.kv.codec import TierKV
from engine.runtime.kv.offload import KV, stored_form, tier_kv
from engine.runtime.kv.tiers import Quantized
from engine.runtime.prefix.cache import Entry, digest

if TYPE_CHECKING:
    from engine.runtime.models import ModelPair

FORMAT = 1  # an entry of another format is removed on sight, not misread
SUFFIX = ".safetensors"
META, CHECKSUM = "speclab.prefix", "speclab.checksum"  # the safetensors header's metadata keys
DEFAULT_BUDGET_MIB = 2048
MAX_HEADER = 16 << 20  # bytes; a header length past this is damage, not an entry
STALE_TMP_NS = 3600 * 10**9  # a temporary file this old was left by a writer that died
WEIGHT_SAMPLES = 256  # values read from each weight tensor for the pair's identity
_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views


class Damaged(Exception):
    """An entry that must not be used: the message says why, for the one warning line."""


def default_folder() -> Path:
    """Beside the converted models: one folder per user, shared by every process of it
    ($SPECLAB_PREFIX_DIR overrides it: the test suite keeps its entries out of the user's cache)."""
    from engine.runtime.embedded import cache_dir

    return Path(os.environ.get("SPECLAB_PREFIX_DIR") or cache_dir() / "prefix-kv")


def mib_to_bytes(mib: float, flag: str = "--prefix-disk-budget") -> int:
    """A budget in MiB from the command line, as bytes; a ValueError naming `flag` otherwise."""
    if not (isinstance(mib, (int, float)) and np.isfinite(mib) and mib > 0):
        raise ValueError(f"{flag} must be a number of MiB > 0, got {mib}")
    return int(mib * 2**20)


def pair_identity(pair: ModelPair) -> str:
    """What decides an entry's bits besides `TargetVerifier.key()`, which names models by path:
    the weights behind the names (a folder's files can change between processes), the torch and
    transformers releases and the thread count (a GEMM's reduction order follows them: another
    process must compute the very bits a cold read here would), and how the draft reads."""
    import transformers

    h = hashlib.blake2b(digest_size=16)
    h.update(repr((torch.__version__, transformers.__version__, torch.get_num_threads(),
                   pair.draft_row_invariant)).encode())
    for model in (pair.target, pair.draft):
        _hash_weights(model, h)
    return h.hexdigest()


def _hash_weights(model: torch.nn.Module, h) -> None:
    """Every tensor's name, shape, dtype and an even sample of its values: milliseconds for a
    model of hundreds of millions of weights, and any retraining changes the samples."""
    for name, t in model.state_dict().items():
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        try:
            flat = t.detach().reshape(-1)
            part = flat[:: max(1, flat.numel() // WEIGHT_SAMPLES)][:WEIGHT_SAMPLES].contiguous().cpu()
            h.update(part.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a tensor type without a byte view: its name and shape only
            pass


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass
class PrefixDisk:
    """A folder of prefix-cache entries under a byte budget. `identity`: `pair_identity` of the
    pair whose entries these are; `device`: where a read entry's tensors go; `warn`: where the one
    line about a damaged entry, or a write that failed, goes."""

    folder: Path
    budget_bytes: int
    identity: str = ""
    device: torch.device | str = "cpu"
    warn: Callable[[str], None] = _stderr
    counters: dict = field(default_factory=lambda: dict(hits=0, misses=0, damaged=0, stored=0, refused=0,
                                                        evictions=0, write_errors=0))
    _write_failed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if not self.budget_bytes > 0:
            raise ValueError(f"the prefix cache's disk budget must be > 0 bytes, got {self.budget_bytes}")

    # -- reading -----------------------------------------------------------------------------
    def find(self, key: tuple, prompt: list[int], beat: tuple[int, bool] = (0, False)) -> Entry | None:
        """The stored entry sharing the longest prefix with `prompt` (exact repeats of the prompt
        first among equals), if it ranks above `beat` (what memory offers: common prefix, exact);
        checked whole before it is returned. Never raises: damage reads as absence."""
        ranked = []
        for path in self._bucket_files(key, prompt):
            try:
                meta = json.loads(_read_header(path)[0])
                if meta.get("key") != repr(key) or meta.get("identity") != self.identity:
                    continue  # another pair's entry in a colliding bucket: not ours to judge
                rank = _rank([int(t) for t in meta["tokens"]], int(meta["n_prompt"]), prompt)
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            except Exception as e:  # noqa: BLE001 - any damage is a reason to remove, never to fail
                self._drop_damaged(path, _why(e))
                continue
            if rank > beat:
                ranked.append((rank, path))
        for _, path in sorted(ranked, key=lambda r: r[0], reverse=True):
            try:
                entry = self._read(path, key)
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            except Exception as e:  # noqa: BLE001
                self._drop_damaged(path, _why(e))
                continue
            _touch(path)
            self.counters["hits"] += 1
            return entry
        self.counters["misses"] += 1
        return None

    def _read(self, path: Path, key: tuple) -> Entry:
        data = path.read_bytes()
        meta_text, checksum = _header_of(data)
        arrays = {name: a.copy() for name, a in load_arrays(data).items()}  # writable: torch shares them
        if _checksum(meta_text, arrays) != checksum:
            raise Damaged("its checksum does not match its bytes")
        meta = json.loads(meta_text)
        if meta["format"] != FORMAT:
            raise Damaged(f"it is of format {meta['format']}, this release reads {FORMAT}")
        tokens = tuple(int(t) for t in meta["tokens"])
        if path.name != self._file_name(key, tokens, meta["n_prompt"]):
            raise Damaged("its name does not match its content")
        kv = stored_form(TierKV(meta["kv_tier"], meta["grid"], arrays["kv.codes"], arrays.get("kv.side")))
        if _positions(kv) != len(tokens):
            raise Damaged("its KV does not cover its tokens")
        draft, draft_len = None, 0
        if meta.get("draft") is not None:
            draft = _to(stored_form(TierKV("native", meta["draft"]["grid"], arrays["draft.codes"])), self.device)
            draft_len = int(meta["draft"]["length"])
        logits = torch.from_numpy(arrays["logits"]).view(_dtype(meta["logits_dtype"])).to(self.device)
        return Entry(key, tokens, _to(kv, self.device), int(meta["n_prompt"]), logits, draft, draft_len,
                     meta["kv_tier"])

    # -- writing -----------------------------------------------------------------------------
    def save(self, entry: Entry) -> bool:
        """Stores `entry` (already there: marks it used), then evicts the least recently used
        entries past the budget; False when it is not stored (over the budget alone, a KV that
        cannot be laid out, a failed write: one warning line, once)."""
        from engine.base.helpers import one_line

        path = self.folder / self._file_name(entry.key, entry.tokens, entry.n_prompt)
        if path.exists():
            _touch(path)
            return True
        try:
            blob = encode(entry, self.identity)
        except Exception as e:  # noqa: BLE001 - a cache layout the stored form cannot hold: the run goes on
            self._write_error(f"cannot lay out this model's KV ({one_line(e, 160)})")
            return False
        if len(blob) > self.budget_bytes:
            self.counters["refused"] += 1
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, blob)
            _touch(path)
        except OSError as e:
            self._write_error(f"cannot write to {self.folder} ({e.strerror or e})")
            return False
        self.counters["stored"] += 1
        self._evict()
        return True

    def _evict(self) -> None:
        """Oldest use first until the entries fit the budget; temporary files left by a writer
        that died go too (a live writer's are younger than an hour)."""
        now, files = time.time_ns(), []
        try:
            listing = list(os.scandir(self.folder))
        except OSError:
            return
        for f in listing:
            try:
                st = f.stat()
            except OSError:  # removed meanwhile by another process
                continue
            if f.name.startswith(".") and f.name.endswith(".tmp"):
                if now - st.st_mtime_ns > STALE_TMP_NS:
                    Path(f.path).unlink(missing_ok=True)
            elif f.name.endswith(SUFFIX):
                files.append((st.st_mtime_ns, f.name, st.st_size))
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= self.budget_bytes:
                break
            (self.folder / name).unlink(missing_ok=True)
            total -= size
            self.counters["evictions"] += 1

    # -- names and bookkeeping -----------------------------------------------------------------
    def _file_name(self, key: tuple, tokens: tuple[int, ...] | list[int], n_prompt: int) -> str:
        h = hashlib.blake2b(repr((key, self.identity, int(n_prompt))).encode(), digest_size=16)
        h.update(array("q", tokens).tobytes())
        return f"{self._bucket(key, tokens)}-{h.hexdigest()}{SUFFIX}"

    def _bucket(self, key: tuple, tokens: tuple[int, ...] | list[int]) -> str:
        return digest((key, self.identity), tokens).hex()

    def _bucket_files(self, key: tuple, prompt: list[int]) -> list[Path]:
        try:
            return sorted(self.folder.glob(f"{self._bucket(key, prompt)}-*{SUFFIX}"))
        except OSError:
            return []

    def _drop_damaged(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        self.counters["damaged"] += 1
        self.warn(f"warning: removed prefix-cache entry {path.name}: {why}; the run reads the prompt instead")

    def _write_error(self, why: str) -> None:
        self.counters["write_errors"] += 1
        if not self._write_failed:  # one line a process: every later run would say the same
            self._write_failed = True
            self.warn(f"warning: the prefix cache's disk tier stores nothing: {why}")

    def entries(self) -> list[Path]:
        """The stored entries, least recently used (the next to go) first."""
        try:
            files = [(p.stat().st_mtime_ns, p.name, p) for p in self.folder.glob(f"*{SUFFIX}")]
        except OSError:
            return []
        return [p for _, _, p in sorted(files)]

    def stats(self) -> dict:
        paths = self.entries()
        return dict(self.counters, entries=len(paths), bytes=sum(_size(p) for p in paths),
                    budget_bytes=self.budget_bytes)


# ---- an entry's bytes ------------------------------------------------------------------------------

def encode(entry: Entry, identity: str) -> bytes:
    """The entry as safetensors bytes: the target's stored-form block, the logits as raw bits,
    the draft's block when it has one that lays out (a cache whose layers differ in shape does
    not: the draft then reads the prompt again), the JSON header and its checksum."""
    kv = tier_kv(_to(entry.kv, "cpu"), entry.kv_tier)
    arrays = {"kv.codes": kv.codes, "logits": _raw(entry.logits)}
    if kv.side is not None:
        arrays["kv.side"] = kv.side
    draft = None
    if entry.draft_kv and entry.draft_len:
        try:
            block = tier_kv(_to(entry.draft_kv, "cpu"), "native")
            arrays["draft.codes"], draft = block.codes, dict(grid=block.grid, length=entry.draft_len)
        except (ValueError, RuntimeError):
            pass
    meta = json.dumps(dict(format=FORMAT, key=repr(entry.key), identity=identity, tokens=list(entry.tokens),
                           n_prompt=entry.n_prompt, kv_tier=entry.kv_tier, grid=kv.grid,
                           logits_dtype=str(entry.logits.dtype).removeprefix("torch."), draft=draft),
                      separators=(",", ":"))
    return save_arrays(arrays, {META: meta, CHECKSUM: _checksum(meta, arrays)})


def _checksum(meta: str, arrays: dict[str, np.ndarray]) -> str:
    """Over the header's JSON and each array's name, dtype, shape and bytes: a flipped byte
    anywhere that matters, a dtype or an offset changed in the header, all change it. SHA-256,
    not BLAKE2b: it runs on every hit, and CPUs' SHA instructions make it ~3× faster (35 ms
    against 99 for an entry of 40 MB here)."""
    h = hashlib.sha256(meta.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _read_header(path: Path) -> tuple[str, str]:
    """(the entry's JSON, its checksum) from a file's safetensors header alone: a lookup ranks
    the bucket's entries without reading their arrays."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        if len(head) < 8:
            raise Damaged("it is truncated")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER):
            raise Damaged("it is truncated (its header runs past its end)")
        return _metadata(f.read(n))


def _header_of(data: bytes) -> tuple[str, str]:
    if len(data) < 8:
        raise Damaged("it is truncated")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, MAX_HEADER):
        raise Damaged("it is truncated (its header runs past its end)")
    return _metadata(data[8 : 8 + n])


def _metadata(header: bytes) -> tuple[str, str]:
    meta = json.loads(header).get("__metadata__") or {}
    if META not in meta or CHECKSUM not in meta:
        raise Damaged("it is not a prefix-cache entry")
    return meta[META], meta[CHECKSUM]


def _rank(tokens: list[int], n_prompt: int, prompt: list[int]) -> tuple[int, bool]:
    """(common prefix with `prompt`, an exact repeat of it): what a hit from the entry is worth."""
    q = 0
    for x, y in zip(tokens, prompt):
        if x != y:
            break
        q += 1
    return q, q == n_prompt == len(prompt)


def _positions(kv: KV) -> int:
    k = kv[0][0]
    return (k.codes if isinstance(k, Quantized) else k).shape[-2]


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as integers of the same width (numpy has no bfloat16)."""
    return t.detach().cpu().contiguous().view(_RAW_INT[t.element_size()]).numpy()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise Damaged(f"its logits name no torch dtype ({name!r})")
    return dtype


def _to(kv: KV, device: torch.device | str) -> KV:
    def move(t: torch.Tensor | Quantized) -> torch.Tensor | Quantized:
        if isinstance(t, Quantized):
            return Quantized(t.codes.to(device), None if t.scale is None else t.scale.to(device))
        return t.to(device)

    return [(move(k), move(v)) for k, v in kv]


def _write_atomically(path: Path, blob: bytes) -> None:
    """A temporary file of this writer's own, renamed into place: a reader sees the whole entry
    or none, and two writers of one entry never write into one file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:24]}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _touch(path: Path) -> None:
    """Marks a use: recency is the mtime, set to the nanosecond (the file system's own clock
    ticks in milliseconds, too coarse to order entries written in one burst)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:  # evicted meanwhile by another process
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _why(e: BaseException) -> str:
    from engine.base.helpers import one_line

    if isinstance(e, Damaged):
        return str(e)
    return f"it is unreadable ({one_line(e, 160)})"
