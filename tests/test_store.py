"""store/: round trips, validation, atomicity, and the two-process / bad-file paths.

The lock tests use a real second Python process holding the DuckDB file, because the
behaviour under test is DuckDB's own cross-process file lock.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest

from store import MIGRATIONS, SCHEMA_VERSION, StagedWrite, Store, StoreError, pending_staged

REPO = Path(__file__).resolve().parents[1]


# ----- helpers ---------------------------------------------------------------------------
def make_run(**over: Any) -> dict[str, Any]:
    run: dict[str, Any] = {
        "target": "Qwen/Qwen2.5-0.5B-Instruct", "draft": "tiny-draft", "target_tier": "fp16",
        "kv_tier": "int8", "device": "cpu", "policy": "fixed:4", "prompt": "Hello",
        "task": None, "chat": True, "temperature": 0.7, "top_p": 0.9, "seed": 2**40 + 3,
        "max_new_tokens": 64, "output": "Hi there", "token_ids": [11, 22, 33],
        "n_tokens": 3, "n_steps": 2, "tokens_per_s": 12.5, "ttft_ms": 40.0, "wall_ms": 240.0,
        "mean_accepted": 1.5, "acceptance_rate": None, "error": None,
        "config": {"policy": "fixed:4", "k_max": 8, "stop": ["\n"]},
    }
    run.update(over)
    return run


def make_steps(n: int = 2) -> list[dict[str, Any]]:
    """Shaped like dataclasses.asdict(StepRecord); step 0 drafted nothing."""
    steps = [{
        "step": 0, "position": 5, "k_chosen": 4, "k_drafted": 0, "accepted": 0, "emitted": 1,
        "token_ids": [11], "mean_entropy": None, "max_entropy": float("nan"),
        "mean_confidence": None, "min_confidence": None, "entropies": [], "confidences": [],
        "draft_ms": 0.0, "verify_ms": 7.5, "decide_ms": 0.01, "context_len": 5, "reuse": 0,
        "target_tier": "fp16", "kv_tier": "int8", "proposer": "", "tree_parents": [], "draft_ids": [],
    }]
    for i in range(1, n):
        steps.append({
            "step": i, "position": 5 + i, "k_chosen": 4, "k_drafted": 4, "accepted": 2,
            "emitted": 3, "token_ids": [22, 33, 44 + i], "mean_entropy": 0.5,
            "max_entropy": 1.25, "mean_confidence": 0.75, "min_confidence": 0.25,
            "entropies": [0.25, 0.5, 1.25, 0.0], "confidences": [0.9, 0.75, 0.25, 1.0],
            "draft_ms": 3.5, "verify_ms": 8.0, "decide_ms": 0.02, "context_len": 6 + i,
            "reuse": 5, "target_tier": "fp16", "kv_tier": "int8", "proposer": "draft",
            "tree_parents": [],
            "draft_ids": [22, 33, 50, 51],
        })
    return steps


def plain(value: Any) -> Any:
    """DataFrame cell -> plain Python value, with every flavour of missing as None."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [plain(v) for v in value]
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if isinstance(value, np.generic) else value


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: plain(v) for k, v in row.items()} for row in df.to_dict("records")]


def expected_step(run_id: str, step: dict[str, Any]) -> dict[str, Any]:
    out = {k: plain(v) for k, v in step.items()}
    out["run_id"] = run_id
    return out


def assert_run_equal(stored: dict[str, Any], given: dict[str, Any]) -> None:
    for key, value in given.items():
        if key == "config":
            assert json.loads(stored["config"]) == value
        else:
            assert stored[key] == value, key


def db_bytes(path: Path) -> bytes:
    return path.read_bytes()


# ----- a second process holding the file -------------------------------------------------
HOLDER = r"""
import os, sys, time, duckdb
path, ready, sentinel, hold_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
con = duckdb.connect(path)
con.execute("SELECT 1").fetchall()
open(ready, "w").close()
deadline = time.monotonic() + hold_s
while os.path.exists(sentinel) and time.monotonic() < deadline:
    time.sleep(0.02)
con.close()
"""


class Holder:
    def __init__(self, proc: subprocess.Popen[bytes], sentinel: Path) -> None:
        self.proc, self.sentinel = proc, sentinel

    def release(self) -> None:
        self.sentinel.unlink(missing_ok=True)
        self.proc.wait(timeout=15)
        assert self.proc.returncode == 0, self.proc.stderr.read() if self.proc.stderr else ""


@pytest.fixture
def hold(tmp_path: Path) -> Iterator[Callable[..., Holder]]:
    """Start a process that opens a DuckDB file read-write and keeps it until released."""
    started: list[Holder] = []

    def start(db: Path, hold_s: float = 60.0) -> Holder:
        tag = len(started)
        ready, sentinel = tmp_path / f"ready{tag}", tmp_path / f"sentinel{tag}"
        sentinel.touch()
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(db), str(ready), str(sentinel), str(hold_s)],
            stderr=subprocess.PIPE,
        )
        holder = Holder(proc, sentinel)
        started.append(holder)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"holder died: {proc.stderr.read() if proc.stderr else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError("holder never became ready")
            time.sleep(0.02)
        return holder

    try:
        yield start
    finally:
        for holder in started:
            holder.sentinel.unlink(missing_ok=True)
            try:
                holder.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                holder.proc.kill()
                holder.proc.wait()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A fresh database file with the schema in place, closed again."""
    path = tmp_path / "speclab.duckdb"
    Store(path).close()
    return path


# ----- round trips ------------------------------------------------------------------------
def test_round_trip_run_and_steps_in_memory() -> None:
    with Store(":memory:") as st:
        run, steps = make_run(), make_steps(3)
        steps[2]["tree_parents"] = [0, 1, 0, 3]  # step 2 verified a token tree
        run_id = st.add_run(run, steps)
        assert isinstance(run_id, str) and len(run_id) == 32
        stored = st.run(run_id)
        assert_run_equal(stored, run)
        assert isinstance(stored["created_at"], dt.datetime)
        assert type(stored["seed"]) is int and type(stored["chat"]) is bool
        assert stored["token_ids"] == [11, 22, 33]

        got = records(st.steps(run_id))
        want = [expected_step(run_id, s) for s in steps]
        want[0]["max_entropy"] = None  # NaN stats of an empty draft are stored as NULL
        assert got == want


def test_dataframe_types_and_nulls() -> None:
    with Store(":memory:") as st:
        run_id = st.add_run(make_run(), make_steps(2))
        runs, steps = st.runs(), st.steps()
        assert list(runs.columns)[:2] == ["run_id", "created_at"]
        assert str(runs["seed"].dtype) == "Int64" and str(runs["max_new_tokens"].dtype) == "Int32"
        assert runs["acceptance_rate"].isna().all() and runs["task"].isna().all()
        assert str(steps["step"].dtype) == "Int32" and str(runs["chat"].dtype) == "boolean"
        assert str(steps["k_drafted"].dtype) == "Int32" and steps["verify_ms"].dtype == np.float64
        first = steps.iloc[0]
        for col in ("mean_entropy", "max_entropy", "mean_confidence", "min_confidence"):
            assert pd.isna(first[col]), col
        assert list(first["entropies"]) == [] and list(steps.iloc[1]["token_ids"]) == [22, 33, 45]
        assert st.run(run_id)["run_id"] == run_id


def test_missing_optional_keys_are_null_and_ids_assigned() -> None:
    with Store(":memory:") as st:
        a = st.add_run({"policy": "fixed:2"})
        b = st.add_run({"run_id": "mine", "policy": "fixed:2"}, [{"step": 0}])
        assert a != b and b == "mine"
        row = st.run(a)
        assert row["output"] is None and row["token_ids"] is None and row["config"] is None
        assert records(st.steps("mine"))[0]["k_drafted"] is None


def test_persists_across_reopen_with_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "speclab.duckdb"
    with Store(path) as st:
        run_id = st.add_run(make_run(), make_steps(2))
    with Store(str(path)) as st:
        assert st.path == str(path)
        assert_run_equal(st.run(run_id), make_run())
        assert len(st.steps(run_id)) == 2
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT schema_version FROM meta").fetchall() == [(SCHEMA_VERSION,)]
    finally:
        con.close()
    assert SCHEMA_VERSION == len(MIGRATIONS) and all(isinstance(m, str) for m in MIGRATIONS)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "speclab.duckdb"
    Store(path).close()
    con = duckdb.connect(str(path))
    con.execute("UPDATE meta SET schema_version = ?", [SCHEMA_VERSION + 1])
    con.close()
    with pytest.raises(StoreError, match="newer than this SpecLab"):
        Store(path)


def test_read_only_store(db: Path) -> None:
    with Store(db) as st:
        run_id = st.add_run(make_run())
    with Store(db, read_only=True) as ro:
        assert ro.run(run_id)["policy"] == "fixed:4"
        with pytest.raises(StoreError, match="read-only"):
            ro.add_run(make_run())
    with pytest.raises(StoreError, match="does not exist"):
        Store(db.with_name("nope.duckdb"), read_only=True)


# ----- filters and ordering ---------------------------------------------------------------
def test_runs_filters_and_order() -> None:
    with Store(":memory:") as st:
        t0 = dt.datetime(2024, 1, 1, 12)
        ids = [
            st.add_run(make_run(policy="fixed:4", created_at=t0 + dt.timedelta(minutes=2))),
            st.add_run(make_run(policy="entropy", task="code", created_at=t0)),
            st.add_run(make_run(policy="fixed:4", created_at=t0 + dt.timedelta(minutes=1))),
        ]
        assert st.runs()["run_id"].tolist() == [ids[1], ids[2], ids[0]]
        assert st.runs(policy="fixed:4")["run_id"].tolist() == [ids[2], ids[0]]
        assert st.runs(policy="entropy", task="code")["run_id"].tolist() == [ids[1]]
        assert st.runs(task=None)["run_id"].tolist() == [ids[2], ids[0]]
        assert st.runs(policy="nothing").empty
        st.add_run(make_run(run_id="s"), make_steps(2))
        assert st.steps()["run_id"].tolist()[-2:] == ["s", "s"]
        with pytest.raises(StoreError, match="unknown column 'polcy'"):
            st.runs(polcy="fixed:4")


def test_first_token_acceptance_counts_drafting_steps_of_one_pair() -> None:
    key = ("cpu", "Qwen/Qwen2.5-0.5B-Instruct", "tiny-draft", "fp16")
    steps = make_steps(4)
    steps[2]["accepted"] = 0  # one of three drafting steps lost its first token
    with Store(":memory:") as st:
        assert st.first_token_acceptance(*key) == (0, 0)
        st.add_run(make_run(), steps)
        st.add_run(make_run(target_tier="bf16"), make_steps(3))  # another tier
        st.add_run(make_run(error="boom"), make_steps(3))  # a failed run
        tree = make_steps(3)
        tree[1]["tree_parents"] = [0, 0, 1, 2]  # a token tree's step: no chain's first token, no chain's time
        st.add_run(make_run(), tree[:2])
        assert st.first_token_acceptance(*key) == (2, 3)
        assert st.first_token_acceptance(*key, kv_tier="int8") == (2, 3)  # the runs' KV tier
        assert st.first_token_acceptance(*key, kv_tier="native") == (0, 0)
        assert len(st.step_times(*key, kv_tier="int8")) == 3 and st.step_times(*key, kv_tier="fp8").empty


def test_rakv_priors_pad_few_drafting_steps_with_the_default() -> None:
    from engine.decode.policies.rakv import ALPHA0, PRIORS
    from engine.service.costs.tables import ALPHA_MIN_STEPS, acceptance_priors

    key = ("cpu", "Qwen/Qwen2.5-0.5B-Instruct", "tiny-draft", "fp16", None, "int8")  # COST_KEY's order
    steps = make_steps(4)
    steps[2]["accepted"] = 0  # the draft: 2 of 3 drafting steps kept their first token
    ngram = [dict(s, proposer="ngram", accepted=0) if s["k_drafted"] else s for s in make_steps(3)]  # 0 of 2
    with Store(":memory:") as st:
        assert acceptance_priors(st, key, ("draft", "ngram")) == {}  # nothing measured: rakv's defaults
        st.add_run(make_run(), steps)
        st.add_run(make_run(), ngram)
        got = acceptance_priors(st, key, ("draft", "ngram", "suffix"))
        # Padded to ALPHA_MIN_STEPS steps with the default: a few lost drafts pull the prior down, not to 0.
        assert got["draft"] == pytest.approx((2 + (ALPHA_MIN_STEPS - 3) * ALPHA0) / ALPHA_MIN_STEPS)
        assert got["ngram"] == pytest.approx((ALPHA_MIN_STEPS - 2) * PRIORS["ngram"] / ALPHA_MIN_STEPS)
        assert "suffix" not in got
        st.add_runs([(make_run(), ngram) for _ in range(ALPHA_MIN_STEPS)])  # enough steps: the measured acceptance alone
        assert acceptance_priors(st, key, ("ngram",)) == {"ngram": 0.0}


def test_unknown_run_id() -> None:
    with Store(":memory:") as st, pytest.raises(StoreError, match="no run 'zzz'"):
        st.run("zzz")


# ----- validation and atomicity -----------------------------------------------------------
@pytest.mark.parametrize(
    ("run", "steps", "pattern"),
    [
        ({"policy": "x", "colour": "red"}, [], "unknown key 'colour'"),
        ({"policy": "x"}, [{"step": 0, "k_drafed": 1}], r"steps\[0\].*unknown key 'k_drafed'"),
        ({"policy": "x"}, [{"step": 0}, {"step": "two"}], r"steps\[1\]\.step: cannot store 'two'"),
        ({"policy": "x"}, [{"step": 0, "accepted": 2.5}], r"steps\[0\]\.accepted"),
        ({"policy": "x"}, [{"step": 0, "token_ids": [1, 2.5]}], r"steps\[0\]\.token_ids"),
        ({"policy": "x"}, [{"step": 0, "emitted": True}], r"steps\[0\]\.emitted"),
        ({"policy": "x", "chat": "yes"}, [], r"run\[0\]\.chat"),
        ({"policy": "x"}, [{"step": 1}, {"step": 1}], "repeated"),
        ({"policy": "x"}, [{"position": 3}], "no 'step'"),
        ({"policy": "x", "config": "{not json"}, [], "not valid JSON"),
    ],
)
def test_bad_input_raises_one_line_and_stores_nothing(run: dict[str, Any], steps: list[Any],
                                                      pattern: str) -> None:
    with Store(":memory:") as st:
        keep = st.add_run(make_run(), make_steps(2))
        with pytest.raises(StoreError, match=pattern) as info:
            st.add_run(run, steps)
        assert "\n" not in str(info.value)
        assert st.runs()["run_id"].tolist() == [keep]
        assert len(st.steps()) == 2


def test_database_error_rolls_back_the_whole_run(tmp_path: Path) -> None:
    path = tmp_path / "speclab.duckdb"
    with Store(path) as st:
        keep = st.add_run(make_run(), make_steps(2))
    # An orphan step row makes the *steps* insert fail after the run row went in.
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO steps (run_id, step) VALUES ('victim', 1)")
    con.close()
    with Store(path) as st:
        with pytest.raises(StoreError, match="run victim not stored") as info:
            st.add_run(make_run(run_id="victim"), make_steps(2))
        assert "\n" not in str(info.value)
        assert st.runs()["run_id"].tolist() == [keep]
        with pytest.raises(StoreError, match="not stored"):
            st.add_run(make_run(run_id=keep))  # duplicate run_id
        assert len(st.runs()) == 1 and len(st.steps(keep)) == 2
        assert st.add_run(make_run(), make_steps(1))  # the Store is still usable


# ----- one connection per process ----------------------------------------------------------
def test_two_stores_in_one_process_share_the_file(db: Path) -> None:
    a, b = Store(db), Store(db)
    try:
        ra = a.add_run(make_run(policy="a"))
        rb = b.add_run(make_run(policy="b"), make_steps(1))
        assert set(a.runs()["run_id"]) == set(b.runs()["run_id"]) == {ra, rb}
        assert not a.staged and not b.staged
        a.close()
        assert len(b.steps(rb)) == 1
        with pytest.raises(StoreError, match="closed"):
            a.runs()
    finally:
        a.close()
        b.close()
    # Everything closed: the in-process DuckDB instance is gone, so another config opens.
    duckdb.connect(str(db), read_only=True).close()


def test_four_threads_opening_one_fresh_file_all_store_their_run(tmp_path: Path) -> None:
    # They used to race on creating the schema ("Catalog write-write conflict on create")
    # and the loser then called the file "not a readable DuckDB database".
    path = tmp_path / "fresh.duckdb"
    start, errors = threading.Barrier(4), []

    def work(i: int) -> None:
        start.wait()
        try:
            with Store(path) as st:
                st.add_run(make_run(run_id=f"t{i}"), make_steps(2))
        except Exception as exc:  # noqa: BLE001 (reported by the assert below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    with Store(path) as st:
        assert sorted(st.runs()["run_id"]) == ["t0", "t1", "t2", "t3"] and len(st.steps()) == 8


# ----- unreadable files --------------------------------------------------------------------
def _truncated_db(path: Path) -> None:
    with Store(path) as st:
        st.add_run(make_run(), make_steps(50))
    data = path.read_bytes()
    path.write_bytes(data[:3000])


@pytest.mark.parametrize("kind", ["random", "text", "truncated", "empty"])
@pytest.mark.parametrize("read_only", [False, True])
def test_unreadable_file_is_left_untouched(tmp_path: Path, kind: str, read_only: bool) -> None:
    path = tmp_path / "speclab.duckdb"
    if kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(10_000))
    elif kind == "text":
        path.write_text("run_id,policy\nabc,fixed:4\n")
    elif kind == "truncated":
        _truncated_db(path)
    else:
        path.write_bytes(b"")
    before = db_bytes(path)
    with pytest.raises(StoreError) as info:
        Store(path, read_only=read_only, wait_s=0.2)
    msg = str(info.value)
    assert msg.startswith(f"{path} is not a readable DuckDB database (")
    assert msg.endswith("; it was left untouched") and "\n" not in msg
    assert db_bytes(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speclab.duckdb"]


# ----- another process holds the file --------------------------------------------------------
def test_locked_file_stages_run_then_next_open_ingests_it(db: Path, hold: Callable[..., Holder]) -> None:
    with Store(db) as st:
        earlier = st.add_run(make_run(policy="earlier"))
    holder = hold(db)
    run, steps = make_run(), make_steps(3)

    t0 = time.monotonic()
    st = Store(db, wait_s=0.5)
    try:
        assert time.monotonic() - t0 >= 0.4  # it did wait before giving up
        assert st.staged
        assert f"pid {holder.proc.pid}" in st.message and "\n" not in st.message
        assert "speclab.duckdb.staging/" in st.message
        run_id = st.add_run(run, steps)
        assert "\n" not in st.message and run_id in st.message
        write = st.staged_writes[0]
        assert isinstance(write, StagedWrite) and write.run_id == run_id
        assert write.run_file.exists() and write.steps_file.exists()
        assert write.run_file.parent == Path(f"{db}.staging")
        assert [w.run_id for w in pending_staged(str(db))] == [run_id]
        with pytest.raises(StoreError, match="locked by another process"):
            st.runs()
        with pytest.raises(StoreError, match="bad"):
            st.add_run({"bad": 1})  # validation still applies while staging
    finally:
        st.close()
    assert len(pending_staged(str(db))) == 1

    holder.release()
    with Store(db) as st:
        assert st.ingested == [run_id] and "ingested 1 staged run" in st.message
        assert_run_equal(st.run(run_id), run)
        got = records(st.steps(run_id))
        want = [expected_step(run_id, s) for s in steps]
        want[0]["max_entropy"] = None
        assert got == want
        assert set(st.runs()["run_id"]) == {earlier, run_id}
    assert pending_staged(str(db)) == []
    assert not write.run_file.exists() and not write.steps_file.exists()
    with Store(db) as st:
        assert st.ingested == [] and len(st.runs(run_id=run_id)) == 1


def test_staged_run_already_present_is_not_duplicated(db: Path, hold: Callable[..., Holder]) -> None:
    with Store(db) as st:
        run_id = st.add_run(make_run(), make_steps(2))
    holder = hold(db)
    with Store(db, wait_s=0.0) as st:
        assert st.staged
        st.add_run(make_run(run_id=run_id, output="other"), make_steps(2))
    holder.release()
    with Store(db) as st:
        assert st.ingested == []
        assert len(st.runs()) == 1 and st.run(run_id)["output"] == "Hi there"
        assert len(st.steps(run_id)) == 2
    assert pending_staged(str(db)) == []


def test_staging_mode_reads_once_holder_is_gone(db: Path, hold: Callable[..., Holder]) -> None:
    with Store(db) as st:
        kept = st.add_run(make_run())
    holder = hold(db)
    with Store(db, wait_s=0.0) as st:
        staged_id = st.add_run(make_run())
        holder.release()
        assert st.runs()["run_id"].tolist() == [kept]  # read-only view, staged run pending
    with Store(db) as st:
        assert set(st.runs()["run_id"]) == {kept, staged_id}


def test_lock_released_within_wait_writes_directly(db: Path, hold: Callable[..., Holder]) -> None:
    hold(db, hold_s=1.0)
    t0 = time.monotonic()
    with Store(db, wait_s=15.0) as st:
        assert time.monotonic() - t0 >= 0.5
        assert not st.staged and st.message == ""
        run_id = st.add_run(make_run(), make_steps(2))
        assert len(st.steps(run_id)) == 2
    assert pending_staged(str(db)) == []


def test_read_only_on_locked_file_fails_clearly(db: Path, hold: Callable[..., Holder]) -> None:
    hold(db)
    with pytest.raises(StoreError, match="locked by another process") as info:
        Store(db, read_only=True, wait_s=0.3)
    assert "\n" not in str(info.value)


# ----- dependency rule ------------------------------------------------------------------------
def test_store_does_not_import_torch() -> None:
    code = "import sys, store; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_a_writer_waits_for_this_process_readers_then_stages(db: Path) -> None:
    """A run finishing while another session's page reads the file in this process: it waits
    for the read to end and writes; a read that outlasts its wait makes it stage (never lost)."""
    with Store(db) as st:
        kept = st.add_run(make_run())
    reading, done = threading.Event(), threading.Event()

    def read(seconds: float) -> None:
        with Store(db, read_only=True) as ro:
            reading.set()
            ro.runs()
            time.sleep(seconds)
        done.set()

    t = threading.Thread(target=read, args=(0.3,))
    t.start()
    reading.wait(5)
    with Store(db, wait_s=5.0) as st:  # waits the 0.3 s read out
        assert done.is_set() and not st.staged
        second = st.add_run(make_run())
    t.join()
    reading.clear()
    done.clear()
    t = threading.Thread(target=read, args=(1.0,))
    t.start()
    reading.wait(5)
    with Store(db, wait_s=0.2) as st:  # the read outlasts the wait: staged, with a line saying why
        assert st.staged and "being read in this process" in st.message
        third = st.add_run(make_run())
    t.join()
    with Store(db) as st:
        assert st.ingested == [third] and set(st.runs()["run_id"]) == {kept, second, third}
