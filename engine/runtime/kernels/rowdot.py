"""Row-invariant linears for the target on CPUs (csrc/rowdot.cpp), built for the machine they run
on, and the weight formats they read: fp32, bf16, int8 and 4 bits.

Exactness needs a verify read of k + 1 rows to round every row as a one-row plain step does, and
BLAS kernels promise no such thing (MKL's sgemm and oneDNN's bf16 paths take other reduction
orders at other row counts, differently on each CPU). The kernel
here computes every output element with one routine whatever the row count, so a target whose
linears all read through it gives a verify that equals plain decoding bit for bit — at every tier,
on every CPU it builds on — and a verify of 2–5 rows reads the weights once, as one row does.

The library is compiled at first use on each machine (g++ -O3 -march=native, ~10 s) into
$SPECLAB_KERNEL_DIR under a name that hashes the source, the CPU's flags, the compiler and torch, so
another machine or release builds its own. A new build first loads and checks itself in a child
process (a verdict file beside it keeps the answer), so a build that crashes on this CPU costs a
line, not the process. Where it cannot build (no compiler), crashes or fails its check,
`unavailable()` says why in one line and the float tiers keep torch's own kernels.
$SPECLAB_ROWDOT=off turns it off (a peer run, a test of the fallback).

Every read goes through it, a prompt's prefill too (where BLAS's blocked GEMM is faster): a
prefix's KV reused from another prompt's prefill then holds the bits a whole prefill of this
prompt would, so prefix reuse stays exact. Attention likewise (`attention`): each query row the
same arithmetic whatever the read's length, which torch's SDPA does not promise either."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.runtime.kernels.weight_formats import TILE_ROWS, dequantize, quantize_int4, quantize_int8, tiled, untiled

SOURCE = Path(__file__).with_name("csrc") / "rowdot.cpp"
FORMATS = ("fp32", "bf16", "int8", "int4")
ATTENTION = "speclab_rowdot_attention"  # set on the attention modules of a converted model
ALIGN = 64  # the kernel's rows are read 64 inputs at a time


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@lru_cache(maxsize=4)
def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    text = "\n".join([SOURCE.read_text(), _cpu_flags(), version, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile(out: Path, compiler: str) -> None:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c++20",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", *[f"-I{p}" for p in cpp_extension.include_paths()],
           str(SOURCE), *[f"-L{p}" for p in cpp_extension.library_paths()], "-ltorch_cpu", "-lc10"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # two processes may build at once
        part = Path(tmp) / out.name
        done = subprocess.run([*cmd, "-o", str(part)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{compiler} failed: {last[:200]}")
        os.replace(part, out)


_TRIAL = ("import sys, torch; sys.path.insert(0, {root!r}); torch.ops.load_library({lib!r}); "
          "from engine.runtime.kernels import rowdot; bad = rowdot._not_row_invariant(); print(bad or ''); sys.exit(3 if bad else 0)")


def _trial(lib: Path) -> tuple[str, str]:
    """Loads a new build in a child process and runs its self-check there, so a build that crashes
    on this CPU (an instruction the compiler chose wrongly, a fault in the native code) costs one
    line, not the process: ("ok" | "damaged" | "refused", why)."""
    root = str(Path(__file__).resolve().parents[2])
    code = _TRIAL.format(root=root, lib=str(lib))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "refused", "the kernels built here hung in a trial run: torch's kernels instead"
    if done.returncode == 0:
        return "ok", ""
    if done.returncode == 3:
        return "refused", (f"the kernels built here round {done.stdout.strip()} differently by row count: "
                           "torch's kernels instead")
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return "refused", f"the kernels built here crashed in a trial run ({name}): torch's kernels instead"
    return "damaged", " ".join((done.stderr.strip().splitlines() or ["no message"])[-1].split())[:200]


def _tried(lib: Path, compiler: str) -> str | None:
    """Builds `lib` where missing and proves it in a child process once (a verdict file beside it
    keeps the answer for later processes); None, or why it is not used."""
    verdict = lib.with_suffix(".verdict")
    if lib.exists() and verdict.exists():
        text = verdict.read_text()
        return None if text == "ok" else text
    for attempt in range(2):
        if not lib.exists():
            _compile(lib, compiler)
        outcome, why = _trial(lib)
        if outcome == "damaged" and attempt == 0:  # a file cut short (a build killed by hand): built again, once
            lib.unlink(missing_ok=True)
            continue
        if outcome == "damaged":
            raise RuntimeError(f"a fresh build does not load: {why}")
        verdict.write_text("ok" if outcome == "ok" else why)
        return None if outcome == "ok" else why
    raise AssertionError("unreachable")


@lru_cache(maxsize=1)
def _load() -> str | None:
    """Builds (once per machine), proves and loads the library: None, or why it is not available."""
    if os.environ.get("SPECLAB_ROWDOT", "on").lower() in ("off", "0", "no"):
        return "turned off by SPECLAB_ROWDOT"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler (install g++) to build the row-invariant kernels"
    from engine.runtime.kernels.probe import kernel_dir

    try:
        lib = kernel_dir() / f"rowdot-{_build_key(compiler)}.so"
        for attempt in range(2):
            if (refused := _tried(lib, compiler)) is not None:
                return refused
            try:
                torch.ops.load_library(str(lib))
                break
            except OSError:  # damaged since its trial (a copy cut short): built and tried again, once
                if attempt:
                    raise
                lib.unlink(missing_ok=True)
                lib.with_suffix(".verdict").unlink(missing_ok=True)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"the row-invariant kernels did not build: {' '.join(str(e).split())[:240]}"
    if (bad := _not_row_invariant()) is not None:  # a verdict file from another build, say
        return f"the kernels built here round {bad} differently by row count: torch's kernels instead"
    return None


@torch.inference_mode()
def _not_row_invariant() -> str | None:
    """The first format (AMX tiles included where they are read) or attention whose rows, read 1–6,
    9 or 16 at a time out of 20 (a verify, a token tree's read, a prefill's blocks), do not all
    round alike on this build; None when every one does (a few milliseconds, once per process)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 128, generator=gen)
    x = torch.randn(20, 128, generator=gen)  # a read of 20 rows: more than one tile of every kind
    packs = {"fp32": (w,), "bf16": (w.bfloat16(),), "int8": quantize_int8(w), "int4": quantize_int4(w)}
    if _amx_here():
        packs["bf16 tiled"] = (tiled(w.bfloat16()),)
    for fmt, tensors in packs.items():
        op = getattr(torch.ops.speclab_rowdot, _OPS[fmt.split()[0]])
        rows = x.bfloat16() if fmt.startswith("bf16") else x
        full = op(rows, *tensors)
        if any(not torch.equal(op(rows[i : i + m], *tensors), full[i : i + m])
               for m in (1, 2, 3, 4, 5, 6, 9, 16) for i in (0, 20 - m)):
            return fmt
    q, k = torch.randn(2, 9, 64, generator=gen), torch.randn(1, 20, 64, generator=gen)
    full = torch.ops.speclab_rowdot.attend(q, k, k, 0.125)
    if any(not torch.equal(torch.ops.speclab_rowdot.attend(q[:, i : i + 1], k[:, : 12 + i], k[:, : 12 + i], 0.125)[0],
                           full[i]) for i in range(9)):
        return "attention"
    return None


def unavailable() -> str | None:
    """None where the kernels run here; else one line saying why not."""
    return _load()


def build_id() -> str:
    """Which build this process reads through (part of the kernel-set name of a cost table)."""
    assert _load() is None
    return _build_key(_compiler())[:8]


def amx() -> bool:
    """Whether bf16 weights are read from AMX tiles here (csrc/rowdot.cpp `matmul_amx`): a CPU with
    AMX whose kernel grants this process the tile state, unless $SPECLAB_AMX=off (the vector path,
    for a comparison or a test of it)."""
    return _load() is None and _amx_here()


def _amx_here() -> bool:
    """`amx()` once the library is loaded (its trial run asks before `_load` has an answer)."""
    return os.environ.get("SPECLAB_AMX", "on").lower() not in ("off", "0", "no") and bool(torch.ops.speclab_rowdot.amx())


_OPS = {"fp32": "linear_f32", "bf16": "linear_bf16", "int8": "linear_int8", "int4": "linear_int4"}


class RowLinear(torch.nn.Module):
    """A linear whose reads go through the row-invariant kernel.

    fp32/bf16 keep the original weight (tied heads stay tied), except bf16 where AMX reads it: then
    its tiles (`tiled`, a copy where the weight is tied); int8/int4 hold the quantized form. HF's
    peers run as shipped (verify_kernels.stock_kernels) through torch's own matmul on the float
    weight (tiles, int8, int4: its plain or dequantized form, made once)."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        """tensors: the format's own, where the weight is stored so already (a draft's int8 rows)."""
        super().__init__()
        assert fmt in FORMATS, fmt
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self.bias = linear.bias
        w = linear.weight.detach()
        if tensors is not None:
            self.tensors = tuple(t.contiguous() for t in tensors)
        elif fmt in ("fp32", "bf16"):
            dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
            if w.dtype != dtype or not w.is_contiguous():
                w = w.to(dtype).contiguous()
            if fmt == "bf16" and self.out_features % TILE_ROWS == 0 and amx():
                w = tiled(w)
            self.tensors: tuple[torch.Tensor, ...] = (w,)
        else:
            self.tensors = (quantize_int8 if fmt == "int8" else quantize_int4)(w.float())
        self._op = getattr(torch.ops.speclab_rowdot, _OPS[fmt])
        self._long: torch.Tensor | None = None  # the dequantized weight for stock reads (int8/int4), made once

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a float tensor (for code that reads a linear's weight, e.g. EAGLE's head)."""
        if self.fmt in ("fp32", "bf16"):
            return untiled(self.tensors[0]) if self.tensors[0].dim() == 4 else self.tensors[0]
        return dequantize(self.fmt, self.tensors)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.runtime.kernels.verify import stock

        m = x.numel() // self.in_features
        if torch.is_grad_enabled() or stock():
            return self._stock(x)
        out = self._op(x.reshape(m, self.in_features), *self.tensors)  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _stock(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt in ("fp32", "bf16") and self.tensors[0].dim() == 2:
            return F.linear(x, self.tensors[0].to(x.dtype), self.bias)
        if self._long is None:
            self._long = self.weight  # made once: the plain or dequantized weight
        return F.linear(x, self._long.to(x.dtype), self.bias)


def serves(linear: torch.nn.Module) -> bool:
    """A plain nn.Linear on a CPU whose input width the kernel reads (a multiple of 64)."""
    return type(linear) is torch.nn.Linear and serves_weight(linear)


def serves_weight(linear: torch.nn.Linear) -> bool:
    """`serves`, for a linear of any class: on a CPU, an input width the kernel reads."""
    return linear.weight.device.type == "cpu" and linear.in_features % ALIGN == 0 and linear.in_features <= 8192


def refuses(model: torch.nn.Module) -> str | None:
    """None where the kernels serve every linear of `model` and its attention (head size a multiple
    of 64); else why not, in a few words. A model is converted whole or not at all: a verify that
    read some linears through these kernels and the rest through another path would be neither
    exact by construction nor the other path's."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return "no linear layers"
    widths = sorted({m.in_features for m in linears if not serves(m)})
    if widths:
        return f"input widths {widths} are not multiples of {ALIGN}"
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    head = getattr(text, "head_dim", None) or (text.hidden_size // text.num_attention_heads if text is not None else 0)
    if head % ALIGN:
        return f"head size {head} is not a multiple of {ALIGN}"
    return None


def convert(model: torch.nn.Module, fmt: str) -> int:
    """Replaces every linear of `model` (LM head included) with a RowLinear at `fmt`; returns how
    many. The caller checks `unavailable()` and `refuses(model)` first."""
    assert _load() is None and refuses(model) is None, (_load(), refuses(model))
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if serves(child):
                setattr(parent, name, RowLinear(child, fmt))
                count += 1
        if hasattr(parent, "q_proj") and hasattr(parent, "o_proj"):  # an attention block: `attention` serves it
            setattr(parent, ATTENTION, True)
    from engine.runtime import row_llama

    row_llama.install(model)  # a Llama: its norms, MLPs and rotary on the kernels, and the fused read
    if fmt in ("int8", "int4"):  # the float copies the quantized layers replaced are gone; keep it so
        import gc

        gc.collect()
    return count


def convert_draft(model: torch.nn.Module) -> bool:
    """Puts a CPU draft that is a plain Llama (a SpecLab draft) on the kernels, as `convert` does a
    target, and returns whether it did: its body's linears read their int8 rows as stored (the
    scales at fp32; no second quantization) or their float weights, its modules the kernels'
    steps, and its reads the fused body (row_llama.DraftBody), row-invariant by construction. The
    LM head (the target's embedding, read only by a full-vocabulary draft read) stays as it is."""
    from engine.runtime import row_llama

    head = model.get_output_embeddings()
    body = [m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear]
    if (_load() is not None or not body or any(not serves(m) or m.bias is not None for m in body)
            or model.dtype not in (torch.float32, torch.bfloat16) or refuses(model) is not None
            or row_llama.refuses(model) is not None):
        return False
    float_fmt = "fp32" if model.dtype == torch.float32 else "bf16"
    for parent in list(model.get_decoder().modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not head:
                packed = getattr(child, "speclab_int8", None)
                row = (RowLinear(child, "int8", (packed[0], packed[1].float())) if packed is not None
                       else RowLinear(child, float_fmt))
                setattr(parent, name, row)
        if hasattr(parent, "q_proj") and hasattr(parent, "o_proj"):
            setattr(parent, ATTENTION, True)
    return row_llama.install(model, draft=True)


def converted(model: torch.nn.Module) -> tuple[int, str | None]:
    """(how many of `model`'s linears read through the kernel, their format)."""
    rows = [m for m in model.modules() if isinstance(m, RowLinear)]
    return len(rows), rows[0].fmt if rows else None


# -- attention ----------------------------------------------------------------------------------------
_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def attends(module, query: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `attention` computes this call (HF's attention interface): a converted model's
    block, one sequence, head size a multiple of 64, no dropout, softcap, window or sinks, and a
    mask that is causal or none."""
    from engine.runtime.kernels.verify import stock

    if not getattr(module, ATTENTION, False) or stock() or query.shape[0] != 1 or query.shape[-1] % ALIGN:
        return False
    if kwargs.get("dropout", 0.0) or any(kwargs.get(k) is not None for k in _UNSUPPORTED):
        return False
    s = query.shape[2]
    if mask is None or s == 1 and mask.dtype == torch.bool and bool(mask.all()):
        return True
    if mask.dtype != torch.bool or mask.shape[0] != 1 or mask.shape[1] != 1:
        return False
    n = mask.shape[-1]
    return torch.equal(mask[0, 0], torch.ones(s, n, dtype=torch.bool, device=mask.device).tril(n - s))


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None,
              **_) -> tuple[torch.Tensor, None]:
    """query [1, H, S, D], key/value [1, Hkv, N, D] → ([1, S, H, D], None): causal, the last S keys
    the rows' own (csrc/rowdot.cpp `attend`)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.speclab_rowdot.attend(query[0], key[0], value[0], float(scale))  # [S, H, D]
    return out[None], None


# -- this machine's figures ---------------------------------------------------------------------------
TIMED_ROWS = tuple(range(1, 10))  # a plain step and the verifies of γ = 1…8


def timings(model: torch.nn.Module, rounds: int = 3) -> list[dict]:
    """Per weight shape of `model`'s RowLinears and row count 1…9: ms per call of the kernel and of
    torch's own `linear` over the same weights at the tier's float dtype (the dequantized weight for
    int8/int4: what the tier would read without these kernels), medians of `rounds` sweeps taken in
    turn, and their ratio."""
    from engine.runtime.kernels.probe import SWEEP_LINEARS, sweep_ms

    by_shape: dict[str, list[RowLinear]] = {}
    for m in model.modules():
        if isinstance(m, RowLinear):
            by_shape.setdefault(f"{m.out_features}×{m.in_features}", []).append(m)
    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        for shape, mods in by_shape.items():
            mods = mods[:SWEEP_LINEARS]
            dtype = torch.bfloat16 if mods[0].fmt == "bf16" else torch.float32
            floats = [m.weight for m in mods]
            for rows in TIMED_ROWS:
                x = torch.randn(rows, mods[0].in_features, generator=gen).to(dtype)
                ms: dict[str, list[float]] = {"rowdot": [], "stock": []}
                for _ in range(rounds):
                    ms["rowdot"].append(sweep_ms(lambda m, x: m._op(x, *m.tensors), mods, x))
                    ms["stock"].append(sweep_ms(lambda w, x: F.linear(x, w), floats, x))
                med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
                out.append(dict(shape=shape, rows=rows, kernel="rowdot", rowdot_ms=med["rowdot"], stock_ms=med["stock"],
                                vs_stock=med["rowdot"] / med["stock"], count=len(by_shape[shape])))
    return out
