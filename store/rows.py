"""Turn the caller's run / step dicts into typed Arrow tables (validated before any write)."""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from .errors import StoreError
from .schema import PY_DEFAULTS, arrow_schema, columns

# Per-step draft statistics are undefined when nothing was drafted; engines tend to
# produce NaN (mean of an empty array) there, which would poison averages in SQL.
_DRAFT_STATS = ("mean_entropy", "max_entropy", "mean_confidence", "min_confidence")
_INT_TYPES = ("INTEGER", "BIGINT", "INTEGER[]", "BIGINT[]")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_keys(table: str, where: str, row: Mapping[str, Any]) -> None:
    known = [name for name, _ in columns(table)]
    unknown = [key for key in row if key not in known]
    if unknown:
        raise StoreError(
            f"{where}: unknown key {unknown[0]!r} for table {table}"
            f" (known keys: {', '.join(known)})"
        )


def _non_integral(value: Any) -> bool:
    """True for a float that an int column would silently truncate (Arrow does that)."""
    if isinstance(value, float):
        return not (math.isfinite(value) and value.is_integer())
    if isinstance(value, (list, tuple)):
        return any(_non_integral(item) for item in value)
    if hasattr(value, "dtype") and getattr(value.dtype, "kind", "") == "f":
        return any(_non_integral(float(item)) for item in value)
    return False


def _bad_value(table: str, where: str, rows: Sequence[Mapping[str, Any]], name: str,
               dtype: str, arrow_type: pa.DataType) -> StoreError:
    """Name the first row whose value does not fit, so the message is actionable."""
    for i, row in enumerate(rows):
        value = row.get(name)
        try:
            if dtype in _INT_TYPES and _non_integral(value):
                raise ValueError("non-integral")
            pa.array([value], type=arrow_type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return StoreError(
                f"{where}[{i}].{name}: cannot store {_short(value)} as {dtype} in table {table}"
            )
    return StoreError(f"{where}.{name}: values cannot be stored as {dtype} in table {table}")


def to_table(table: str, where: str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Typed Arrow table with every column of `table`; missing keys become NULL."""
    for i, row in enumerate(rows):
        _check_keys(table, f"{where}[{i}]", row)
    schema = arrow_schema(table)
    arrays: list[pa.Array] = []
    for (name, dtype), field in zip(columns(table), schema):
        values = [row.get(name) for row in rows]
        try:
            if dtype in _INT_TYPES and any(_non_integral(v) for v in values):
                raise ValueError("non-integral")
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            raise _bad_value(table, where, rows, name, dtype, field.type) from None
    return pa.Table.from_arrays(arrays, schema=schema)


def json_text(config: Any, where: str = "run.config") -> str | None:
    """JSON columns hold text; accept a dict or already-serialized text."""
    if config is None:
        return None
    if isinstance(config, str):
        try:
            json.loads(config)
        except ValueError as exc:
            raise StoreError(f"{where} is a string but not valid JSON ({exc})") from None
        return config
    try:
        return json.dumps(config, allow_nan=True, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{where} cannot be serialized to JSON ({exc})") from None


def _json_default(value: Any) -> Any:
    # numpy scalars / arrays and paths show up in generation configs.
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def prepare_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of `run` with run_id, created_at and config filled in / normalized."""
    if not isinstance(run, Mapping):
        raise StoreError(f"run must be a dict, got {type(run).__name__}")
    _check_keys("runs", "run", run)
    out = dict(run)
    run_id = out.get("run_id") or uuid.uuid4().hex
    if not isinstance(run_id, str):
        raise StoreError(f"run.run_id must be a string, got {_short(run_id)}")
    out["run_id"] = run_id
    # Stamped here, not by the DB default, so a run staged now and ingested later
    # keeps the time it actually ran.
    if out.get("created_at") is None:
        out["created_at"] = dt.datetime.now()
    out["config"] = json_text(out.get("config"))
    for name, value in PY_DEFAULTS["runs"].items():
        if out.get(name) is None:
            out[name] = value
    return out


def prepare_steps(run_id: str, steps: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the step dicts tagged with run_id, checked for the primary key."""
    out: list[dict[str, Any]] = []
    for i, step in enumerate(steps):
        if not isinstance(step, Mapping):
            raise StoreError(f"steps[{i}] must be a dict, got {type(step).__name__}")
        row = dict(step)
        if row.get("run_id") not in (None, run_id):
            raise StoreError(
                f"steps[{i}].run_id is {row['run_id']!r} but the run is {run_id!r}"
            )
        if row.get("step") is None:
            raise StoreError(f"steps[{i}] has no 'step' number")
        row["run_id"] = run_id
        if row.get("k_drafted") == 0:
            for name in _DRAFT_STATS:
                value = row.get(name)
                if isinstance(value, float) and math.isnan(value):
                    row[name] = None
        out.append(row)
    seen: set[Any] = set()
    for i, row in enumerate(out):
        if row["step"] in seen:
            raise StoreError(f"steps[{i}].step {row['step']!r} is repeated in run {run_id}")
        seen.add(row["step"])
    return out
