"""Cost batches (one key per batch, the latest per key read back) and controller
parameters (.npz, never pickled)."""

from __future__ import annotations

import io
import json
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import StoreError
from .rows import to_table

# What identifies a cost measurement; costs() keeps the newest batch per key.
COST_KEY = ("device", "target", "draft", "target_tier", "draft_tier", "kv_tier")  # the one spelling (engine.base.names)
# np.savez's own parameter names cannot be used as array names.
_RESERVED = ("file", "allow_pickle")


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


def prepare_costs(rows: Sequence[Mapping[str, Any]]) -> tuple[str, pa.Table]:
    """(cost_id, costs table): one batch of ctx buckets for one (device, models, tiers) key."""
    if not rows:
        raise StoreError("add_costs needs at least one row (one per ctx_bucket)")
    given = {r.get("cost_id") for r in rows if isinstance(r, Mapping)}
    if len(given) > 1:
        raise StoreError("costs rows carry different cost_ids; a batch has one (or none given)")
    cost_id = given.pop() if given and None not in given else uuid.uuid4().hex
    table = to_table("costs", "costs", rows, parent=cost_id)
    # One cost_id stands for one key; mixed keys would make "latest" meaningless.
    keys = list(zip(*(table[k].to_pylist() for k in COST_KEY)))
    for i, key in enumerate(keys):
        if key != keys[0]:
            raise StoreError(f"costs[{i}] has a different ({', '.join(COST_KEY)}) than costs[0];"
                             " add one batch per key")
    return cost_id, table


def read_controller(con, name: str, version: int | None, path: object) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(params, meta) of one stored controller version (None: the active one, else the newest
    not held back), read through `con`; a missing one is a StoreError naming the versions there are.
    A version is held back when retraining found it worse than what it would replace (its
    `metrics.shortfalls`, engine/service/replays.py): only activating it by hand makes it used."""
    pick = " AND version = ?" if version is not None else ""
    sql = (f"SELECT version, params, meta, coalesce(active, false) FROM controllers WHERE name = ?{pick}"
           " ORDER BY coalesce(active, false) DESC, version DESC")
    rows = con.execute(sql, [name] + ([version] if version is not None else [])).fetchall()
    if not rows:
        have = [r[0] for r in con.execute("SELECT version FROM controllers WHERE name = ? ORDER BY version",
                                          [name]).fetchall()]
        if not have:
            raise StoreError(f"no controller {name!r} in {path}; run `python -m engine retrain` first")
        raise StoreError(f"no controller {name!r} version {version} in {path} (versions: {', '.join(map(str, have))})")
    metas = [json.loads(r[2]) if r[2] is not None else {} for r in rows]
    usable = [i for i, (r, m) in enumerate(zip(rows, metas)) if version is not None or r[3] or not _held_back(m)]
    if not usable:
        held = ", ".join(f"v{r[0]}" for r in rows)
        raise StoreError(f"no controller {name!r} to use in {path}: {held} held back by retraining (worse than what "
                         "they would replace); activate one on the Replay & retrain page or `retrain --activate`")
    row, meta = rows[usable[0]], metas[usable[0]]
    where = f"controller {name!r} version {row[0]} in {path}"
    if row[1] is None:
        raise StoreError(f"{where} has no params")
    return unpack_params(bytes(row[1]), where), meta


def _held_back(meta: dict[str, Any]) -> bool:
    return bool((meta.get("metrics") or {}).get("shortfalls"))
