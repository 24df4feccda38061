"""SpecLab's DuckDB store: runs and per-step records, traces, cost tables and controllers.
Never imports torch. See docs/architecture.md, "The store"."""

from __future__ import annotations

from .connection import file_stamp
from .errors import StoreError
from .schema import MIGRATIONS, SCHEMA_VERSION
from .staging import StagedWrite
from .staging import pending as pending_staged
from .store import Store

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "StagedWrite", "Store", "StoreError", "file_stamp", "pending_staged"]
