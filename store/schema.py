"""Schema as an ordered list of migrations; the SQL text is the single source of truth.

Migration i (0-based) brings a database from schema_version i to i + 1. To change the
schema, append a SQL string; never edit one that has shipped, files in the wild ran it.
"""

from __future__ import annotations

import functools

import duckdb
import pyarrow as pa

from .connection import MEMORY, transaction
from .errors import StoreError

MIGRATIONS: list[str] = [
    # 1: runs and their per-step records.
    """
    CREATE TABLE runs (
        run_id VARCHAR PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        target VARCHAR,
        draft VARCHAR,
        target_tier VARCHAR,
        kv_tier VARCHAR,
        device VARCHAR,
        policy VARCHAR,
        prompt VARCHAR,
        task VARCHAR,
        chat BOOLEAN,
        temperature DOUBLE,
        top_p DOUBLE,
        seed BIGINT,
        max_new_tokens INTEGER,
        output VARCHAR,
        token_ids INTEGER[],
        n_tokens INTEGER,
        n_steps INTEGER,
        tokens_per_s DOUBLE,
        ttft_ms DOUBLE,
        wall_ms DOUBLE,
        tokens_per_step DOUBLE,
        mean_accepted DOUBLE,
        acceptance_rate DOUBLE,
        stop_reason VARCHAR,
        error VARCHAR,
        config JSON
    );
    CREATE TABLE steps (
        run_id VARCHAR NOT NULL,
        step INTEGER NOT NULL,
        position INTEGER,
        k_chosen INTEGER,
        k_drafted INTEGER,
        accepted INTEGER,
        emitted INTEGER,
        token_ids INTEGER[],
        mean_entropy DOUBLE,
        max_entropy DOUBLE,
        mean_confidence DOUBLE,
        min_confidence DOUBLE,
        entropies DOUBLE[],
        confidences DOUBLE[],
        draft_ms DOUBLE,
        verify_ms DOUBLE,
        decide_ms DOUBLE,
        context_len INTEGER,
        reuse INTEGER,
        target_tier VARCHAR,
        kv_tier VARCHAR,
        PRIMARY KEY (run_id, step)
    );
    """,
    # 2: where a run came from, and the tables profiling and learned controllers need.
    # ADD COLUMN ... DEFAULT fills the runs already in the file, so they read 'speclab'.
    """
    ALTER TABLE runs ADD COLUMN source VARCHAR DEFAULT 'speclab';
    ALTER TABLE runs ADD COLUMN sweep VARCHAR;
    CREATE TABLE traces (
        trace_id VARCHAR PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        target VARCHAR,
        draft VARCHAR,
        target_tier VARCHAR,
        draft_tier VARCHAR,
        device VARCHAR,
        prompt VARCHAR,
        task VARCHAR,
        chat BOOLEAN,
        max_new_tokens INTEGER,
        k_max INTEGER,
        prompt_ids INTEGER[],
        token_ids INTEGER[],
        stop_reason VARCHAR,
        config JSON
    );
    CREATE TABLE trace_positions (
        trace_id VARCHAR NOT NULL,
        position INTEGER NOT NULL,
        accept_len INTEGER,
        draft_ids INTEGER[],
        entropies DOUBLE[],
        confidences DOUBLE[],
        accept_prob DOUBLE,
        context_len INTEGER,
        PRIMARY KEY (trace_id, position)
    );
    CREATE TABLE costs (
        cost_id VARCHAR NOT NULL,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        device VARCHAR,
        target VARCHAR,
        draft VARCHAR,
        target_tier VARCHAR,
        draft_tier VARCHAR,
        ctx_bucket INTEGER NOT NULL,
        draft_ms DOUBLE,
        verify_ms DOUBLE[],
        reps INTEGER,
        PRIMARY KEY (cost_id, ctx_bucket)
    );
    CREATE TABLE controllers (
        name VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        source VARCHAR,
        params BLOB,
        meta JSON,
        active BOOLEAN,
        PRIMARY KEY (name, version)
    );
    """,
    # 3: cost tables calibrated against the engine's live steps (engine/costs.py, `calibrate`).
    """
    ALTER TABLE costs ADD COLUMN step_factor DOUBLE[];
    """,
    # 4: cross-request prefix reuse: the prompt positions a run took from the prefix cache and
    # the kind of hit (engine/prefix_cache.py; older runs had none: 0 and 'off'), and the cost
    # table's prefill: ms to read a bucket's tokens cold, ms per position filled from the cache.
    """
    ALTER TABLE runs ADD COLUMN reused_tokens INTEGER DEFAULT 0;
    ALTER TABLE runs ADD COLUMN prefix_hit VARCHAR DEFAULT 'off';
    ALTER TABLE costs ADD COLUMN prefill_ms DOUBLE;
    ALTER TABLE costs ADD COLUMN fill_ms DOUBLE;
    """,
    # 5: the draft's catch-up reads: ms to read a bucket's tokens into an empty cache (a
    # request's first draft), ms per token read after a cache of a bucket's tokens
    # (engine/costs.py; older tables: NULL, not weighed).
    """
    ALTER TABLE costs ADD COLUMN cold_read_ms DOUBLE;
    ALTER TABLE costs ADD COLUMN warm_read_ms DOUBLE;
    """,
    # 6: KV tiers (engine/kv/tiers.py): the tier of the target's KV cache a trace was made at,
    # and a cost table measured at (dequantizing on every read changes what a verify costs);
    # older traces and tables were all made at the native tier.
    """
    ALTER TABLE traces ADD COLUMN kv_tier VARCHAR DEFAULT 'native';
    ALTER TABLE costs ADD COLUMN kv_tier VARCHAR DEFAULT 'native';
    """,
    # 7: KV measurements (`bench kv`, engine/kv/): one row per run of a measurement, its figures
    # as JSON (bits per scalar per tier and predictor, MB/s, restore times by link bandwidth,
    # the W and context sweeps), keyed by what they were measured on; the tuner reads them.
    """
    CREATE TABLE kv_measurements (
        measurement_id VARCHAR NOT NULL PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        device VARCHAR,
        target VARCHAR,
        target_tier VARCHAR,
        kind VARCHAR,
        result JSON
    );
    """,
    # 8: exports of a tuned configuration (engine/export.py): one row per saved export, versioned
    # per name (Store.add_export numbers it in the insert's transaction), with the SpecLab config
    # it came from and the exported text in its format (json, yaml, hf, vllm).
    """
    CREATE TABLE exports (
        export_id VARCHAR NOT NULL PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        name VARCHAR NOT NULL,
        version INTEGER NOT NULL,
        format VARCHAR,
        config JSON,
        content VARCHAR,
        UNIQUE (name, version)
    );
    """,
    # 9: proposers (engine/oracles/__init__.py: the draft model, an EAGLE head, n-gram lookup).
    # A step names the proposer that drafted it ('' when nothing was drafted; the drafting steps
    # stored before were all the draft model's). A trace holds every proposer's proposal at each
    # position, and how far it could see there (lookahead; NULL: a model, unbounded), and a cost
    # table a row per proposer and bucket: the proposer is part of both keys, so the two tables
    # are made anew (a primary key cannot be altered), their rows kept as the draft's.
    """
    ALTER TABLE steps ADD COLUMN proposer VARCHAR DEFAULT '';
    UPDATE steps SET proposer = 'draft' WHERE k_drafted > 0;
    CREATE TABLE trace_positions_9 (
        trace_id VARCHAR NOT NULL,
        position INTEGER NOT NULL,
        accept_len INTEGER,
        draft_ids INTEGER[],
        entropies DOUBLE[],
        confidences DOUBLE[],
        accept_prob DOUBLE,
        context_len INTEGER,
        proposer VARCHAR NOT NULL DEFAULT 'draft',
        lookahead INTEGER,
        PRIMARY KEY (trace_id, proposer, position)
    );
    INSERT INTO trace_positions_9
        SELECT trace_id, position, accept_len, draft_ids, entropies, confidences, accept_prob, context_len,
               'draft', NULL
        FROM trace_positions;
    DROP TABLE trace_positions;
    ALTER TABLE trace_positions_9 RENAME TO trace_positions;
    CREATE TABLE costs_9 (
        cost_id VARCHAR NOT NULL,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        device VARCHAR,
        target VARCHAR,
        draft VARCHAR,
        target_tier VARCHAR,
        draft_tier VARCHAR,
        ctx_bucket INTEGER NOT NULL,
        draft_ms DOUBLE,
        verify_ms DOUBLE[],
        reps INTEGER,
        step_factor DOUBLE[],
        prefill_ms DOUBLE,
        fill_ms DOUBLE,
        cold_read_ms DOUBLE,
        warm_read_ms DOUBLE,
        kv_tier VARCHAR DEFAULT 'native',
        proposer VARCHAR NOT NULL DEFAULT 'draft',
        PRIMARY KEY (cost_id, proposer, ctx_bucket)
    );
    INSERT INTO costs_9
        SELECT cost_id, created_at, device, target, draft, target_tier, draft_tier, ctx_bucket, draft_ms, verify_ms,
               reps, step_factor, prefill_ms, fill_ms, cold_read_ms, warm_read_ms, kv_tier, 'draft'
        FROM costs;
    DROP TABLE costs;
    ALTER TABLE costs_9 RENAME TO costs;
    """,
    # 10: an export run in the engine it names (`bench exports`): one row per engine per run, with
    # the tuned setting it ran (a SpecLab config), whether it ran and why not, and its figures as
    # JSON (tok/s by mode, realized speed-up beside SpecLab's predicted one); the Export page shows
    # the newest per engine for the setting on screen.
    """
    CREATE TABLE export_checks (
        check_id VARCHAR NOT NULL PRIMARY KEY,
        created_at TIMESTAMP DEFAULT CAST(now() AS TIMESTAMP),
        device VARCHAR,
        engine VARCHAR NOT NULL,
        engine_version VARCHAR,
        config JSON,
        ran BOOLEAN,
        reason VARCHAR,
        result JSON
    );
    """,
    # 11: how far a cost table may be off: the widest relative spread (IQR / median) of its timed
    # points, and other processes' CPU (cores on average) while it was measured (NULL: before).
    """
    ALTER TABLE costs ADD COLUMN spread DOUBLE;
    ALTER TABLE costs ADD COLUMN busy DOUBLE;
    """,
    # 12: what ran the target: torch, or llama.cpp on a GGUF (runs before it: torch).
    """
    ALTER TABLE runs ADD COLUMN engine VARCHAR DEFAULT 'torch';
    """,
    # 13: token trees (engine/decode/tree.py): a step that verified a tree keeps its shape, the
    # parent row of each drafted node (empty, or NULL before this version: a chain), and every
    # step the tokens it drafted (a chain's, a tree's nodes in row order; NULL before).
    # A trace's position also holds the draft's token tree grown there (its best-first rows, the
    # tree of any smaller node budget being their first rows: oracles/tree_growth.py), on the
    # draft's rows only; NULL: a trace from before, which replays chain policies only. A cost
    # table's draft rows price a tree: one level of its growth, the verify of a 16-node tree.
    """
    ALTER TABLE steps ADD COLUMN tree_parents INTEGER[];
    ALTER TABLE steps ADD COLUMN draft_ids INTEGER[];
    ALTER TABLE trace_positions ADD COLUMN tree_ids INTEGER[];
    ALTER TABLE trace_positions ADD COLUMN tree_parents INTEGER[];
    ALTER TABLE costs ADD COLUMN tree_level_ms DOUBLE;
    ALTER TABLE costs ADD COLUMN tree_verify_ms DOUBLE;
    """,
]

# Values filled in for a missing key, matching the column DEFAULTs above: inserts go BY
# NAME with every column present, so a SQL DEFAULT alone would never apply.
# A step's proposer defaults to the draft model's where it drafted, '' where not (store/rows.py).
PY_DEFAULTS: dict[str, dict[str, object]] = {"runs": {"source": "speclab", "reused_tokens": 0, "prefix_hit": "off",
                                                       "engine": "torch"},
                                              "traces": {"kv_tier": "native"},
                                              "costs": {"kv_tier": "native", "proposer": "draft"},
                                              "trace_positions": {"proposer": "draft"}}

SCHEMA_VERSION: int = len(MIGRATIONS)

# DuckDB type name -> Arrow type of insert batches and staged Parquet files.
_ARROW_TYPES: dict[str, pa.DataType] = {
    "VARCHAR": pa.string(), "JSON": pa.string(), "BOOLEAN": pa.bool_(), "INTEGER": pa.int32(),
    "BIGINT": pa.int64(), "DOUBLE": pa.float64(), "TIMESTAMP": pa.timestamp("us"),
    "INTEGER[]": pa.list_(pa.int32()), "BIGINT[]": pa.list_(pa.int64()),
    "DOUBLE[]": pa.list_(pa.float64()), "BLOB": pa.binary(),
}


def _version(con: duckdb.DuckDBPyConnection, label: str) -> int:
    """Version recorded in the file (0 without our meta table); refuses a newer one."""
    has_meta = con.execute("SELECT count(*) FROM information_schema.tables"
                           " WHERE table_name = 'meta' AND table_schema = 'main'").fetchone()
    row = con.execute("SELECT max(schema_version) FROM meta").fetchone() if has_meta[0] else None
    current = int(row[0]) if row and row[0] is not None else 0
    if current > SCHEMA_VERSION:
        raise StoreError(f"{label} has schema version {current}, newer than this SpecLab"
                         f" understands ({SCHEMA_VERSION}); upgrade SpecLab to open it")
    return current


def migrate(con: duckdb.DuckDBPyConnection, label: str) -> None:
    """Apply the missing migrations, each in its own transaction.

    Callers sharing a connection hold its lock around this; a transaction conflict with some
    other writer all the same (DuckDB's catalog is optimistic) is retried once.
    """
    for attempt in (1, 2):
        try:
            for version in range(_version(con, label), SCHEMA_VERSION):
                with transaction(con):
                    con.execute("CREATE TABLE IF NOT EXISTS meta (schema_version INTEGER NOT NULL)")
                    con.execute(MIGRATIONS[version])
                    con.execute("DELETE FROM meta")
                    con.execute("INSERT INTO meta VALUES (?)", [version + 1])
            return
        except duckdb.TransactionException:
            if attempt == 2:
                raise


def check_readable(con: duckdb.DuckDBPyConnection, label: str) -> None:
    """A read-only connection cannot migrate, so it needs a file that is already current."""
    current = _version(con, label)
    if current < SCHEMA_VERSION:
        raise StoreError(f"{label} has schema version {current} but {SCHEMA_VERSION} is needed"
                         " and it is open read-only; open it read-write once to migrate it")


@functools.cache
def columns(table: str) -> tuple[tuple[str, str], ...]:
    """(name, duckdb type) of a table at the latest version, in table order: derived by
    migrating an in-memory database, so it works while the file is locked and never drifts."""
    with duckdb.connect(MEMORY) as con:
        migrate(con, MEMORY)
        rows = con.execute("SELECT column_name, data_type FROM information_schema.columns WHERE"
                           " table_name = ? AND table_schema = 'main' ORDER BY ordinal_position",
                           [table]).fetchall()
    if not rows:
        raise KeyError(table)
    return tuple((str(name), str(dtype)) for name, dtype in rows)


def arrow_schema(table: str) -> pa.Schema:
    """Arrow schema of the table, so inserts and Parquet files carry exact types."""
    return pa.schema([(name, _ARROW_TYPES[dtype]) for name, dtype in columns(table)])
