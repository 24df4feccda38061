"""The one row validator: caller dicts (or staged Parquet rows) of any table become a typed
Arrow table, or a one-line StoreError naming the row and column, before anything is written."""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from .errors import StoreError
from .schema import PY_DEFAULTS, arrow_schema, columns

# Tables whose id column gets a fresh uuid when the caller gives none.
_IDS = {"runs": "run_id", "traces": "trace_id", "kv_measurements": "measurement_id", "export_checks": "check_id"}
# Child tables: (column naming the parent, the columns unique per parent; the last must be given,
# the others have defaults: a trace position and a cost bucket are the draft model's unless named).
_CHILDREN = {"steps": ("run_id", ("step",)), "trace_positions": ("trace_id", ("proposer", "position")),
             "costs": ("cost_id", ("proposer", "ctx_bucket"))}
# Per-step draft statistics are undefined when nothing was drafted; engines tend to
# produce NaN (mean of an empty array) there, which would poison averages in SQL.
_DRAFT_STATS = ("mean_entropy", "max_entropy", "mean_confidence", "min_confidence")
_INT_TYPES = ("INTEGER", "BIGINT", "INTEGER[]", "BIGINT[]")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _non_integral(value: Any) -> bool:
    """True for a float that an int column would silently truncate (Arrow does that)."""
    if isinstance(value, float):
        return not (math.isfinite(value) and value.is_integer())
    if isinstance(value, (list, tuple)):
        return any(_non_integral(item) for item in value)
    if hasattr(value, "dtype") and getattr(value.dtype, "kind", "") == "f":
        return any(_non_integral(float(item)) for item in value)
    return False


def _array(values: list[Any], dtype: str, arrow_type: pa.DataType) -> pa.Array:
    if dtype in _INT_TYPES and any(_non_integral(v) for v in values):
        raise ValueError("non-integral")
    return pa.array(values, type=arrow_type)


def json_text(value: Any, where: str) -> str | None:
    """JSON columns hold text; accept a dict or already-serialized text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as exc:
            raise StoreError(f"{where} is a string but not valid JSON ({exc})") from None
        return value
    try:
        return json.dumps(value, allow_nan=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{where} cannot be serialized to JSON ({exc})") from None


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars / arrays and paths show up in configs
        return value.tolist()
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _row(table: str, label: str, where: str, row: Any, parent: str | None,
         now: dt.datetime) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise StoreError(f"{label} must be a dict, got {type(row).__name__}")
    cols = columns(table)
    known = [name for name, _ in cols]
    unknown = [key for key in row if key not in known]
    if unknown:
        raise StoreError(f"{label}: unknown key {unknown[0]!r} for table {table}"
                         f" (known keys: {', '.join(known)})")
    out = dict(row)
    if table in _IDS:
        out[_IDS[table]] = out.get(_IDS[table]) or uuid.uuid4().hex
        if not isinstance(out[_IDS[table]], str):
            raise StoreError(f"{label}.{_IDS[table]} must be a string, got {_short(out[_IDS[table]])}")
    if table in _CHILDREN:
        col, keys = _CHILDREN[table]
        if out.get(col) not in (None, parent):
            raise StoreError(f"{label}.{col} is {out[col]!r} but the parent is {parent!r}")
        if out.get(keys[-1]) is None:
            raise StoreError(f"{label} has no {keys[-1]!r}")
        out[col] = parent
    if out.get("k_drafted") == 0 and table == "steps":
        for name in _DRAFT_STATS:
            if isinstance(out.get(name), float) and math.isnan(out[name]):
                out[name] = None
    if table == "steps" and out.get("proposer") is None:  # rows from before proposers (imports): the draft's
        out["proposer"] = "draft" if (out.get("k_drafted") or 0) > 0 else ""
    for name, dtype in cols:
        if name == "created_at" and out.get(name) is None:
            # Stamped here, not by the DB default, so a run staged now keeps its time.
            out[name] = now
        elif dtype == "JSON":
            out[name] = json_text(out.get(name), f"{where}.{name}")
        elif out.get(name) is None and name in PY_DEFAULTS.get(table, {}):
            out[name] = PY_DEFAULTS[table][name]
    return out


def to_table(table: str, where: str, rows: Sequence[Any], parent: str | None = None) -> pa.Table:
    """Typed Arrow table with every column of `table` (missing keys NULL or their default).

    Ids of runs / traces are filled in, children are tagged with `parent` and checked for
    their key, created_at is stamped, JSON columns are serialized and checked.
    """
    now = dt.datetime.now()
    out = [_row(table, f"{where}[{i}]", where, row, parent, now) for i, row in enumerate(rows)]
    if table in _CHILDREN:
        keys, seen = _CHILDREN[table][1], set()
        for i, row in enumerate(out):
            key = tuple(row[k] for k in keys)
            if key in seen:
                also = "".join(f" ({k} {row[k]!r})" for k in keys[:-1])
                raise StoreError(f"{where}[{i}].{keys[-1]} {row[keys[-1]]!r}{also} is repeated under {parent!r}")
            seen.add(key)
    schema = arrow_schema(table)
    arrays: list[pa.Array] = []
    for (name, dtype), field in zip(columns(table), schema):
        try:
            arrays.append(_array([row.get(name) for row in out], dtype, field.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            for i, row in enumerate(out):  # name the first row that does not fit
                try:
                    _array([row.get(name)], dtype, field.type)
                except (pa.ArrowException, TypeError, ValueError, OverflowError):
                    raise StoreError(f"{where}[{i}].{name}: cannot store {_short(row.get(name))}"
                                     f" as {dtype} in table {table}") from None
            raise StoreError(f"{where}.{name}: values cannot be stored as {dtype}"
                             f" in table {table}") from None
    return pa.Table.from_arrays(arrays, schema=schema)
