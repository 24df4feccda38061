"""Parquet staging of runs written while another process holds the database file.

The Store uses stage() when the file is locked and ingest() on every read-write open.
Layout: `<db path>.staging/<run_id>.steps.parquet` and `<run_id>.run.parquet`; the steps
file is written first and each appears atomically, so a run file means a complete run.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .connection import insert, transaction
from .errors import StoreError, reason
from .rows import to_table

RUN_SUFFIX = ".run.parquet"
STEPS_SUFFIX = ".steps.parquet"


@dataclass(frozen=True)
class StagedWrite:
    """One run waiting in the staging folder for the next read-write open."""

    run_id: str
    run_file: Path
    steps_file: Path


def folder(db_path: str) -> Path:
    return Path(f"{db_path}.staging")


def _write(db_path: str, run_id: str) -> StagedWrite:
    base = folder(db_path)
    return StagedWrite(run_id, base / f"{run_id}{RUN_SUFFIX}", base / f"{run_id}{STEPS_SUFFIX}")


def _write_atomic(table: pa.Table, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def stage(db_path: str, run: pa.Table, steps: pa.Table) -> StagedWrite:
    """Write one run and its steps (tables from rows.to_table) to the staging folder."""
    write = _write(db_path, str(run["run_id"][0].as_py()))
    write.run_file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(steps, write.steps_file)
    _write_atomic(run, write.run_file)
    return write


def pending(db_path: str) -> list[StagedWrite]:
    """Complete staged runs (those with a run file), oldest file first."""
    if not folder(db_path).is_dir():
        return []
    run_files = sorted(folder(db_path).glob(f"*{RUN_SUFFIX}"), key=lambda p: (p.stat().st_mtime, p.name))
    return [_write(db_path, p.name[: -len(RUN_SUFFIX)]) for p in run_files]


def _ingest_one(con: duckdb.DuckDBPyConnection, write: StagedWrite) -> bool:
    """Insert one staged run; False if it was already in the database. Files staged by an
    older schema go through the same validator and so gain the columns they lack."""
    run = to_table("runs", str(write.run_file), pq.read_table(write.run_file).to_pylist())
    steps = (pq.read_table(write.steps_file).to_pylist() if write.steps_file.exists() else [])
    steps = to_table("steps", str(write.steps_file), steps, parent=write.run_id)
    if con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [write.run_id]).fetchall()[0][0]:
        return False
    with transaction(con):
        insert(con, "runs", run)
        insert(con, "steps", steps)
    return True


def ingest(con: duckdb.DuckDBPyConnection, db_path: str) -> list[str]:
    """Move every complete staged run into the database; returns the run_ids inserted.
    A file that cannot be ingested stays (with a warning) to be retried on the next open."""
    inserted: list[str] = []
    for write in pending(db_path):
        try:
            if _ingest_one(con, write):
                inserted.append(write.run_id)
        except (duckdb.Error, pa.ArrowException, OSError, StoreError) as exc:
            warnings.warn(f"staged run {write.run_file} not ingested, kept for retry ({reason(exc)})",
                          stacklevel=2)
            continue
        write.run_file.unlink(missing_ok=True)
        write.steps_file.unlink(missing_ok=True)
    # The folder itself stays: removing it could race with a process staging into it.
    return inserted
