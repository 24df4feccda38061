"""llama.cpp as a target engine: a GGUF read through llama-cpp-python's C API (ctypes), at the
weight format the user picks, with llama.cpp's own KV cache types as its KV tiers.

Native code can crash where Python cannot catch it (0.3.36's repacked quantized kernels,
`use_extra_bufts`, kill some Intel Xeons with AMX on this model). So nothing here runs llama.cpp
in this process before a child process has loaded the same file with the same settings and
decoded with it (`probe`, cached per file, build and CPU): the settings the child survived are
the ones this process uses, and an engine no setting survives is refused in one line.
Converting formats (`llama_model_quantize`) runs in a child too (engine/runtime/llamacpp_child.py).

The target holds one llama.cpp context per verifier (leased from a pool per KV type): a context
is one sequence's KV cache, and the cost measurement keeps several verifiers alive at once."""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.base.names import GGUF_FORMATS, GGUF_KV_TIERS

# GGUF weight formats (base/names.py) → llama_ftype; a file at another format is converted once
# and cached (gguf_at).
FORMATS = dict(zip(GGUF_FORMATS, (3, 7, 32, 0)))
# KV tiers → llama.cpp's cache types (ggml_type): native f16, q8_0, q4_0.
KV_TYPES = dict(zip(GGUF_KV_TIERS, (1, 8, 2)))
# Contexts kept for reuse per KV type once their verifier is gone: a measurement holds ~4 at once.
POOL = 6
# Tokens one decode call takes (llama.cpp's n_batch): a longer prompt is read in such chunks.
N_BATCH = 512
PROBE_TIMEOUT_S = 180.0
PINNED = "0.3.36"  # requirements-llama.txt's llama-cpp-python


def unavailable() -> str | None:
    """Why this engine cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed (pip install llama-cpp-python=={PINNED}; make setup builds it)"
    return None


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown llama.cpp weight format {fmt!r}; known: {', '.join(FORMATS)}")


def _lib():
    if (why := unavailable()) is not None:
        raise ValueError(why)
    import llama_cpp

    return llama_cpp


def version() -> str:
    from importlib.metadata import version as v

    return v("llama_cpp_python")


# -- files: the GGUF at a format -----------------------------------------------------------------
def read_gguf_header(path: Path) -> dict:
    """The GGUF's architecture, vocabulary size and tensor count, read with the `gguf` package
    (no native code): a file that is not a llama-family GGUF, or is cut short, is refused here
    in one line before llama.cpp sees it."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(f"{path.name} is not a readable GGUF file ({str(e).splitlines()[0][:160]})") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path.name} has no general.architecture: not a model GGUF")
    arch = bytes(field.parts[field.data[0]]).decode()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"{path.name} is truncated: its tensors end at byte {end}, the file at {path.stat().st_size}")
    return dict(arch=arch, n_vocab=len(tokens.data) if tokens is not None else 0, n_tensors=len(reader.tensors))


def check_llama_family(path: Path) -> dict:
    head = read_gguf_header(path)
    if head["arch"] != "llama":
        raise ValueError(f"{path.name} is a {head['arch']!r} model; the llama.cpp engine reads llama-family GGUFs")
    return head


def gguf_at(source: Path, fmt: str, cache: Path) -> Path:
    """`source` (a GGUF) at format `fmt`: the file itself when it already is that format (the
    shipped Q4_1), else a copy converted once into `cache` by llama_model_quantize (in a child)."""
    check_format(fmt)
    if _ftype_of(source) == FORMATS[fmt]:
        return source
    out = cache / f"{source.stem}.{fmt}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        _child("quantize", str(source), str(tmp), str(FORMATS[fmt]))
        os.replace(tmp, out)  # a crash mid-write leaves no file that looks whole
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _ftype_of(path: Path) -> int | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.file_type")
    return int(field.parts[field.data[0]][0]) if field is not None else None


# -- the probe: which settings this CPU survives -------------------------------------------------
def _cpu_id() -> str:
    """The CPU's model and flags (a probe's verdict holds for one kind of CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha1("\n".join(keep).encode()).hexdigest()[:16]


def _child(*args: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Runs engine/runtime/llamacpp_child.py; its stdout, or ValueError saying how it ended."""
    try:
        r = subprocess.run([sys.executable, "-m", "engine.runtime.llamacpp_child", *args], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ValueError(f"llama.cpp {args[0]} did not finish in {timeout:.0f} s") from None
    if r.returncode != 0:
        raise ValueError(f"llama.cpp {args[0]} {_how_it_ended(r.returncode)}: "
                         f"{(r.stderr.strip().splitlines() or ['no message'])[-1][:200]}")
    return r.stdout


def _how_it_ended(rc: int) -> str:
    if rc < 0:
        import signal

        try:
            return f"crashed ({signal.Signals(-rc).name})"
        except ValueError:
            return f"crashed (signal {-rc})"
    return f"failed (exit {rc})"


@dataclass(frozen=True)
class Probe:
    extra_bufts: bool  # the repacked kernels: faster where they run, fatal where they do not
    tried: tuple[str, ...]  # what each setting did, for the one-line error and `doctor`


def probe(path: Path, threads: int, cache: Path) -> Probe:
    """The load settings for `path` this CPU survives: tried in a child, repacked kernels first,
    cached per (file, build, CPU). ValueError when none survives."""
    stat = path.stat()
    key = f"{version()}|{_cpu_id()}|{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    store = cache / "llamacpp-probe.json"
    seen = json.loads(store.read_text()) if store.exists() else {}
    if key in seen:
        got = seen[key]
        if got.get("extra_bufts") is None:
            raise ValueError(f"llama.cpp cannot run {path.name} on this CPU: {'; '.join(got['tried'])}")
        return Probe(got["extra_bufts"], tuple(got["tried"]))
    tried: list[str] = []
    chosen = None
    for extra in (True, False):
        try:
            _child("probe", str(path), "1" if extra else "0", str(threads))
            tried.append(f"repacked kernels {'on' if extra else 'off'}: ran")
            chosen = extra
            break
        except ValueError as e:
            tried.append(f"repacked kernels {'on' if extra else 'off'}: {e}")
    cache.mkdir(parents=True, exist_ok=True)
    seen[key] = dict(extra_bufts=chosen, tried=tried)
    tmp = store.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(seen, indent=1))
    os.replace(tmp, store)
    if chosen is None:
        raise ValueError(f"llama.cpp cannot run {path.name} on this CPU: {'; '.join(tried)}")
    return Probe(chosen, tuple(tried))


# -- the model and its contexts ------------------------------------------------------------------
_QUIET = None


def _silence(lib) -> None:
    """llama.cpp logs every load to stderr; the CLI and the pages show one line instead."""
    global _QUIET
    if _QUIET is None:
        _QUIET = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_QUIET, ctypes.c_void_p(0))
        lib.llama_backend_init()


class LlamaModel:
    """A GGUF loaded once; contexts (KV caches) leased from it per verifier."""

    def __init__(self, path: Path, fmt: str, threads: int, extra_bufts: bool, n_ctx: int | None = None) -> None:
        lib = self.lib = _lib()
        _silence(lib)
        params = lib.llama_model_default_params()
        params.use_extra_bufts = extra_bufts
        self.path, self.fmt, self.threads, self.extra_bufts = path, fmt, threads, extra_bufts
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path.name}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
        self.n_ctx = min(n_ctx or self.n_ctx_train, self.n_ctx_train)
        self._free: dict[str, list[Context]] = {}

    def kv_bytes_per_token(self, kv_tier: str) -> int:
        """What a context's cache holds per token at `kv_tier` (keys and values, every layer)."""
        lib, m = self.lib, self.model
        width = lib.llama_model_n_embd(m) // lib.llama_model_n_head(m) * lib.llama_model_n_head_kv(m)
        per_value = {"native": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}[kv_tier]  # f16; q8_0, q4_0: 32-value blocks
        return int(2 * lib.llama_model_n_layer(m) * width * per_value)

    def eog_ids(self) -> frozenset[int]:
        """The tokens llama.cpp ends generation at."""
        return frozenset(i for i in range(self.n_vocab) if self.lib.llama_vocab_is_eog(self.vocab, i))

    def lease(self, kv_tier: str) -> "Context":
        assert kv_tier in KV_TYPES, kv_tier  # GenConfig.validate refused any other in one line
        free = self._free.get(kv_tier)
        return free.pop() if free else Context(self, kv_tier)

    def release(self, ctx: "Context") -> None:
        free = self._free.setdefault(ctx.kv_tier, [])
        if len(free) < POOL:
            free.append(ctx)
        else:
            ctx.close()

    def __del__(self) -> None:
        for free in getattr(self, "_free", {}).values():
            for ctx in free:
                ctx.close()
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


class Context:
    """One llama.cpp context: one sequence's KV cache (`held` the tokens in it, positions 0…)."""

    def __init__(self, model: LlamaModel, kv_tier: str) -> None:
        lib = self.lib = model.lib
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = model.n_ctx, N_BATCH, N_BATCH, 1
        p.n_threads = p.n_threads_batch = model.threads
        p.type_k = p.type_v = KV_TYPES[kv_tier]
        # A quantized V cache needs flash attention; f16 runs as llama-cpp-python's Llama does.
        p.flash_attn_type = 1 if kv_tier != "native" else 0
        p.no_perf = True
        self.model, self.kv_tier = model, kv_tier
        self.ctx = lib.llama_init_from_model(model.model, p)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not make a context with KV type {kv_tier} (this build may lack it)")
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.held: list[int] = []

    def truncate(self, n: int) -> None:
        """Keeps the first n positions of the cache."""
        if n < len(self.held):
            self.lib.llama_memory_seq_rm(self.mem, 0, n, -1)
            del self.held[n:]

    def read(self, ids: list[int], rows: int) -> np.ndarray:
        """Reads `ids` after the cache: logits of the last `rows` of them, [rows, V] (a copy)."""
        assert 0 < rows <= len(ids), (rows, len(ids))
        if len(self.held) + len(ids) > self.model.n_ctx:
            raise ValueError(f"the context would reach {len(self.held) + len(ids)} tokens, over llama.cpp's "
                             f"{self.model.n_ctx}")
        out = []
        for s in range(0, len(ids), N_BATCH):
            chunk = ids[s : s + N_BATCH]
            first_row = len(ids) - rows - s  # index in this chunk of the first row wanted
            b = self.batch
            for i, x in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = x, len(self.held) + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if i >= first_row else 0
            b.n_tokens = len(chunk)
            rc = self.lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise ValueError(f"llama.cpp decode failed (code {rc})")
            self.held.extend(chunk)
            n = len(chunk) - min(max(first_row, 0), len(chunk))
            if n > 0:
                out.append(np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n, self.model.n_vocab)).copy())
        return out[0] if len(out) == 1 else np.concatenate(out)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None


def stock_llama(path: Path, threads: int, extra_bufts: bool, n_ctx: int = 4096, **kwargs):
    """llama-cpp-python's own `Llama` on `path` with the load settings the probe chose (its
    constructor has no keyword for them): the peer a benchmark compares against and the engine
    an export runs in. kwargs: Llama's (draft_model=, logits_all=, …)."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    _silence(low)
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    low.llama_model_default_params = params
    try:
        return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs)
    finally:
        low.llama_model_default_params = default


class GgufDraft:
    """A GGUF draft in llama-cpp-python's draft-model hook (`Llama(draft_model=…)`, the binding's
    LlamaDraftModel interface: the context's ids in, up to `n_max` greedy ids out): how a llama.cpp
    draft export runs where llama-server is not built. Its own Llama keeps its KV across calls
    (generate's prefix reuse), so each call reads only what the target emitted since."""

    def __init__(self, path: Path, threads: int, cache: Path, n_max: int, n_ctx: int = 4096) -> None:
        assert n_max >= 1, n_max
        # Its own probe: the settings a target file survived say nothing of the draft's format
        # (Q8_0's repacked kernels died here where the bf16 target's load had survived them).
        self.llm = stock_llama(path, threads, probe(path, threads, cache).extra_bufts, n_ctx=n_ctx)
        self.n_max = n_max

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        out: list[int] = []
        for tok in self.llm.generate([int(x) for x in input_ids], top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) >= self.n_max:
                break
        return np.array(out, dtype=np.intc)
