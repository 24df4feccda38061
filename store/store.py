"""The Store: runs and steps in a DuckDB file, with staging when another process holds it;
plus profiling traces, cost tables and learned controllers (see tables.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import connection
from .connection import LockedError, acquire, connect_with_wait, release, unreadable
from .errors import StoreError
from .rows import json_text, prepare_run, prepare_steps, to_table
from .schema import check_readable, columns, migrate
from .staging import StagedWrite, ingest_staged, insert_arrow, stage, staging_dir
from .tables import (COST_KEY, latest_costs_sql, next_version, pack_params, prepare_costs,
                     prepare_trace, unpack_params)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def _transaction(con: duckdb.DuckDBPyConnection, what: str) -> Iterator[duckdb.DuckDBPyConnection]:
    """All or nothing: a DuckDB error rolls back and says in one line what was not stored."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
        con.execute("COMMIT")
    except duckdb.Error as exc:
        con.execute("ROLLBACK")
        raise StoreError(f"{what} not stored ({_first_line(exc)})") from None
    except BaseException:
        con.execute("ROLLBACK")
        raise


# DuckDB gives int64 for an integer column without NULLs and Int64 with them; callers
# concatenating or comparing frames need the same dtype whatever the data.
_PANDAS_DTYPES = {"INTEGER": "Int32", "BIGINT": "Int64", "BOOLEAN": "boolean"}


def _typed(df: pd.DataFrame, table: str) -> pd.DataFrame:
    for name, dtype in columns(table):
        if dtype in _PANDAS_DTYPES and name in df.columns:
            df[name] = df[name].astype(_PANDAS_DTYPES[dtype])
    return df


class Store:
    """Handle on one SpecLab database file (or ":memory:").

    Attributes callers read: path, read_only, staged (True when the file was locked by
    another process and writes go to Parquet staging), message (one line for the UI,
    "" when there is nothing to say), staged_writes (StagedWrite per run staged by this
    Store), ingested (run_ids moved in from staging when this Store opened).
    """

    def __init__(self, path: str | os.PathLike[str] = "speclab.duckdb", *,
                 wait_s: float = 10.0, read_only: bool = False) -> None:
        self.path: str = os.fspath(path)
        self.read_only = read_only
        self.wait_s = wait_s
        self.staged = False
        self.message = ""
        self.staged_writes: list[StagedWrite] = []
        self.ingested: list[str] = []
        self._con: duckdb.DuckDBPyConnection | None = None
        self._registered = False
        self._closed = False
        self._holder_pid: int | None = None
        # A DuckDB cursor must not be used by two threads at once (Streamlit reruns do).
        self._lock = threading.RLock()
        if self.path == connection.MEMORY:
            self._con = duckdb.connect(connection.MEMORY)
            migrate(self._con, self.path)
        else:
            self._open_file()

    # ----- opening -------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return os.path.basename(self.path) or self.path

    def _open_file(self) -> None:
        try:
            shared, _fresh = acquire(self.path, self.read_only, self.wait_s)
        except LockedError as exc:
            self._on_locked(exc.pid)
            return
        self._registered = True
        try:
            self._con = shared.cursor()
            self._prepare(self._con)
        except BaseException:
            self.close()
            raise

    def _prepare(self, con: duckdb.DuckDBPyConnection) -> None:
        try:
            if self.read_only:
                check_readable(con, self.path)
                return
            migrate(con, self.path)
            self.ingested = ingest_staged(con, self.path)
        except duckdb.Error as exc:
            raise unreadable(self.path, exc) from None
        if self.ingested:
            self.message = (f"ingested {len(self.ingested)} staged run(s) from"
                            f" {staging_dir(self._name)}/")

    def _locked_text(self, pid: int | None) -> str:
        holder = f" (pid {pid})" if pid else ""
        return f"{self._name} is locked by another process{holder}"

    def _on_locked(self, pid: int | None) -> None:
        if self.read_only:
            raise StoreError(f"{self._locked_text(pid)} and cannot be read now;"
                             " try again once that process closes it")
        # Not failing here is the point: a finished generation must never be lost
        # because the UI (or a benchmark) happens to hold the file.
        self.staged = True
        self._holder_pid = pid
        self.message = (f"{self._locked_text(pid)}; runs are staged in"
                        f" {staging_dir(self._name)}/ and ingested on next open")

    # ----- writing -------------------------------------------------------------------
    def add_run(self, run: Mapping[str, Any], steps: Sequence[Mapping[str, Any]] = ()) -> str:
        """Store one run and its steps atomically; returns its run_id."""
        self._check_open()
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only; cannot add a run")
        run_row = prepare_run(run)
        run_id: str = run_row["run_id"]
        run_table = to_table("runs", "run", [run_row])
        steps_table = to_table("steps", "steps", prepare_steps(run_id, steps or ()))
        with self._lock:
            if self.staged:
                self.staged_writes.append(stage(self.path, run_table, steps_table))
                self.message = (f"{self._locked_text(self._holder_pid)}; run {run_id} staged in"
                                f" {staging_dir(self._name)}/ and ingested on next open")
                return run_id
            self._insert(run_id, run_table, steps_table)
        return run_id

    def _insert(self, run_id: str, run_table: Any, steps_table: Any) -> None:
        with _transaction(self._cursor(), f"run {run_id}") as con:
            insert_arrow(con, "runs", run_table)
            insert_arrow(con, "steps", steps_table)

    def add_runs(self, runs: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]],
                 *, skip_existing: bool = False) -> list[str]:
        """Store many (run, steps) pairs in ONE transaction (imports); returns the run_ids added.

        With skip_existing, runs whose run_id is already stored are left out, so
        re-importing with deterministic ids adds nothing twice.
        """
        run_rows = [prepare_run(run) for run, _ in runs]
        step_rows = [row for run_row, (_, steps) in zip(run_rows, runs)
                     for row in prepare_steps(run_row["run_id"], steps or ())]
        run_table = to_table("runs", "runs", run_rows)
        steps_table = to_table("steps", "steps", step_rows)
        ids = [row["run_id"] for row in run_rows]
        with self._writing(f"{len(ids)} runs") as con:
            if skip_existing and ids:
                there = con.execute("SELECT run_id FROM runs WHERE list_contains(?, run_id)",
                                    [ids]).fetchall()
                old = pa.array([r[0] for r in there], type=pa.string())
                run_table = run_table.filter(pc.invert(pc.is_in(run_table["run_id"], old)))
                steps_table = steps_table.filter(pc.invert(pc.is_in(steps_table["run_id"], old)))
            insert_arrow(con, "runs", run_table)
            insert_arrow(con, "steps", steps_table)
        return [str(x) for x in run_table["run_id"].to_pylist()]

    def add_trace(self, trace: Mapping[str, Any], positions: Sequence[Mapping[str, Any]]) -> str:
        """Store one traced prompt and its per-position records atomically; returns trace_id."""
        trace_id, trace_table, positions_table = prepare_trace(trace, positions or ())
        with self._writing(f"trace {trace_id}") as con:
            insert_arrow(con, "traces", trace_table)
            insert_arrow(con, "trace_positions", positions_table)
        return trace_id

    def add_costs(self, rows: Sequence[Mapping[str, Any]]) -> str:
        """Store one batch of cost measurements (one row per ctx_bucket); returns its cost_id."""
        cost_id, table = prepare_costs(rows)
        with self._writing(f"costs {cost_id}") as con:
            insert_arrow(con, "costs", table)
        return cost_id

    def add_controller(self, name: str, params: dict[str, np.ndarray], meta: dict[str, Any],
                       source: str, activate: bool = True) -> int:
        """Store a new version of a controller; returns it. activate makes it the only active one."""
        if not isinstance(name, str) or not name:
            raise StoreError(f"controller name must be a non-empty string, got {name!r}")
        blob = pack_params(params)
        meta_text = json_text(meta, f"controller {name!r} meta")
        with self._writing(f"controller {name!r}") as con:
            # Versioning and deactivation in the same transaction as the insert, so two
            # writers can never both end up active or share a version.
            version = next_version(con, name)
            if activate:
                con.execute("UPDATE controllers SET active = false WHERE name = ? AND active",
                            [name])
            con.execute(
                "INSERT INTO controllers (name, version, created_at, source, params, meta, active)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                [name, version, dt.datetime.now(), source, blob, meta_text, bool(activate)],
            )
        return version

    @contextmanager
    def _writing(self, what: str) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor inside one transaction; refuses read-only and locked files in one line."""
        self._check_open()
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only; cannot add {what}")
        with self._lock:
            if self.staged:
                # Only runs are staged (they must never be lost); these are cheap to redo.
                raise StoreError(f"{self._locked_text(self._holder_pid)}; {what} not stored,"
                                 " retry once that process closes it")
            with _transaction(self._cursor(), what) as con:
                yield con

    # ----- reading -------------------------------------------------------------------
    def runs(self, **equals: Any) -> pd.DataFrame:
        """Runs whose columns equal the given values (None matches NULL), oldest first."""
        return self._select("runs", "run_id", equals)

    def traces(self, **equals: Any) -> pd.DataFrame:
        """Traces whose columns equal the given values (None matches NULL), oldest first."""
        return self._select("traces", "trace_id", equals)

    def _select(self, table: str, id_col: str, equals: Mapping[str, Any]) -> pd.DataFrame:
        known = [name for name, _ in columns(table)]
        clauses: list[str] = []
        params: list[Any] = []
        for key, value in equals.items():
            if key not in known:
                raise StoreError(f"{table}(): unknown column {key!r} (known: {', '.join(known)})")
            if value is None:
                clauses.append(f'"{key}" IS NULL')
            else:
                clauses.append(f'"{key}" = ?')
                params.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT * FROM {table}{where} ORDER BY created_at, {id_col}"
        with self._reader() as con:
            return _typed(con.execute(sql, params).df(), table)

    def trace_positions(self, trace_id: str | None = None) -> pd.DataFrame:
        """Positions of one trace, or of all traces ordered like traces(), then by position."""
        where = " WHERE p.trace_id = ?" if trace_id is not None else ""
        sql = (f"SELECT p.* FROM trace_positions p LEFT JOIN traces t ON t.trace_id = p.trace_id"
               f"{where} ORDER BY t.created_at, p.trace_id, p.position")
        with self._reader() as con:
            df = con.execute(sql, [trace_id] if trace_id is not None else []).df()
            return _typed(df, "trace_positions")

    def costs(self, device: str | None = None, target: str | None = None,
              draft: str | None = None, target_tier: str | None = None,
              draft_tier: str | None = None) -> pd.DataFrame:
        """The newest cost batch per (device, target, draft, tiers) key; None filters nothing.

        Rows are ordered by key, then ctx_bucket; older batches are kept but not returned.
        """
        values = (device, target, draft, target_tier, draft_tier)
        sql, params = latest_costs_sql(dict(zip(COST_KEY, values)))
        with self._reader() as con:
            return _typed(con.execute(sql, params).df(), "costs")

    def step_times(self, device: str, target: str, draft: str, target_tier: str) -> pd.DataFrame:
        """(k_drafted, context_len, ms) of every decode step after the prefill of the finished
        runs of one pair on one device and tier; ms = draft_ms + verify_ms."""
        sql = ("SELECT s.k_drafted, s.context_len, s.draft_ms + s.verify_ms AS ms FROM steps s"
               " JOIN runs r ON r.run_id = s.run_id WHERE r.device = ? AND r.target = ? AND r.draft = ?"
               " AND r.target_tier = ? AND r.source = 'speclab' AND r.error IS NULL AND s.step > 0 ORDER BY r.created_at, s.run_id, s.step")
        with self._reader() as con:
            return con.execute(sql, [device, target, draft, target_tier]).df()

    def controller(self, name: str,
                   version: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(params, meta) of one version; None means the active one, else the latest."""
        pick = " AND version = ?" if version is not None else ""
        sql = (f"SELECT version, params, meta FROM controllers WHERE name = ?{pick}"
               " ORDER BY coalesce(active, false) DESC, version DESC LIMIT 1")
        with self._reader() as con:
            row = con.execute(sql, [name] + ([version] if version is not None else [])).fetchone()
            have = [r[0] for r in con.execute(
                "SELECT version FROM controllers WHERE name = ? ORDER BY version", [name]
            ).fetchall()] if row is None else []
        if row is None and not have:
            raise StoreError(f"no controller {name!r} in {self.path};"
                             " run `python -m engine retrain` first")
        if row is None:
            raise StoreError(f"no controller {name!r} version {version} in {self.path}"
                             f" (versions: {', '.join(map(str, have))})")
        where = f"controller {name!r} version {row[0]} in {self.path}"
        if row[1] is None:
            raise StoreError(f"{where} has no params")
        meta = json.loads(row[2]) if row[2] is not None else {}
        return unpack_params(bytes(row[1]), where), meta

    def controllers(self) -> pd.DataFrame:
        """Every controller version (without params), by name then version."""
        sql = ("SELECT name, version, created_at, source, active, meta FROM controllers"
               " ORDER BY name, version")
        with self._reader() as con:
            return _typed(con.execute(sql).df(), "controllers")

    def steps(self, run_id: str | None = None) -> pd.DataFrame:
        """Steps of one run, or of all runs ordered like runs(), then by step."""
        where = " WHERE s.run_id = ?" if run_id is not None else ""
        sql = (f"SELECT s.* FROM steps s LEFT JOIN runs r ON r.run_id = s.run_id{where}"
               " ORDER BY r.created_at, s.run_id, s.step")
        with self._reader() as con:
            return _typed(con.execute(sql, [run_id] if run_id is not None else []).df(), "steps")

    def run(self, run_id: str) -> dict[str, Any]:
        """One run as a dict of plain Python values (lists, datetime, None)."""
        with self._reader() as con:
            cur = con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id])
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        if row is None:
            raise StoreError(f"no run {run_id!r} in {self.path}")
        return dict(zip(names, row))

    @contextmanager
    def _reader(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self._check_open()
        with self._lock:
            if not self.staged:
                yield self._cursor()
                return
            # Staging mode: a short-lived read-only connection works once the other
            # process has let go; kept short so it never blocks a later read-write open.
            try:
                con = connect_with_wait(self.path, read_only=True, wait_s=0.0)
            except LockedError as exc:
                raise StoreError(f"{self._locked_text(exc.pid)} and cannot be read now;"
                                 " try again once that process closes it") from None
            try:
                check_readable(con, self.path)
                yield con
            finally:
                con.close()

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        assert self._con is not None  # only called when not staged and open
        return self._con

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the Store for {self.path} is closed")

    # ----- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Release this Store; the file lock goes when the last Store on it closes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._con is not None:
                self._con.close()
                self._con = None
            if self._registered:
                self._registered = False
                release(self.path)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "staged" if self.staged else ("read-only" if self.read_only else "read-write")
        state = "closed" if self._closed else mode
        return f"Store({self.path!r}, {state})"
