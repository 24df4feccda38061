"""Opening DuckDB files: one shared read-write connection per file per process,
waiting on other processes' locks, and refusing (never repairing) unreadable files."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

import duckdb

from .errors import StoreError

MEMORY = ":memory:"
_RETRY_S = 0.2


class LockedError(Exception):
    """The file is held read-write by another process (internal; Store decides what to do)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"locked by pid {pid}" if pid else "locked")
        self.pid = pid


@dataclass
class _Shared:
    con: duckdb.DuckDBPyConnection
    read_only: bool
    users: int = 0


# DuckDB refuses a second read-write connect() to a file this process already holds
# with a different config, and each connect() would take its own lock anyway; so every
# Store on a file shares one connection and works through its own cursor.
_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def registry_key(path: str) -> str:
    return os.path.realpath(path)


def _is_lock_error(exc: Exception) -> bool:
    text = str(exc).lower()
    return "could not set lock" in text or "conflicting lock" in text


def _lock_pid(exc: Exception) -> int | None:
    match = re.search(r"\bPID (\d+)", str(exc))
    return int(match.group(1)) if match else None


def _reason(exc: Exception) -> str:
    """First line of a DuckDB error without its 'IO Error:' style prefix, kept short."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = re.sub(r"^[A-Za-z ]*Error: ", "", line)
    return line if len(line) <= 160 else line[:157] + "..."


def _connect_once(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    try:
        return duckdb.connect(path, read_only=read_only)
    except duckdb.Error as exc:
        if _is_lock_error(exc):
            raise LockedError(_lock_pid(exc)) from exc
        if os.path.exists(path):
            raise unreadable(path, exc) from None
        if read_only:
            raise StoreError(f"{path} does not exist (cannot open it read-only)") from None
        raise StoreError(f"cannot create {path} ({_reason(exc)})") from None


def unreadable(path: str, exc: Exception) -> StoreError:
    return StoreError(
        f"{path} is not a readable DuckDB database ({_reason(exc)}); it was left untouched"
    )


def connect_with_wait(path: str, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
    """Connect, retrying while another process holds the lock; LockedError after wait_s."""
    if read_only and not os.path.exists(path):
        raise StoreError(f"{path} does not exist (cannot open it read-only)")
    if os.path.isdir(path):
        raise StoreError(f"{path} is a directory, not a DuckDB database file")
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        try:
            return _connect_once(path, read_only)
        except LockedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(_RETRY_S)


def acquire(path: str, read_only: bool, wait_s: float) -> tuple[duckdb.DuckDBPyConnection, bool]:
    """(shared connection, freshly opened?) for a file; LockedError if another process holds it."""
    key = registry_key(path)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is not None:
            if shared.read_only and not read_only:
                raise StoreError(
                    f"{path} is already open read-only in this process;"
                    " close those Stores before opening it read-write"
                )
            shared.users += 1
            return shared.con, False
        # Holding the registry lock while waiting is fine: only other threads of this
        # process wanting a file would wait, and they would need the same lock anyway.
        con = connect_with_wait(path, read_only, wait_s)
        _REGISTRY[key] = _Shared(con=con, read_only=read_only, users=1)
        return con, True


def release(path: str) -> None:
    """Drop one user of the shared connection; the last one closes it (releasing the lock)."""
    key = registry_key(path)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            return
        shared.users -= 1
        if shared.users <= 0:
            del _REGISTRY[key]
            shared.con.close()
