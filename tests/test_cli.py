"""`python -m engine` as a user runs it: real subprocesses, tiny models, one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=180):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _one_line_error(proc):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_generate_json_with_a_tiny_pair(tiny_dirs, tmp_path):
    target, draft = tiny_dirs
    db = tmp_path / "runs.duckdb"
    proc = _cli("generate", "--prompt", "Hello", "--chat", "--target", str(target), "--draft", str(draft),
                "--policy", "heuristic", "--max-new-tokens", "20", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 20 and out["policy"] == "heuristic"
    assert out["steps"][0]["step"] == 0 and sum(s["emitted"] for s in out["steps"]) == 20
    from store import Store

    with Store(db) as st:
        row = st.run(out["run_id"])
    assert row["token_ids"] == out["token_ids"] and row["policy"] == "heuristic"


def test_generate_at_a_kv_tier_records_it(tiny_dirs, tmp_path):
    target, draft = tiny_dirs
    db = tmp_path / "runs.duckdb"
    proc = _cli("generate", "--prompt", "Hello", "--chat", "--target", str(target), "--draft", str(draft),
                "--policy", "fixed:3", "--max-new-tokens", "12", "--kv-tier", "fp8", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert "fp32 · KV fp8 0.1 KiB/token ·" in summary, summary  # 2 layers × 2 heads × (8 + 1) × 2 = 72 bytes
    proc = _cli("generate", "--prompt", "Hello", "--chat", "--target", str(target), "--draft", str(draft),
                "--max-new-tokens", "12", "--kv-tier", "int8", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["kv_tier"], out["kv_bytes_per_token"]) == ("int8", 80)
    assert {s["kv_tier"] for s in out["steps"]} == {"int8"}
    from store import Store

    with Store(db) as st:
        runs = st.runs()
        assert sorted(runs["kv_tier"]) == ["fp8", "int8"]
        assert set(st.steps(out["run_id"])["kv_tier"]) == {"int8"}


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", "x", "--kv-tier", "fp4"], "unknown KV tier 'fp4'; known: native, fp8, int8"),
    (["trace", "--kv-tiers", "native,fp9"], "unknown KV tier(s) fp9; known: native, fp8, int8"),
    (["profile", "--kv-tiers", ""], "unknown KV tier(s) (none)"),
    (["whatif", "--kv-tiers", "zip", "--db", ":memory:"], "unknown KV tier(s) zip"),
    (["costs", "--kv-tiers", "int4"], "unknown KV tier(s) int4"),
    (["generate", "--prompt", "x", "--policy", "fixed:99"], "0 ≤ k ≤ 8"),
    (["generate", "--prompt", "x", "--target-tier", "q3"], "invalid choice"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["generate"], "required: --prompt"),
    (["nonsense"], "invalid choice"),
    (["bench", "nope"], "unknown benchmark"),
    (["divergence", "--tiers", "fp32,q9"], "unknown tier"),
])
def test_bad_arguments_give_one_line(args, needle, capsys):
    """In process (the same `main` the subprocess runs), so the table stays cheap."""
    from engine.cli.main import main

    rc = main(args + ["--db", ""] if args[0] == "generate" else args)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_unknown_model_gives_one_line(tmp_path):
    line = _one_line_error(_cli("generate", "--prompt", "x", "--target", str(tmp_path / "nope"), "--db", ""))
    assert "cannot load model" in line


def test_corrupt_database_is_refused_before_generating_and_left_untouched(tiny_dirs, tmp_path):
    db = tmp_path / "bad.duckdb"
    db.write_bytes(b"this is not a database" * 100)
    before = db.read_bytes()
    target, draft = tiny_dirs
    line = _one_line_error(_cli("generate", "--prompt", "x", "--target", str(target), "--draft", str(draft),
                                "--db", str(db)))
    assert "not a readable DuckDB database" in line
    assert db.read_bytes() == before
