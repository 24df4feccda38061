"""Which kernel each of the target's linears reads a few-row verify through, chosen on this machine
by timing them, and cached per machine.

A verify reads 2–9 rows through every linear, and which kernel does that fastest is a property of
the CPU, not of the code: the `mm(W, xᵀ)` path that wins at 2–4 rows on one x86 CPU costs three
times torch's own `linear` on another, and oneDNN's blocked weights win at 9 rows on some only
(`python -m engine kernels` prints this machine's figures). So at a target's first load on a
machine every candidate (verify_kernels.KERNELS) is timed on the model's own linears, shape by
shape and row count by row count, and the fastest kept; a candidate other than stock must beat
stock by MARGIN, so the choice is never slower than stock where it was measured.

Timing sweeps every linear of a shape in turn, as a forward reads them, so the weights come from
memory as they do in a verify, not from a cache a single matrix would sit in. A one-row read (a
plain step) is never probed: it stays torch's own `linear`, so that plain decoding is HF `generate`
bit for bit.

The table is cached as JSON under $SPECLAB_KERNEL_DIR (default ~/.cache/speclab/kernels), one file
per CPU model, thread count, torch release and dtype; a file that names another machine is not
read (one line says so) and the shapes are probed again. Its `kernel_set` (a hash of the choices
and the machine) is part of a cost table's key, so a table measured under other kernels is
measured again, never read."""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.runtime.kernels.verify import CHOSEN, KERNELS, MAX_ROWS, applies, drop_packed, forced, patch

ROWS = tuple(range(2, MAX_ROWS + 1))  # the row counts a verify reads (1 + γ, γ = 1…K_MAX)
MARGIN = 0.03  # a kernel other than stock must be this much faster, or noise could pick it
ROUNDS = 3  # timed sweeps per candidate and row count (the median kept), candidates in turn
SWEEP_LINEARS = 16  # linears of one shape a sweep reads in turn: enough to leave the core's own caches
MIN_SWEEP_S = 2e-3  # a sweep shorter than this is repeated within one timing, for the clock's sake


def cpu_name() -> str:
    """The CPU's model name (x86 Linux: /proc/cpuinfo), or the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


@dataclass(frozen=True)
class Machine:
    """What a kernel choice holds for: a table from another one is not read."""

    cpu: str
    threads: int
    torch: str
    dtype: str

    @classmethod
    def here(cls, dtype: torch.dtype) -> "Machine":
        return cls(cpu_name(), torch.get_num_threads(), torch.__version__, str(dtype).removeprefix("torch."))

    def slug(self) -> str:
        text = f"{self.cpu}-{self.threads}t-torch{self.torch}-{self.dtype}"
        return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


@dataclass
class KernelTable:
    """Per weight shape ("out×in"): the chosen kernel and every candidate's ms per call, each a
    list over ROWS."""

    machine: Machine
    choice: dict[str, list[str]] = field(default_factory=dict)
    ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def kernel_set(self) -> str:
        """A short name for these choices on this machine (part of a cost table's key)."""
        text = json.dumps([asdict(self.machine), sorted(self.choice.items())], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def kernels_for(self, shape: str) -> tuple[str, ...]:
        """The kernel per row count: index m is an m-row read (0 and 1: stock)."""
        return ("stock", "stock", *self.choice[shape])

    def rows(self) -> list[dict]:
        """One row per shape and row count: each candidate's ms, the choice, its ratio to stock."""
        out = []
        for shape, choice in self.choice.items():
            for i, m in enumerate(ROWS):
                ms = {k: v[i] for k, v in self.ms[shape].items()}
                out.append(dict(shape=shape, rows=m, kernel=choice[i], **{f"{k}_ms": v for k, v in ms.items()},
                                vs_stock=ms[choice[i]] / ms["stock"]))
        return out


def shape_of(linear: torch.nn.Linear) -> str:
    out, inp = linear.weight.shape
    return f"{out}×{inp}"


def sweep_ms(kernel, linears: list, x: torch.Tensor) -> float:
    """ms per call of `kernel(linear, x)` over every linear of one shape in turn (weights read as
    a forward reads them), repeated until the sweep is long enough to time."""
    t0, calls = time.perf_counter(), 0
    while True:
        for lin in linears:
            kernel(lin, x)
        calls += len(linears)
        elapsed = time.perf_counter() - t0
        if elapsed >= MIN_SWEEP_S:
            return elapsed * 1e3 / calls


def probe_shape(linears: list[torch.nn.Linear], candidates: tuple[str, ...]) -> tuple[list[str], dict[str, list[float]]]:
    """(the chosen kernel per row count, every candidate's ms per row count) for linears of one shape."""
    gen = torch.Generator().manual_seed(0)
    w = linears[0].weight
    ms: dict[str, list[float]] = {c: [] for c in candidates}
    choice = []
    for m in ROWS:
        x = torch.randn(m, w.shape[1], generator=gen).to(w.dtype)  # [M, in]
        for c in candidates:
            sweep_ms(KERNELS[c], linears[:1], x)  # a warm-up (and oneDNN's one reorder of the weight)
        times: dict[str, list[float]] = {c: [] for c in candidates}
        for r in range(ROUNDS):  # in turns, the order rotated, so a slow spell falls on all alike
            for c in candidates[r % len(candidates):] + candidates[: r % len(candidates)]:
                times[c].append(sweep_ms(KERNELS[c], linears[:SWEEP_LINEARS], x))
        med = {c: sorted(t)[len(t) // 2] for c, t in times.items()}
        best = min(med, key=med.get)
        choice.append(best if med[best] < med["stock"] * (1 - MARGIN) else "stock")
        for c in candidates:
            ms[c].append(med[c])
    return choice, ms


def kernel_dir() -> Path:
    return Path(os.environ.get("SPECLAB_KERNEL_DIR") or Path.home() / ".cache" / "speclab" / "kernels")


def _read(path: Path, machine: Machine) -> KernelTable | None:
    """The cached table at `path`, None when there is none; one line when it cannot be used."""
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        table = KernelTable(Machine(**raw["machine"]), raw["choice"], raw["ms"])
        assert all(len(c) == len(ROWS) and set(c) <= set(KERNELS) for c in table.choice.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        print(f"warning: kernel probe cache {path} is damaged: probing this machine's kernels again", file=sys.stderr)
        return None
    if table.machine != machine:
        m = table.machine
        print(f"warning: kernel probe cache {path} was made for {m.cpu}, {m.threads} threads, torch {m.torch}, "
              f"{m.dtype}, not this machine: probing again", file=sys.stderr)
        return None
    return table


def _write(path: Path, table: KernelTable) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(machine=asdict(table.machine), choice=table.choice, ms=table.ms), indent=1))
    tmp.replace(path)  # a reader in another process sees the old file or the new one, never half


def candidates() -> tuple[str, ...]:
    return tuple(c for c in KERNELS if c != "onednn" or torch.backends.mkldnn.is_available())


def table_for(linears: list[torch.nn.Linear], progress=lambda m: None) -> KernelTable:
    """This machine's kernel table for `linears` (the model's plain linears): read from the cache,
    the shapes it lacks probed now and added to it."""
    machine = Machine.here(linears[0].weight.dtype)
    path = kernel_dir() / f"{machine.slug()}.json"
    table = _read(path, machine) or KernelTable(machine)
    by_shape: dict[str, list[torch.nn.Linear]] = {}
    for lin in linears:
        by_shape.setdefault(shape_of(lin), []).append(lin)
    missing = [s for s in by_shape if s not in table.choice]
    if missing:
        progress(f"choosing verify kernels for {len(missing)} weight shapes on {machine.cpu} (once per machine)")
        with torch.inference_mode():
            for s in missing:
                table.choice[s], table.ms[s] = probe_shape(by_shape[s], candidates())
        drop_packed(linears)  # the probe's reordered weights: a chosen oneDNN read makes its own again
        try:
            _write(path, table)
        except OSError as e:  # a read-only home: the choice holds for this process
            print(f"warning: kernel probe cache not written ({e}): probing again next time", file=sys.stderr)
    return table


def table_of(model: torch.nn.Module) -> KernelTable | None:
    """The kernel table `model`'s patched linears read by (make_verify_fast), from
    this machine's cache; None where nothing was patched or a kernel was forced."""
    linears = [m for m in model.modules() if hasattr(m, CHOSEN)]
    return table_for(linears) if linears and forced() == "probe" else None


def make_verify_fast(model: torch.nn.Module, progress=lambda m: None) -> str:
    """Gives every plain nn.Linear of `model` (a target) the kernel this machine's probe chose per
    row count ($SPECLAB_KERNELS: one for all); returns the kernel set's name ("" where
    verify_kernels.applies says no: nothing patched; quantized layers are not plain nn.Linear and
    keep their own)."""
    if not applies(model):
        return ""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    if not linears:
        return ""
    name = forced()
    if name != "probe":
        for lin in linears:
            patch(lin, (name,) * (MAX_ROWS + 1))
        return name
    table = table_for(linears, progress)
    for lin in linears:
        patch(lin, table.kernels_for(shape_of(lin)))
    return table.kernel_set
