"""The Store: runs and steps in a DuckDB file, staged when another process holds it; plus
profiling traces, cost tables and learned controllers."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import staging
from .connection import MEMORY, LockedError, acquire, connect_with_wait, insert, release, transaction, unreadable
from .errors import StoreError, reason
from .measures import PairMeasures
from .rows import to_table
from .schema import check_readable, columns, migrate
from .staging import StagedWrite
from .tables import COST_KEY, latest_costs_sql, pack_params, prepare_costs, read_controller

# DuckDB gives int64 for an integer column without NULLs and Int64 with them; callers
# concatenating or comparing frames need the same dtype whatever the data.
_PANDAS_DTYPES = {"INTEGER": "Int32", "BIGINT": "Int64", "BOOLEAN": "boolean"}
_CANNOT_READ = " and cannot be read now; try again once that process closes it"


def _typed(df: pd.DataFrame, table: str) -> pd.DataFrame:
    for name, dtype in columns(table):
        if dtype in _PANDAS_DTYPES and name in df.columns:
            df[name] = df[name].astype(_PANDAS_DTYPES[dtype])
    return df


def _run_tables(where: str, runs: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]
                ) -> tuple[pa.Table, pa.Table]:
    """(runs table, steps table) of (run, steps) pairs, validated before any write."""
    run_table = to_table("runs", where, [run for run, _ in runs])
    steps = [to_table("steps", "steps", s or (), parent=run_id)
             for run_id, (_, s) in zip(run_table["run_id"].to_pylist(), runs)]
    return run_table, pa.concat_tables(steps) if steps else to_table("steps", "steps", [])


# The steps of one pair's finished live runs on one device, tier and KV tier (parameters: device,
# target, draft, target tier, KV tier twice: NULL matches every KV tier): what calibrates its cost
# table and measures its acceptance.
class Store(PairMeasures):
    """Handle on one SpecLab database file (or ":memory:").

    Attributes callers read: path, read_only, staged (True when the file was locked by
    another process and runs go to Parquet staging), message (one line for the UI, ""
    when there is nothing to say), staged_writes (StagedWrite per run staged by this
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
        if self.path == MEMORY:
            self._con = duckdb.connect(MEMORY)
            migrate(self._con, self.path)
        else:
            self._open_file()

    # ----- opening -------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return os.path.basename(self.path) or self.path

    def _open_file(self) -> None:
        try:
            shared = acquire(self.path, self.read_only, self.wait_s)
        except LockedError as exc:
            self._on_locked(exc.pid)
            return
        self._registered = True
        try:
            self._con = shared.con.cursor()
            with shared.lock:  # Stores opening one fresh file at once must not all migrate it
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
            self.ingested = staging.ingest(con, self.path)
        except duckdb.TransactionException as exc:  # a conflict, not a bad file
            raise StoreError(f"cannot set up {self.path}: another writer changed it at the same"
                             f" time ({reason(exc)}); try again") from None
        except duckdb.Error as exc:
            raise unreadable(self.path, exc) from None
        if self.ingested:
            self.message = (f"ingested {len(self.ingested)} staged run(s) from"
                            f" {staging.folder(self._name)}/")

    def _locked_text(self, pid: int | None, then: str = "") -> str:
        if pid == os.getpid():
            return f"{self._name} is being read in this process{then}"
        holder = f" (pid {pid})" if pid else ""
        return f"{self._name} is locked by another process{holder}{then}"

    def _on_locked(self, pid: int | None) -> None:
        if self.read_only:
            raise StoreError(self._locked_text(pid, _CANNOT_READ))
        # Not failing here is the point: a finished generation must never be lost
        # because the UI (or a benchmark) happens to hold the file.
        self.staged = True
        self._holder_pid = pid
        self.message = (f"{self._locked_text(pid)}; runs are staged in"
                        f" {staging.folder(self._name)}/ and ingested on next open")

    # ----- writing -------------------------------------------------------------------
    def add_run(self, run: Mapping[str, Any], steps: Sequence[Mapping[str, Any]] = ()) -> str:
        """Store one run and its steps atomically; returns its run_id."""
        self._check_writable("a run")
        run_table, steps_table = _run_tables("run", [(run, steps)])
        run_id: str = run_table["run_id"][0].as_py()
        with self._lock:
            if self.staged:
                self.staged_writes.append(staging.stage(self.path, run_table, steps_table))
                self.message = (f"{self._locked_text(self._holder_pid)}; run {run_id} staged in"
                                f" {staging.folder(self._name)}/ and ingested on next open")
                return run_id
            with self._writing(f"run {run_id}") as con:
                insert(con, "runs", run_table)
                insert(con, "steps", steps_table)
        return run_id

    def add_runs(self, runs: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]],
                 *, skip_existing: bool = False) -> list[str]:
        """Store many (run, steps) pairs in ONE transaction (imports); returns the run_ids added.

        With skip_existing, runs whose run_id is already stored are left out, so
        re-importing with deterministic ids adds nothing twice.
        """
        self._check_writable("runs")
        run_table, steps_table = _run_tables("runs", runs)
        with self._writing(f"{len(runs)} runs") as con:
            if skip_existing and len(runs):
                there = con.execute("SELECT run_id FROM runs WHERE list_contains(?, run_id)",
                                    [run_table["run_id"].to_pylist()]).fetchall()
                old = pa.array([r[0] for r in there], type=pa.string())
                run_table = run_table.filter(pc.invert(pc.is_in(run_table["run_id"], old)))
                steps_table = steps_table.filter(pc.invert(pc.is_in(steps_table["run_id"], old)))
            insert(con, "runs", run_table)
            insert(con, "steps", steps_table)
        return [str(x) for x in run_table["run_id"].to_pylist()]

    def add_trace(self, trace: Mapping[str, Any], positions: Sequence[Mapping[str, Any]]) -> str:
        """Store one traced prompt and its per-position records atomically; returns trace_id."""
        self._check_writable("a trace")
        trace_table = to_table("traces", "trace", [trace])
        trace_id: str = trace_table["trace_id"][0].as_py()
        positions_table = to_table("trace_positions", "positions", positions or (), parent=trace_id)
        with self._writing(f"trace {trace_id}") as con:
            insert(con, "traces", trace_table)
            insert(con, "trace_positions", positions_table)
        return trace_id

    def add_costs(self, rows: Sequence[Mapping[str, Any]]) -> str:
        """Store one batch of cost measurements (one row per ctx_bucket); returns its cost_id."""
        self._check_writable("costs")
        cost_id, table = prepare_costs(rows)
        with self._writing(f"costs {cost_id}") as con:
            insert(con, "costs", table)
        return cost_id

    def add_controller(self, name: str, params: dict[str, np.ndarray], meta: dict[str, Any],
                       source: str, activate: bool = True) -> int:
        """Store a new version of a controller; returns it. activate makes it the only active one."""
        self._check_writable("a controller")
        if not isinstance(name, str) or not name:
            raise StoreError(f"controller name must be a non-empty string, got {name!r}")
        row = {"name": name, "source": source, "params": pack_params(params), "meta": meta,
               "active": bool(activate)}
        to_table("controllers", "controller", [row])  # validated before the transaction
        with self._writing(f"controller {name!r}") as con:
            # Versioning and deactivation in the insert's transaction, so two writers can
            # never both end up active or share a version.
            row["version"] = con.execute("SELECT coalesce(max(version), 0) + 1 FROM controllers"
                                         " WHERE name = ?", [name]).fetchall()[0][0]
            if activate:
                con.execute("UPDATE controllers SET active = false WHERE name = ? AND active",
                            [name]).fetchall()
            insert(con, "controllers", to_table("controllers", "controller", [row]))
        return int(row["version"])

    def activate_controller(self, name: str, version: int) -> None:
        """Make `version` the only active version of controller `name` (retrain stores new
        versions inactive on the workbench, which activates one only when asked)."""
        self._check_writable("a controller activation")
        with self._writing(f"activation of controller {name!r} version {version}") as con:
            # The check and the switch in one transaction: no moment with none or two active.
            have = [r[0] for r in con.execute("SELECT version FROM controllers WHERE name = ?"
                                              " ORDER BY version", [name]).fetchall()]
            if not have:
                raise StoreError(f"no controller {name!r} in {self.path};"
                                 " run `python -m engine retrain` first")
            if isinstance(version, bool) or version not in have:
                raise StoreError(f"no controller {name!r} version {version} in {self.path}"
                                 f" (versions: {', '.join(map(str, have))})")
            con.execute("UPDATE controllers SET active = (version = ?) WHERE name = ?",
                        [int(version), name]).fetchall()

    def add_kv_measurement(self, row: Mapping[str, Any]) -> str:
        """Store one KV measurement (device, target, target_tier, kind, result JSON); returns its id."""
        self._check_writable("a KV measurement")
        table = to_table("kv_measurements", "KV measurement", [row])
        measurement_id: str = table["measurement_id"][0].as_py()
        with self._writing(f"KV measurement {measurement_id}") as con:
            insert(con, "kv_measurements", table)
        return measurement_id

    def add_export(self, name: str, config: Mapping[str, Any], fmt: str, content: str) -> int:
        """Store a new version of export `name` (its SpecLab config and the exported text in
        format `fmt`); returns the version."""
        self._check_writable("an export")
        for what, value in (("name", name), ("format", fmt)):
            if not isinstance(value, str) or not value.strip():
                raise StoreError(f"export {what} must be a non-empty string, got {value!r}")
        if not isinstance(config, Mapping):
            raise StoreError(f"export config must be a dict, got {type(config).__name__}")
        if not isinstance(content, str):
            raise StoreError(f"export content must be text, got {type(content).__name__}")
        row = {"export_id": uuid.uuid4().hex, "name": name, "format": fmt, "config": dict(config),
               "content": content}
        to_table("exports", "export", [dict(row, version=1)])  # validated before the transaction
        with self._writing(f"export {name!r}") as con:
            # Numbered in the insert's transaction, so two writers never share a version.
            row["version"] = con.execute("SELECT coalesce(max(version), 0) + 1 FROM exports WHERE name = ?",
                                         [name]).fetchall()[0][0]
            insert(con, "exports", to_table("exports", "export", [row]))
        return int(row["version"])

    def exports(self, name: str | None = None) -> pd.DataFrame:
        """Stored exports (of one name, or all), oldest first."""
        return self._select("exports", "export_id", {} if name is None else {"name": name})

    def add_export_check(self, row: Mapping[str, Any]) -> str:
        """Store one run of an export in the engine it names (engine, engine_version, device,
        config, ran, reason, result JSON); returns its id."""
        self._check_writable("an export check")
        engine = row.get("engine")
        if not isinstance(engine, str) or not engine.strip():
            raise StoreError(f"export check engine must be a non-empty string, got {engine!r}")
        table = to_table("export_checks", "export check", [row])
        check_id: str = table["check_id"][0].as_py()
        with self._writing(f"export check {check_id}") as con:
            insert(con, "export_checks", table)
        return check_id

    def export_checks(self, **equals: Any) -> pd.DataFrame:
        """Export checks whose columns equal the given values, oldest first."""
        return self._select("export_checks", "check_id", equals)

    def kv_measurements(self, **equals: Any) -> pd.DataFrame:
        """KV measurements whose columns equal the given values, oldest first."""
        return self._select("kv_measurements", "measurement_id", equals)

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise StoreError(f"{self.path} is open read-only; cannot add {what}")

    @contextmanager
    def _writing(self, what: str) -> Iterator[duckdb.DuckDBPyConnection]:
        """The cursor inside one transaction; refuses a locked file in one line."""
        with self._lock:
            if self.staged:
                # Only runs are staged (they must never be lost); these are cheap to redo.
                raise StoreError(f"{self._locked_text(self._holder_pid)}; {what} not stored,"
                                 " retry once that process closes it")
            assert self._con is not None
            with transaction(self._con, what) as con:
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
        for key in equals:
            if key not in known:
                raise StoreError(f"{table}(): unknown column {key!r} (known: {', '.join(known)})")
        clauses = [f'"{k}" IS NULL' if v is None else f'"{k}" = ?' for k, v in equals.items()]
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT * FROM {table}{where} ORDER BY created_at, {id_col}"
        with self._reader() as con:
            params = [v for v in equals.values() if v is not None]
            return _typed(con.execute(sql, params).df(), table)

    def _children(self, table: str, parent: str, id_col: str, order: tuple[str, ...],
                  parent_id: str | None) -> pd.DataFrame:
        """Rows of one parent, or of all parents ordered like the parents, then by `order`."""
        where = f" WHERE c.{id_col} = ?" if parent_id is not None else ""
        sql = (f"SELECT c.* FROM {table} c LEFT JOIN {parent} p ON p.{id_col} = c.{id_col}{where}"
               f" ORDER BY p.created_at, c.{id_col}, {', '.join(f'c.{o}' for o in order)}")
        with self._reader() as con:
            return _typed(con.execute(sql, [] if parent_id is None else [parent_id]).df(), table)

    def steps(self, run_id: str | None = None) -> pd.DataFrame:
        """Steps of one run, or of all runs ordered like runs(), then by step."""
        return self._children("steps", "runs", "run_id", ("step",), run_id)

    def trace_positions(self, trace_id: str | None = None) -> pd.DataFrame:
        """Positions of one trace, or of all traces ordered like traces(), then by proposer and
        position (a row per proposer and position; traces made before proposers hold the draft's)."""
        return self._children("trace_positions", "traces", "trace_id", ("proposer", "position"), trace_id)

    def trace_proposers(self) -> dict[str, tuple[str, ...]]:
        """trace_id → the proposers whose proposals it holds (sorted by name)."""
        sql = "SELECT trace_id, list(DISTINCT proposer ORDER BY proposer) FROM trace_positions GROUP BY trace_id"
        with self._reader() as con:
            return {str(t): tuple(names) for t, names in con.execute(sql).fetchall()}

    def costs(self, device: str | None = None, target: str | None = None,
              draft: str | None = None, target_tier: str | None = None,
              draft_tier: str | None = None, kv_tier: str | None = None) -> pd.DataFrame:
        """The newest cost batch per (device, target, draft, tiers, KV tier) key; None filters
        nothing.

        Rows are ordered by key, then ctx_bucket; older batches are kept but not returned.
        """
        values = (device, target, draft, target_tier, draft_tier, kv_tier)
        sql, params = latest_costs_sql(dict(zip(COST_KEY, values)))
        with self._reader() as con:
            return _typed(con.execute(sql, params).df(), "costs")

    def controller(self, name: str,
                   version: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(params, meta) of one version; None means the active one, else the newest not held back."""
        with self._reader() as con:
            return read_controller(con, name, version, self.path)

    def controllers(self) -> pd.DataFrame:
        """Every controller version (without params), by name then version."""
        sql = ("SELECT name, version, created_at, source, active, meta FROM controllers"
               " ORDER BY name, version")
        with self._reader() as con:
            return _typed(con.execute(sql).df(), "controllers")

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
                yield self._con
                return
            # Staging mode: a short-lived read-only connection works once the other
            # process has let go; kept short so it never blocks a later read-write open.
            try:
                con = connect_with_wait(self.path, read_only=True, wait_s=0.0)
            except LockedError as exc:
                raise StoreError(self._locked_text(exc.pid, _CANNOT_READ)) from None
            try:
                check_readable(con, self.path)
                yield con
            finally:
                con.close()

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
