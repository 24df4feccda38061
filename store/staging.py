"""Parquet staging for runs written while another process holds the database lock.

Layout: `<db path>.staging/<run_id>.steps.parquet` and `<run_id>.run.parquet`. The steps
file is written first and each file appears atomically (temp name + os.replace), so a
run file existing means the run is complete and safe to ingest.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from .schema import PY_DEFAULTS, arrow_schema

RUN_SUFFIX = ".run.parquet"
STEPS_SUFFIX = ".steps.parquet"


@dataclass(frozen=True)
class StagedWrite:
    """One run waiting in the staging folder for the next read-write open."""

    run_id: str
    run_file: Path
    steps_file: Path


def staging_dir(db_path: str) -> Path:
    return Path(f"{db_path}.staging")


def staged_write(db_path: str, run_id: str) -> StagedWrite:
    folder = staging_dir(db_path)
    return StagedWrite(run_id, folder / f"{run_id}{RUN_SUFFIX}", folder / f"{run_id}{STEPS_SUFFIX}")


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
    """Write one run and its steps to the staging folder; returns where they went."""
    run_id = str(run.column("run_id")[0].as_py())
    write = staged_write(db_path, run_id)
    write.run_file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(steps, write.steps_file)
    _write_atomic(run, write.run_file)
    return write


def pending(db_path: str) -> list[StagedWrite]:
    """Complete staged runs (those with a run file), oldest file first."""
    folder = staging_dir(db_path)
    if not folder.is_dir():
        return []
    run_files = sorted(folder.glob(f"*{RUN_SUFFIX}"), key=lambda p: (p.stat().st_mtime, p.name))
    return [staged_write(db_path, p.name[: -len(RUN_SUFFIX)]) for p in run_files]


def _read(path: Path, table: str) -> pa.Table:
    # Cast to the current schema: a file staged by an older schema gains its missing
    # columns, as NULL or as the column's default (an old staged run is a 'speclab' run).
    data = pq.read_table(path)
    schema = arrow_schema(table)
    defaults = PY_DEFAULTS.get(table, {})
    arrays = [
        data.column(f.name).cast(f.type) if f.name in data.column_names
        else pa.array([defaults.get(f.name)] * data.num_rows, type=f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def insert_arrow(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> None:
    """Bulk INSERT ... BY NAME of a whole Arrow table (one statement, not row by row)."""
    if data.num_rows == 0:
        return
    # An explicit view name: a replacement scan of a local called `steps` would lose
    # to the real table of that name.
    view = f"_speclab_new_{table}"
    con.register(view, data)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {view}")
    finally:
        con.unregister(view)


def _ingest_one(con: duckdb.DuckDBPyConnection, write: StagedWrite) -> bool:
    """Insert one staged run in a transaction; False if it was already in the database."""
    run = _read(write.run_file, "runs")
    steps = _read(write.steps_file, "steps") if write.steps_file.exists() else None
    exists = con.execute("SELECT count(*) FROM runs WHERE run_id = ?", [write.run_id]).fetchone()
    if exists and exists[0]:
        return False
    con.execute("BEGIN TRANSACTION")
    try:
        insert_arrow(con, "runs", run)
        if steps is not None:
            insert_arrow(con, "steps", steps)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return True


def ingest_staged(con: duckdb.DuckDBPyConnection, db_path: str) -> list[str]:
    """Move every complete staged run into the database; returns the run_ids inserted.

    A file that cannot be ingested stays where it is (with a warning) so it is retried
    on the next open rather than lost.
    """
    inserted: list[str] = []
    for write in pending(db_path):
        try:
            if _ingest_one(con, write):
                inserted.append(write.run_id)
        except (duckdb.Error, pa.ArrowException, OSError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"staged run {write.run_file} not ingested, kept for retry ({reason})",
                          stacklevel=2)
            continue
        write.run_file.unlink(missing_ok=True)
        write.steps_file.unlink(missing_ok=True)
    # The folder itself stays: removing it could race with a process staging into it.
    return inserted
