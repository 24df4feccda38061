"""Rows for the profiling tables (traces, costs) and learned controllers.

Kept out of store.py so the Store stays a thin layer of locking and transactions: the
functions here validate and shape rows (before any write) or read one thing through a
cursor the caller already holds inside its transaction.
"""

from __future__ import annotations

import datetime as dt
import io
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from .errors import StoreError
from .rows import json_text, to_table

# What identifies a cost measurement; costs() keeps the newest batch per key.
COST_KEY = ("device", "target", "draft", "target_tier", "draft_tier")
# np.savez's own parameter names cannot be used as array names.
_RESERVED = ("file", "allow_pickle")


def _children(table: str, parent: str, parent_id: str, key: str,
              rows: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    """Copies of child rows tagged with the parent's id, checked for the primary key."""
    out: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise StoreError(f"{where}[{i}] must be a dict, got {type(row).__name__}")
        copy = dict(row)
        if copy.get(parent) not in (None, parent_id):
            raise StoreError(f"{where}[{i}].{parent} is {copy[parent]!r} but the {table}"
                             f" parent is {parent_id!r}")
        if copy.get(key) is None:
            raise StoreError(f"{where}[{i}] has no {key!r}")
        if copy[key] in seen:
            raise StoreError(f"{where}[{i}].{key} {copy[key]!r} is repeated")
        seen.add(copy[key])
        copy[parent] = parent_id
        out.append(copy)
    return out


def prepare_trace(trace: Mapping[str, Any],
                  positions: Sequence[Mapping[str, Any]]) -> tuple[str, pa.Table, pa.Table]:
    """(trace_id, traces table, trace_positions table), validated before any write."""
    if not isinstance(trace, Mapping):
        raise StoreError(f"trace must be a dict, got {type(trace).__name__}")
    row = dict(trace)
    trace_id = row.get("trace_id") or uuid.uuid4().hex
    if not isinstance(trace_id, str):
        raise StoreError(f"trace.trace_id must be a string, got {trace_id!r}")
    row["trace_id"] = trace_id
    # Stamped here: every column goes into the insert, so the SQL default never applies.
    row["created_at"] = row.get("created_at") or dt.datetime.now()
    row["config"] = json_text(row.get("config"), "trace.config")
    kids = _children("trace_positions", "trace_id", trace_id, "position", positions, "positions")
    return (trace_id, to_table("traces", "trace", [row]),
            to_table("trace_positions", "positions", kids))


def prepare_costs(rows: Sequence[Mapping[str, Any]]) -> tuple[str, pa.Table]:
    """(cost_id, costs table): one batch of ctx buckets for one (device, models, tiers) key."""
    if not rows:
        raise StoreError("add_costs needs at least one row (one per ctx_bucket)")
    given = {r.get("cost_id") for r in rows if isinstance(r, Mapping)}
    if len(given) > 1:
        raise StoreError("costs rows carry different cost_ids; a batch has one (or none given)")
    cost_id = given.pop() if given and None not in given else uuid.uuid4().hex
    out = _children("costs", "cost_id", cost_id, "ctx_bucket", rows, "costs")
    first = tuple(out[0].get(k) for k in COST_KEY)
    now = dt.datetime.now()
    for i, row in enumerate(out):
        # One cost_id stands for one key; mixed keys would make "latest" meaningless.
        if tuple(row.get(k) for k in COST_KEY) != first:
            raise StoreError(f"costs[{i}] has a different ({', '.join(COST_KEY)}) than costs[0];"
                             " add one batch per key")
        row["created_at"] = row.get("created_at") or now
    return cost_id, to_table("costs", "costs", out)


def latest_costs_sql(filters: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """SQL for the rows of the newest cost batch per key, among batches matching filters."""
    clauses = [f'"{k}" = ?' for k, v in filters.items() if v is not None]
    params = [v for v in filters.values() if v is not None]
    where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    key = ", ".join(COST_KEY)
    sql = f"""
        WITH batches AS (
            SELECT cost_id, max(created_at) AS created_at, {key}
            FROM costs{where} GROUP BY cost_id, {key}
        ), ranked AS (
            SELECT cost_id, row_number() OVER (
                PARTITION BY {key} ORDER BY created_at DESC, cost_id DESC) AS rank
            FROM batches
        )
        SELECT c.* FROM costs c JOIN ranked r ON r.cost_id = c.cost_id AND r.rank = 1
        ORDER BY {', '.join(f'c.{k}' for k in COST_KEY)}, c.ctx_bucket
    """
    return sql, params


def pack_params(params: Mapping[str, Any]) -> bytes:
    """Arrays -> .npz bytes; object arrays are refused so loading never needs pickle."""
    if not isinstance(params, Mapping):
        raise StoreError(f"controller params must be a dict of arrays, got {type(params).__name__}")
    for name in params:
        if not isinstance(name, str) or not name or name in _RESERVED:
            raise StoreError(f"controller params: {name!r} cannot name an array")
    buf = io.BytesIO()
    try:
        np.savez(buf, allow_pickle=False, **{k: np.asarray(v) for k, v in params.items()})
    except (ValueError, TypeError) as exc:
        raise StoreError(f"controller params cannot be stored without pickle ({exc})") from None
    return buf.getvalue()


def unpack_params(blob: bytes, where: str) -> dict[str, np.ndarray]:
    """.npz bytes -> arrays, with allow_pickle=False: a stored blob must not run code."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise StoreError(f"{where} has unreadable params ({exc})") from None


def next_version(con: duckdb.DuckDBPyConnection, name: str) -> int:
    row = con.execute("SELECT max(version) FROM controllers WHERE name = ?", [name]).fetchone()
    return int(row[0]) + 1 if row and row[0] is not None else 1
