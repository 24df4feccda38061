"""store/: traces, costs and controllers tables, the runs.source/sweep columns and the
schema-2 migration; locked and read-only files refuse these writes in one line."""

from __future__ import annotations

import datetime as dt
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store import Holder, hold, make_run, make_steps, records  # noqa: F401 (hold: fixture)

from store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError, pending_staged


def make_trace(**over: Any) -> dict[str, Any]:
    trace: dict[str, Any] = {
        "target": "t", "draft": "d", "target_tier": "fp16", "draft_tier": "nf4", "device": "cpu",
        "prompt": "Hello", "task": "chat", "chat": True, "max_new_tokens": 8, "k_max": 3,
        "prompt_ids": [1, 2], "token_ids": [5, 6, 7, 8], "stop_reason": "length",
        "config": {"seed": 0},
    }
    trace.update(over)
    return trace


def make_positions(n: int = 3) -> list[dict[str, Any]]:
    # Deliberately out of order: trace_positions() must sort by position.
    return [{"position": p, "accept_len": p % 4, "draft_ids": [10 + p, 11, 12],
             "entropies": [0.5, 1.0, 0.25], "confidences": [0.75, 0.5, 0.9],
             "accept_prob": None if p == 0 else 0.5 * p, "context_len": 2 + p}
            for p in reversed(range(n))]


def make_costs(buckets: tuple[int, ...] = (512, 128), draft_ms: float = 1.0,
               **key: Any) -> list[dict[str, Any]]:
    base = {"device": "cpu", "target": "t", "draft": "d", "target_tier": "fp16",
            "draft_tier": None}
    base.update(key)
    return [dict(base, ctx_bucket=b, draft_ms=draft_ms, verify_ms=[draft_ms * (k + 2) for k in range(9)],
                 reps=5) for b in buckets]


# ----- traces -------------------------------------------------------------------------------
def test_traced_acceptance_counts_the_positions_a_proposer_could_draft_at() -> None:
    from engine.decode.policies.rakv import PRIORS
    from engine.service.costs.tables import ALPHA_MIN_STEPS, acceptance_priors

    def rows(proposer: str, kept: list[int], lookahead: list[int | None]) -> list[dict[str, Any]]:
        return [{"position": p + 1, "accept_len": a, "draft_ids": [9] * a, "proposer": proposer, "lookahead": la}
                for p, (a, la) in enumerate(zip(kept, lookahead))]

    eagle = rows("eagle", [1, 0, 0, 0], [None] * 4)  # a model: every position, 1 of 4 first tokens kept
    ngram = rows("ngram", [2, 0, 1, 0], [3, 0, 2, 0])  # a lookup: only where it had a match (2 of 2)
    key = ("cpu", "t", "d", "fp16")
    with Store(":memory:") as st:
        assert st.traced_first_token_acceptance(*key, proposer="eagle") == (0, 0)
        st.add_trace(make_trace(), eagle + ngram)
        st.add_trace(make_trace(trace_id="other-tier", target_tier="bf16"), rows("eagle", [1] * 4, [None] * 4))
        assert st.traced_first_token_acceptance(*key, proposer="eagle") == (1, 4)
        assert st.traced_first_token_acceptance(*key, proposer="ngram") == (2, 2)
        assert st.traced_first_token_acceptance(*key, kv_tier="int8", proposer="eagle") == (0, 0)  # traced at native
        # rakv's priors count them beside the live runs' drafting steps, padded as those are.
        got = acceptance_priors(st, (*key, None, "native"), ("eagle", "ngram", "suffix"))
        assert got["eagle"] == pytest.approx((1 + (ALPHA_MIN_STEPS - 4) * PRIORS["eagle"]) / ALPHA_MIN_STEPS)
        assert got["ngram"] == pytest.approx((2 + (ALPHA_MIN_STEPS - 2) * PRIORS["ngram"]) / ALPHA_MIN_STEPS)
        assert "suffix" not in got  # never traced, never run: rakv's default stands


def test_trace_round_trip_and_ordering() -> None:
    with Store(":memory:") as st:
        first = st.add_trace(make_trace(), make_positions(3))
        second = st.add_trace(make_trace(trace_id="mine", task="code",
                                         created_at=dt.datetime(2020, 1, 1)), make_positions(2))
        assert len(first) == 32 and second == "mine"
        traces = st.traces()
        assert traces["trace_id"].tolist() == ["mine", first]  # oldest first
        row = records(st.traces(trace_id=first))[0]
        want = make_trace()
        assert json.loads(row.pop("config")) == want.pop("config")
        assert {k: row[k] for k in want} == want
        assert str(traces["k_max"].dtype) == "Int32" and str(traces["chat"].dtype) == "boolean"
        assert st.traces(task="code")["trace_id"].tolist() == ["mine"]

        got = records(st.trace_positions(first))
        want_pos = sorted(make_positions(3), key=lambda p: p["position"])
        assert got == [dict(p, trace_id=first, proposer="draft", lookahead=None, tree_ids=None, tree_parents=None)
                       for p in want_pos]  # migration 9's defaults; no tree held (13)
        everything = st.trace_positions()
        assert list(zip(everything["trace_id"], everything["position"])) == [
            ("mine", 0), ("mine", 1), (first, 0), (first, 1), (first, 2)]
        with pytest.raises(StoreError, match="unknown column 'tsk'"):
            st.traces(tsk="code")


@pytest.mark.parametrize(("trace", "positions", "pattern"), [
    ({"colour": 1}, [], "unknown key 'colour'"),
    ({}, [{"position": 0}, {"position": 0}], "repeated"),
    ({}, [{"accept_len": 1}], "no 'position'"),
    ({}, [{"position": 0, "trace_id": "other"}], "other"),
    ({}, [{"position": 0, "accept_len": 1.5}], r"positions\[0\]\.accept_len"),
    ({"config": "{bad"}, [], "trace.config .*not valid JSON"),
])
def test_bad_trace_raises_one_line_and_stores_nothing(trace: dict[str, Any], positions: list[Any],
                                                      pattern: str) -> None:
    with Store(":memory:") as st:
        with pytest.raises(StoreError, match=pattern) as info:
            st.add_trace(trace, positions)
        assert "\n" not in str(info.value)
        assert st.traces().empty and st.trace_positions().empty


def test_duplicate_trace_id_rolls_back_its_positions() -> None:
    with Store(":memory:") as st:
        st.add_trace(make_trace(trace_id="x"), make_positions(2))
        with pytest.raises(StoreError, match="trace x not stored"):
            st.add_trace(make_trace(trace_id="x"), make_positions(5))
        assert len(st.traces()) == 1 and len(st.trace_positions("x")) == 2


def test_version_5_traces_and_costs_read_as_native_kv_tier(tmp_path: Path) -> None:
    """Migration 6: traces and cost tables made before KV tiers were made at the native tier;
    new rows without one are native too, and a KV tier keys a cost table of its own."""
    path = tmp_path / "v5.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE meta (schema_version INTEGER NOT NULL)")
    for sql in MIGRATIONS[:5]:
        con.execute(sql)
    con.execute("INSERT INTO meta VALUES (5)")
    con.execute("INSERT INTO traces (trace_id, target, target_tier, prompt) VALUES ('old', 't', 'fp32', 'p')")
    con.execute("INSERT INTO costs (cost_id, device, target, draft, target_tier, ctx_bucket, draft_ms, verify_ms)"
                " VALUES ('c-old', 'cpu', 't', 'd', 'fp16', 64, 1.0, [1, 2, 3, 4, 5, 6, 7, 8, 9])")
    con.close()
    with Store(path) as st:
        assert st.traces()["kv_tier"].tolist() == ["native"]
        assert st.costs()["kv_tier"].tolist() == ["native"]
        st.add_trace(make_trace(trace_id="new"), make_positions(1))
        st.add_trace(make_trace(trace_id="fp8", kv_tier="fp8"), make_positions(1))
        assert st.traces(kv_tier="native")["trace_id"].tolist() == ["old", "new"]
        assert st.traces(kv_tier="fp8")["trace_id"].tolist() == ["fp8"]
        int8 = st.add_costs(make_costs((64,), draft_ms=2.0, kv_tier="int8"))
        assert st.costs(kv_tier="native")["cost_id"].tolist() == ["c-old"]  # not replaced by int8's
        assert st.costs(kv_tier="int8")["cost_id"].tolist() == [int8]
        with pytest.raises(StoreError, match="different"):
            st.add_costs(make_costs((64,)) + make_costs((128,), kv_tier="fp8"))


# ----- costs --------------------------------------------------------------------------------
def test_costs_returns_only_the_latest_batch_per_key(tmp_path: Path) -> None:
    path = tmp_path / "c.duckdb"
    with Store(path) as st:
        old = st.add_costs(make_costs(draft_ms=1.0))
        new = st.add_costs(make_costs(draft_ms=2.0))
        gpu = st.add_costs(make_costs((64,), draft_ms=3.0, device="cuda"))
        # Inserted last but measured earlier: "latest" is by created_at, not insertion.
        st.add_costs([dict(r, created_at=dt.datetime(2000, 1, 1)) for r in make_costs(draft_ms=9.0)])
        assert len({old, new, gpu}) == 3

        df = st.costs()  # ordered by key (device first), then ctx_bucket
        assert df["cost_id"].tolist() == [new, new, gpu]
        assert df["ctx_bucket"].tolist() == [128, 512, 64]
    with Store(path) as st:
        cpu = st.costs(device="cpu")
        assert cpu["cost_id"].tolist() == [new, new] and cpu["ctx_bucket"].tolist() == [128, 512]
        assert cpu["draft_ms"].tolist() == [2.0, 2.0]
        assert list(cpu.iloc[0]["verify_ms"]) == [2.0 * (k + 2) for k in range(9)]
        assert str(cpu["reps"].dtype) == "Int32" and cpu["draft_tier"].isna().all()
        assert st.costs(device="cuda", target="t")["draft_ms"].tolist() == [3.0]
        assert st.costs(draft_tier="int8").empty
    con = duckdb.connect(str(path), read_only=True)
    try:  # older batches are kept, just not returned
        assert con.execute("SELECT count(DISTINCT cost_id) FROM costs").fetchone() == (4,)
    finally:
        con.close()


def test_costs_are_ordered_by_key_not_insertion() -> None:
    with Store(":memory:") as st:
        a = st.add_costs(make_costs((256,), device="cuda"))
        b = st.add_costs(make_costs((256,), device="cpu"))
        assert st.costs()["cost_id"].tolist() == [b, a]  # ordered by key, then ctx_bucket


@pytest.mark.parametrize(("rows", "pattern"), [
    ([], "at least one row"),
    (make_costs((1, 1)), "repeated"),
    ([{"device": "cpu", "draft_ms": 1.0}], "no 'ctx_bucket'"),
    (make_costs((1,)) + make_costs((2,), device="cuda"), "different"),
    ([dict(r, cost_id=f"c{i}") for i, r in enumerate(make_costs())], "different cost_ids"),
    ([dict(r, verify_ms=["fast"]) for r in make_costs()], r"verify_ms"),
])
def test_bad_costs_raise_one_line(rows: list[Any], pattern: str) -> None:
    with Store(":memory:") as st:
        with pytest.raises(StoreError, match=pattern) as info:
            st.add_costs(rows)
        assert "\n" not in str(info.value) and st.costs().empty


# ----- controllers --------------------------------------------------------------------------
def params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((4, 3)).astype(np.float32), "b1": np.arange(3, dtype=np.int64),
            "mask": np.array([True, False])}


def assert_params_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        np.testing.assert_array_equal(got[name], value)


def test_controller_versions_and_activation() -> None:
    with Store(":memory:") as st:
        with pytest.raises(StoreError, match=r"no controller 'speckv' in :memory:; run `python -m engine"
                                             r" retrain` first"):
            st.controller("speckv")
        assert st.add_controller("speckv", params(1), {"v": 1}, "test") == 1
        assert st.add_controller("speckv", params(2), {"v": 2}, "test") == 2
        assert st.add_controller("speckv", params(3), {"v": 3}, "test", activate=False) == 3
        assert st.add_controller("speckv-rf", params(9), {"v": 9}, "other") == 1

        got, meta = st.controller("speckv")  # the active one, not the latest
        assert meta == {"v": 2}
        assert_params_equal(got, params(2))
        assert st.controller("speckv", 3)[1] == {"v": 3} and st.controller("speckv", 1)[1] == {"v": 1}
        with pytest.raises(StoreError, match=r"version 7 .*\(versions: 1, 2, 3\)"):
            st.controller("speckv", 7)

        listing = st.controllers()
        assert list(listing.columns) == ["name", "version", "created_at", "source", "active", "meta"]
        assert list(zip(listing["name"], listing["version"], listing["active"])) == [
            ("speckv", 1, False), ("speckv", 2, True), ("speckv", 3, False), ("speckv-rf", 1, True)]
        assert json.loads(listing["meta"].iloc[3]) == {"v": 9}

        st.add_controller("speckv", params(4), {"v": 4}, "test")
        assert st.controllers()["active"].tolist() == [False, False, False, True, True]
        assert st.controller("speckv")[1] == {"v": 4}


def test_controller_without_active_version_gives_the_latest() -> None:
    with Store(":memory:") as st:
        st.add_controller("c", params(1), {"v": 1}, "s", activate=False)
        st.add_controller("c", params(2), {"v": 2}, "s", activate=False)
        assert st.controller("c")[1] == {"v": 2}
        assert not st.controllers()["active"].any()


def test_controller_params_are_npz_and_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "c.duckdb"
    with Store(path) as st:
        st.add_controller("c", params(5), {"features": ["entropy"]}, "s")
        with pytest.raises(StoreError, match="without pickle") as info:
            st.add_controller("c", {"bad": np.array([{"a": 1}], dtype=object)}, {}, "s")
        assert "\n" not in str(info.value)
        with pytest.raises(StoreError, match="cannot name an array"):
            st.add_controller("c", {"file": np.zeros(1)}, {}, "s")
        assert st.controllers()["version"].tolist() == [1]
    con = duckdb.connect(str(path))
    try:
        blob = con.execute("SELECT params FROM controllers").fetchone()[0]
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:  # a plain .npz archive
            assert sorted(npz.files) == ["b1", "mask", "w1"]
        # A blob that needs pickle (written by someone else) must be refused, not loaded.
        evil = io.BytesIO()
        np.savez(evil, x=np.array([{"run": "code"}], dtype=object), allow_pickle=True)
        con.execute("INSERT INTO controllers VALUES ('c', 2, now(), 's', ?, '{}', true)",
                    [evil.getvalue()])
        con.execute("UPDATE controllers SET active = false WHERE version = 1")
    finally:
        con.close()
    with Store(path) as st:
        assert_params_equal(st.controller("c", 1)[0], params(5))
        with pytest.raises(StoreError, match="controller 'c' version 2 .*unreadable params") as info:
            st.controller("c")
        assert "\n" not in str(info.value)


# ----- runs.source / runs.sweep and bulk runs ------------------------------------------------
def test_runs_source_defaults_to_speclab_and_filters() -> None:
    with Store(":memory:") as st:
        ours = st.add_run(make_run())
        theirs = st.add_run(make_run(source="speckv", sweep="sw1"))
        assert st.run(ours)["source"] == "speclab" and st.run(ours)["sweep"] is None
        assert st.runs(source="speckv")["run_id"].tolist() == [theirs]
        assert st.runs(sweep="sw1")["run_id"].tolist() == [theirs]
        assert st.runs(sweep=None)["run_id"].tolist() == [ours]


def test_add_runs_is_one_transaction_and_skips_existing() -> None:
    with Store(":memory:") as st:
        st.add_run(make_run(run_id="a"), make_steps(2))
        batch = [(make_run(run_id="b"), make_steps(3)), (make_run(run_id="a"), make_steps(2))]
        with pytest.raises(StoreError, match="not stored"):
            st.add_runs(batch)  # 'a' collides: 'b' must not be stored either
        assert st.runs()["run_id"].tolist() == ["a"] and len(st.steps()) == 2
        assert st.add_runs(batch, skip_existing=True) == ["b"]
        assert sorted(st.runs()["run_id"]) == ["a", "b"] and len(st.steps("b")) == 3
        assert st.add_runs(batch, skip_existing=True) == []


# ----- read-only and locked files ------------------------------------------------------------
WRITES: list[tuple[str, Callable[[Store], Any]]] = [
    ("trace", lambda st: st.add_trace(make_trace(), make_positions(2))),
    ("costs", lambda st: st.add_costs(make_costs())),
    ("controller", lambda st: st.add_controller("c", params(1), {}, "s")),
    ("runs", lambda st: st.add_runs([(make_run(), make_steps(1))])),
]


@pytest.mark.parametrize(("what", "write"), WRITES)
def test_read_only_store_refuses_new_tables(tmp_path: Path, what: str,
                                            write: Callable[[Store], Any]) -> None:
    path = tmp_path / "ro.duckdb"
    Store(path).close()
    with Store(path, read_only=True) as ro:
        with pytest.raises(StoreError, match=f"open read-only; cannot add .*{what}") as info:
            write(ro)
        assert "\n" not in str(info.value)


def test_locked_file_refuses_new_tables_in_one_line(tmp_path: Path,
                                                   hold: Callable[..., Holder]) -> None:  # noqa: F811
    path = tmp_path / "locked.duckdb"
    Store(path).close()
    holder = hold(path)
    with Store(path, wait_s=0.0) as st:
        assert st.staged
        for what, write in WRITES:
            with pytest.raises(StoreError) as info:
                write(st)
            msg = str(info.value)
            assert f"locked by another process (pid {holder.proc.pid})" in msg, what
            assert "retry" in msg and what in msg and "\n" not in msg
    holder.release()
    assert pending_staged(str(path)) == []  # nothing staged silently
    with Store(path) as st:
        assert st.traces().empty and st.costs().empty and st.controllers().empty
        assert st.runs().empty


# ----- migration from schema 1 ---------------------------------------------------------------
def test_version_1_file_migrates_and_keeps_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE meta (schema_version INTEGER NOT NULL)")
    con.execute(MIGRATIONS[0])
    con.execute("INSERT INTO meta VALUES (1)")
    con.execute("INSERT INTO runs (run_id, policy, token_ids) VALUES ('old', 'fixed:4', [1, 2])")
    con.execute("INSERT INTO steps (run_id, step, accepted) VALUES ('old', 0, 0)")
    con.close()
    # A run staged by the old code (no source column) waits in the staging folder.
    staging = Path(f"{path}.staging")
    staging.mkdir()
    pq.write_table(pa.table({"run_id": ["staged"], "policy": ["fixed:2"]}),
                   staging / "staged.run.parquet")

    with Store(path) as st:
        assert st.ingested == ["staged"]
        old = st.run("old")
        assert old["policy"] == "fixed:4" and old["token_ids"] == [1, 2]
        assert old["source"] == "speclab" and old["sweep"] is None
        assert old["reused_tokens"] == 0 and old["prefix_hit"] == "off"  # migration 4: runs before prefix reuse
        assert old["engine"] == "torch" and st.run("staged")["engine"] == "torch"  # migration 12: runs before llama.cpp
        assert st.run("staged")["source"] == "speclab"
        assert records(st.steps("old"))[0]["accepted"] == 0
        assert st.traces().empty and st.costs().empty and st.controllers().empty
        st.add_trace(make_trace(), make_positions(1))
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT schema_version FROM meta").fetchall() == [(SCHEMA_VERSION,)]
        assert SCHEMA_VERSION == 13
        cols = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'costs'").fetchall()]
        assert "step_factor" in cols  # migration 3: calibrated cost tables
        assert {"prefill_ms", "fill_ms"} <= set(cols)  # migration 4: the prefill, cold and from the prefix cache
        assert {"cold_read_ms", "warm_read_ms"} <= set(cols)  # migration 5: the draft's catch-up reads
        assert "kv_tier" in cols  # migration 6: KV tiers
        kv = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'kv_measurements'").fetchall()]
        assert {"device", "target", "target_tier", "kind", "result"} <= set(kv)  # migration 7: KV measurements
        checks = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns "
                                            "WHERE table_name = 'export_checks'").fetchall()]
        assert {"engine", "engine_version", "config", "ran", "reason", "result"} <= set(checks)  # migration 10
    finally:
        con.close()


def test_a_held_back_controller_is_used_only_once_activated() -> None:
    import numpy as np

    params = {"w": np.ones(2)}
    good, worse = {"kind": "mlp", "metrics": {"shortfalls": []}}, {"kind": "mlp", "metrics": {"shortfalls": ["x"]}}
    with Store(":memory:") as st:
        st.add_controller("speckv", params, dict(worse, n=1), "traces", activate=False)
        with pytest.raises(StoreError, match="v1 held back by retraining") as e:
            st.controller("speckv")  # none active, the only one held back: nothing to use
        assert "\n" not in str(e.value)
        st.add_controller("speckv", params, dict(good, n=2), "traces", activate=False)
        st.add_controller("speckv", params, dict(worse, n=3), "traces", activate=False)
        assert st.controller("speckv")[1]["n"] == 2  # the newest not held back
        assert st.controller("speckv", 3)[1]["n"] == 3  # asked by version: given
        st.activate_controller("speckv", 3)
        assert st.controller("speckv")[1]["n"] == 3  # activated by hand: used


def test_export_checks_are_stored_and_read_back_by_engine() -> None:
    with Store(":memory:") as st:
        a = st.add_export_check(dict(engine="vllm", engine_version="0.32.0", device="cpu", config={"policy": "fixed:4"},
                                     ran=False, reason="no vLLM", result={}))
        st.add_export_check(dict(engine="transformers", engine_version="5.24.0", device="cpu", config={}, ran=True,
                                 reason="", result={"realized_speedup": 1.2}))
        rows = st.export_checks(engine="vllm")
        assert list(rows["check_id"]) == [a] and not rows["ran"][0] and rows["reason"][0] == "no vLLM"
        assert json.loads(st.export_checks(engine="transformers")["result"][0]) == {"realized_speedup": 1.2}
        with pytest.raises(StoreError, match="engine"):
            st.add_export_check(dict(engine=None, config={}, ran=True))


def test_kv_measurements_are_stored_and_read_back_by_key() -> None:
    with Store(":memory:") as st:
        a = st.add_kv_measurement(dict(device="cpu", target="t", target_tier="bf16", kind="bench", result={"native_bits": 4.6}))
        st.add_kv_measurement(dict(device="cpu", target="u", target_tier="fp32", kind="bench", result={"native_bits": 5.0}))
        rows = st.kv_measurements(target="t")
        assert list(rows["measurement_id"]) == [a] and json.loads(rows["result"][0]) == {"native_bits": 4.6}
        with pytest.raises(StoreError, match="result"):
            st.add_kv_measurement(dict(device="cpu", target="t", target_tier="bf16", kind="bench", result=object()))
        assert len(st.kv_measurements()) == 2  # the refused row changed nothing


# ----- migration 9: proposers -------------------------------------------------------------------
def test_version_8_file_reads_as_the_draft_models_and_takes_every_proposers_rows(tmp_path: Path) -> None:
    """Migration 9: steps, trace positions and cost rows made before proposers had names were the
    draft model's (a step that drafted nothing names none); afterwards a trace holds a row per
    proposer and position, and a cost table a row per proposer and bucket."""
    from engine.decode.costs import CostTable

    path = tmp_path / "v8.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE meta (schema_version INTEGER NOT NULL)")
    for sql in MIGRATIONS[:8]:
        con.execute(sql)
    con.execute("INSERT INTO meta VALUES (8)")
    con.execute("INSERT INTO runs (run_id, policy) VALUES ('old', 'fixed:2')")
    con.execute("INSERT INTO steps (run_id, step, k_drafted, accepted) VALUES ('old', 0, 0, 0), ('old', 1, 2, 1)")
    con.execute("INSERT INTO traces (trace_id, target, target_tier, prompt) VALUES ('t-old', 't', 'fp32', 'p')")
    con.execute("INSERT INTO trace_positions (trace_id, position, accept_len, draft_ids) VALUES ('t-old', 1, 2, [5, 6])")
    con.execute("INSERT INTO costs (cost_id, device, target, draft, target_tier, ctx_bucket, draft_ms, verify_ms)"
                " VALUES ('c-old', 'cpu', 't', 'd', 'fp16', 64, 1.0, [1, 2, 3, 4, 5, 6, 7, 8, 9])")
    con.close()
    with Store(path) as st:
        assert st.steps("old")["proposer"].tolist() == ["", "draft"]
        old_pos = records(st.trace_positions("t-old"))
        assert [(r["proposer"], r["position"], r["accept_len"], r["lookahead"]) for r in old_pos] == [("draft", 1, 2, None)]
        old_costs = st.costs().to_dict("records")
        assert [r["proposer"] for r in old_costs] == ["draft"]
        table = CostTable.from_rows(old_costs)
        assert table.proposers == ("draft",) and table.step_ms(2, 64) == 2 * 1.0 + 3.0
        with pytest.raises(ValueError, match="no draft costs for proposer 'ngram'"):
            table.step_ms(2, 64, "ngram")
        assert table.step_ms(0, 64, "ngram") == 1.0  # a plain step is no proposer's

        # Rows without a proposer: an imported step that drafted is the draft model's.
        st.add_run(make_run_row(), [dict(step=0, k_drafted=0), dict(step=1, k_drafted=3), dict(step=2, k_drafted=1, proposer="ngram")])
        new_run = st.runs(policy="new")["run_id"].iloc[0]
        assert st.steps(new_run)["proposer"].tolist() == ["", "draft", "ngram"]
        both = [dict(p, proposer=name, lookahead=la) for name, la in (("draft", None), ("ngram", 0))
                for p in make_positions(2)]
        tid = st.add_trace(make_trace(), both)
        got = records(st.trace_positions(tid))
        assert [(r["proposer"], r["position"], r["lookahead"]) for r in got] == [
            ("draft", 0, None), ("draft", 1, None), ("ngram", 0, 0), ("ngram", 1, 0)]
        assert st.trace_proposers() == {"t-old": ("draft",), tid: ("draft", "ngram")}
        with pytest.raises(StoreError, match=r"position 0 \(proposer 'ngram'\) is repeated"):
            st.add_trace(make_trace(), both + [dict(make_positions(1)[0], proposer="ngram")])
        rows = make_costs((64,), kv_tier="native") + [dict(make_costs((64,))[0], proposer="ngram", draft_ms=0.01,
                                                               verify_ms=None)]
        cid = st.add_costs(rows)
        new = CostTable.from_rows([r for r in st.costs().to_dict("records") if r["cost_id"] == cid])
        assert new.proposers == ("draft", "ngram") and new.step_ms(3, 64, "ngram") == pytest.approx(3 * 0.01 + 5.0)
        back = CostTable.from_rows(new.to_rows(5))
        assert back.proposer_costs == new.proposer_costs and back.verify_ms == new.verify_ms


def make_run_row() -> dict[str, Any]:
    return {"policy": "new", "target": "t", "draft": "d", "target_tier": "fp16"}
