"""Import SpecKV's published phase-2 step CSV as SpecLab runs (source='speckv').

SpecKV (arXiv 2605.02888) profiled Llama-3.2 1B -> 3B at fp16/int8/nf4 with fixed gamma;
its per-step records are training data for a SpecKV-style controller, so they go into
the same runs/steps tables as our own runs, through the public Store API. The file has
no prompt column: runs are recovered from file order (a run ends when (compression,
gamma, task) changes or `step` restarts at 0). Run ids derive from the file's hash, so
importing a file twice adds nothing the second time; a malformed file adds nothing.
Torch-free, like the store.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store import Store, StoreError

COLUMNS = ("compression", "gamma", "task", "step", "accepted", "acceptance_rate",
           "tokens_produced", "mean_draft_entropy", "mean_draft_confidence",
           "max_draft_entropy", "min_draft_confidence")
_COUNTS = ("gamma", "step", "accepted", "tokens_produced")
TARGET = "Llama-3.2-3B-Instruct"
DRAFT = "Llama-3.2-1B-Instruct"


@dataclass(frozen=True)
class ImportReport:
    """What one import did: runs added / already stored, steps added, and the file."""

    runs_added: int
    runs_skipped: int
    steps: int
    path: str


@dataclass
class _Group:
    """One recovered run: its key, its prompt's index under that key, its parsed rows."""

    compression: str
    gamma: int
    task: str
    prompt_index: int
    rows: list[dict[str, Any]] = field(default_factory=list)


def _number(where: str, name: str, text: str) -> float | int | None:
    """Counts are non-negative whole numbers (2.0 is fine); statistics are floats, with an
    empty or NaN one stored as NULL (NaN would poison SQL averages)."""
    if name not in _COUNTS and not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise StoreError(f"{where}: column {name} is not a number ({text!r})") from None
    if name not in _COUNTS:
        return None if math.isnan(value) else value
    if math.isnan(value):
        raise StoreError(f"{where}: column {name} is NaN")
    if not value.is_integer():
        raise StoreError(f"{where}: column {name} is not a whole number ({text!r})")
    if value < 0:
        raise StoreError(f"{where}: column {name} is negative ({text!r})")
    return int(value)


def _parse_row(where: str, row: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in COLUMNS:
        if name in ("compression", "task"):
            if not row[name].strip():
                raise StoreError(f"{where}: column {name} is empty")
            out[name] = row[name].strip()
        else:
            out[name] = _number(where, name, row[name])
    if out["gamma"] < 1:
        raise StoreError(f"{where}: gamma is {out['gamma']}, must be at least 1")
    if out["accepted"] > out["gamma"]:
        raise StoreError(f"{where}: accepted {out['accepted']} > gamma {out['gamma']}")
    if out["tokens_produced"] != out["accepted"] + 1:
        raise StoreError(f"{where}: tokens_produced {out['tokens_produced']} !="
                         f" accepted + 1 ({out['accepted'] + 1})")
    return out


def parse(text: str, label: str) -> list[_Group]:
    """CSV text -> runs in file order; raises StoreError naming the file and line."""
    reader = csv.reader(io.StringIO(text))
    names = [h.strip() for h in next(reader, [])]
    missing = [c for c in COLUMNS if c not in names]
    extra = [c for c in names if c not in COLUMNS]
    problems = ([f"missing column(s) {', '.join(missing)}"] if missing else []) + \
               ([f"unexpected column(s) {', '.join(extra)}"] if extra else []) + \
               ([] if len(names) == len(set(names)) else ["a repeated column"])
    if problems:
        raise StoreError(f"{label} line 1: not a SpecKV step CSV ({'; '.join(problems)})")
    groups: list[_Group] = []
    prompts: dict[tuple[str, int, str], int] = {}
    for fields in reader:
        where = f"{label} line {reader.line_num}"
        if not fields or fields == [""]:
            continue  # blank line, e.g. a trailing newline pair
        if len(fields) != len(names):
            raise StoreError(f"{where}: {len(fields)} fields, expected {len(names)}")
        row = _parse_row(where, dict(zip(names, fields)))
        key = (row["compression"], row["gamma"], row["task"])
        last = groups[-1] if groups else None
        if last is None or key != (last.compression, last.gamma, last.task) or row["step"] == 0:
            if row["step"] != 0:
                raise StoreError(f"{where}: a run starts at step {row['step']}, expected 0")
            prompts[key] = prompts.get(key, -1) + 1
            last = _Group(*key, prompt_index=prompts[key])
            groups.append(last)
        elif row["step"] != last.rows[-1]["step"] + 1:
            raise StoreError(f"{where}: step {row['step']} follows step"
                             f" {last.rows[-1]['step']} (expected {last.rows[-1]['step'] + 1} or 0)")
        last.rows.append(row)
    if not groups:
        raise StoreError(f"{label} has a header but no rows")
    return groups


def _drafted(row: Mapping[str, Any]) -> int:
    """Tokens actually drafted: γ, except where the run's token budget cut the last draft short.
    SpecKV's acceptance_rate is accepted / drafted (its features describe the drafted tokens),
    so accepted / rate recovers the count; a zero rate says nothing, and γ stands."""
    rate = row["acceptance_rate"]
    if not rate or row["accepted"] == 0:
        return row["gamma"]
    return min(row["gamma"], max(row["accepted"], round(row["accepted"] / rate)))


def _step(row: Mapping[str, Any]) -> dict[str, Any]:
    # Our step 0 is the prefill, which SpecKV did not record: its step s is our s + 1.
    return {
        "step": row["step"] + 1, "k_chosen": row["gamma"], "k_drafted": _drafted(row),
        "accepted": row["accepted"], "emitted": row["tokens_produced"],
        "mean_entropy": row["mean_draft_entropy"], "mean_confidence": row["mean_draft_confidence"],
        "max_entropy": row["max_draft_entropy"], "min_confidence": row["min_draft_confidence"],
        "target_tier": row["compression"], "kv_tier": "native",
    }


def _run(group: _Group, index: int, sha: str, basename: str) -> dict[str, Any]:
    """The runs row, with summaries defined as the engine's RunSummary defines them."""
    n = len(group.rows)
    accepted = sum(r["accepted"] for r in group.rows)
    emitted = sum(r["tokens_produced"] for r in group.rows)
    return {
        "run_id": f"speckv-{sha[:12]}-{index:04d}", "source": "speckv",
        "target": TARGET, "draft": DRAFT, "target_tier": group.compression, "kv_tier": "native",
        "policy": f"fixed:{group.gamma}", "task": group.task,
        "prompt": f"speckv {group.task} #{group.prompt_index}", "chat": True,
        "temperature": 0.0, "n_tokens": emitted, "n_steps": n,
        "mean_accepted": accepted / n,
        "acceptance_rate": accepted / sum(_drafted(r) for r in group.rows),
        "tokens_per_step": emitted / n,
        "config": {"speckv_file": basename, "sha256": sha, "prompt_index": group.prompt_index},
    }


def import_speckv(store: Store, path: str | os.PathLike[str]) -> ImportReport:
    """Add the file's runs (one transaction); runs already imported are skipped."""
    label = os.fspath(path)
    try:
        with open(label, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise StoreError(f"{label} does not exist") from None
    except OSError as exc:
        raise StoreError(f"cannot read {label} ({exc.strerror or exc})") from None
    if not data.strip():
        raise StoreError(f"{label} is empty")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise StoreError(f"{label} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    sha = hashlib.sha256(data).hexdigest()
    groups = parse(text, label)
    basename = os.path.basename(label)
    runs = [(_run(g, i, sha, basename), [_step(r) for r in g.rows]) for i, g in enumerate(groups)]
    added = set(store.add_runs(runs, skip_existing=True))
    steps = sum(len(steps) for run, steps in runs if run["run_id"] in added)
    return ImportReport(len(added), len(runs) - len(added), steps, label)
