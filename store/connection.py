"""Opening DuckDB files (one shared connection per file per process, waiting on other
processes' locks, refusing but never repairing unreadable files) and transactions."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from .errors import StoreError, reason

MEMORY = ":memory:"
_RETRY_S = 0.2


class LockedError(Exception):
    """The file is held read-write by another process (the Store decides what to do)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"locked by pid {pid}" if pid else "locked")
        self.pid = pid


@dataclass
class Shared:
    """One file's connection; `lock` serializes schema setup of the Stores sharing it."""

    con: duckdb.DuckDBPyConnection
    read_only: bool
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


# DuckDB refuses a second connect() to a file this process holds with another config, and
# each connect() would take its own lock; so Stores on a file share one connection.
_REGISTRY: dict[str, Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def file_stamp(path: str) -> tuple:
    """What changes with every commit to the file at `path`: its and its write-ahead log's size and
    modification time (a commit appends to the log; a checkpoint rewrites the file and drops the
    log). Readers key what they derive from the file on it."""
    out = []
    for p in (path, f"{path}.wal"):
        try:
            st = os.stat(p)
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def unreadable(path: str, exc: Exception) -> StoreError:
    return StoreError(f"{path} is not a readable DuckDB database ({reason(exc)}); it was left untouched")


def connect_with_wait(path: str, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    """Connect, retrying while another process holds the lock; LockedError after wait_s."""
    if read_only and not os.path.exists(path):
        raise StoreError(f"{path} does not exist (cannot open it read-only)")
    if os.path.isdir(path):
        raise StoreError(f"{path} is a directory, not a DuckDB database file")
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        try:
            return duckdb.connect(path, read_only=read_only)
        except duckdb.Error as exc:
            if not re.search(r"could not set lock|conflicting lock", str(exc), re.IGNORECASE):
                if os.path.exists(path):
                    raise unreadable(path, exc) from None
                raise StoreError(f"cannot create {path} ({reason(exc)})") from None
            if time.monotonic() >= deadline:
                pid = re.search(r"\bPID (\d+)", str(exc))
                raise LockedError(int(pid.group(1)) if pid else None) from None
        time.sleep(_RETRY_S)


def acquire(path: str, read_only: bool, wait_s: float) -> Shared:
    """The file's shared connection, one more user on it; LockedError if another process holds it,
    or if this process goes on reading it read-only for `wait_s` while a writer waits (the
    workbench's pages read briefly: a run finishing meanwhile waits for them, else is staged)."""
    key = os.path.realpath(path)
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        with _REGISTRY_LOCK:  # while connecting too: other threads wanting a file need it anyway
            shared = _REGISTRY.get(key)
            if shared is None:
                shared = _REGISTRY[key] = Shared(connect_with_wait(path, read_only, wait_s), read_only)
            if read_only or not shared.read_only:
                shared.users += 1
                return shared
        if time.monotonic() >= deadline:
            raise LockedError(os.getpid())
        time.sleep(_RETRY_S)


def release(path: str) -> None:
    """Drop one user of the shared connection; the last one closes it (releasing the lock)."""
    key = os.path.realpath(path)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is not None:
            shared.users -= 1
            if shared.users <= 0:
                del _REGISTRY[key]
                shared.con.close()


@contextlib.contextmanager
def transaction(con: duckdb.DuckDBPyConnection,
                what: str | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """All or nothing. With `what`, a DuckDB error becomes one line saying what was not stored."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
        con.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(duckdb.Error):  # a failed COMMIT has already rolled back
            con.execute("ROLLBACK")
        if what is not None and isinstance(exc, duckdb.Error):
            raise StoreError(f"{what} not stored ({reason(exc)})") from None
        raise


def insert(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> None:
    """One bulk INSERT ... BY NAME of an Arrow table (from rows.to_table)."""
    if data.num_rows == 0:
        return
    view = f"_speclab_new_{table}"  # a replacement scan of a local `steps` would lose to the table
    con.register(view, data)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {view}")
    finally:
        con.unregister(view)
