"""engine/datasets/speckv_csv.py: SpecKV's real phase-2 step CSV becomes runs + steps; malformed files
are refused in one line naming file and line, and add nothing."""

from __future__ import annotations

import csv
import hashlib
import json
import time
from pathlib import Path

import pytest

from engine.base.names import DATA_DIR
from engine.datasets.speckv_csv import COLUMNS, import_speckv
from store import Store, StoreError

DATA = DATA_DIR / "speckv-phase2"  # vendored, MIT
STEPS_CSV = DATA / "phase2_step_results.csv"
real = pytest.mark.skipif(not STEPS_CSV.exists(), reason="SpecKV phase-2 data not present")

HEADER = ",".join(COLUMNS)


def write_csv(path: Path, lines: list[str], header: str = HEADER) -> Path:
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def row(comp: str = "fp16", gamma: int = 2, task: str = "code", step: int = 0,
        accepted: int = 1, produced: int | None = None) -> str:
    produced = accepted + 1 if produced is None else produced
    return f"{comp},{gamma},{task},{step},{accepted},{accepted / gamma},{produced},0.5,0.8,1.0,0.4"


GOOD = [row(step=0, accepted=2), row(step=1, accepted=0), row(step=0, accepted=1)]


# ----- the real file ----------------------------------------------------------------------------
@real
def test_real_file_imports_240_runs_and_every_step(tmp_path: Path) -> None:
    with STEPS_CSV.open() as handle:
        csv_rows = list(csv.DictReader(handle))
    sha = hashlib.sha256(STEPS_CSV.read_bytes()).hexdigest()
    db = tmp_path / "speckv.duckdb"
    with Store(db) as st:
        t0 = time.monotonic()
        report = import_speckv(st, STEPS_CSV)
        assert time.monotonic() - t0 < 3.0
        assert (report.runs_added, report.runs_skipped, report.steps) == (240, 0, 5112)
        runs, steps = st.runs(source="speckv"), st.steps()
    assert len(runs) == 240 and len(steps) == 5112 == len(csv_rows)
    assert steps["accepted"].sum() == sum(int(r["accepted"]) for r in csv_rows) == 14262
    assert (steps["emitted"] == steps["accepted"] + 1).all() and (steps["kv_tier"] == "native").all()
    assert steps["entropies"].isna().all() and steps["confidences"].isna().all()
    # 3 tiers x 4 gammas x 4 tasks, 5 prompts each, in file order.
    assert runs.groupby(["target_tier", "policy", "task"]).size().eq(5).all()
    assert runs.groupby(["target_tier", "policy", "task"]).ngroups == 48
    assert runs["run_id"].tolist() == [f"speckv-{sha[:12]}-{i:04d}" for i in range(240)]

    first = runs.iloc[0]
    assert (first["target"], first["draft"]) == ("Llama-3.2-3B-Instruct", "Llama-3.2-1B-Instruct")
    assert (first["policy"], first["target_tier"], first["task"]) == ("fixed:2", "fp16", "code")
    assert first["prompt"] == "speckv code #0" and runs.iloc[4]["prompt"] == "speckv code #4"
    assert bool(first["chat"]) and first["temperature"] == 0.0
    assert json.loads(first["config"]) == {"speckv_file": STEPS_CSV.name, "sha256": sha,
                                           "prompt_index": 0}
    one = steps[steps["run_id"] == first["run_id"]]
    assert one["step"].tolist() == list(range(1, 33))  # CSV step + 1: our step 0 is the prefill
    assert first["n_steps"] == 32 and first["mean_accepted"] == one["accepted"].sum() / 32
    assert first["acceptance_rate"] == one["accepted"].sum() / one["k_drafted"].sum()
    # A run's last draft may be cut short by its token budget; SpecKV's rate is over what was
    # drafted, and the importer recovers that count from it.
    rates = [float(r["acceptance_rate"]) for r in csv_rows]
    drafted = steps["k_drafted"].tolist()
    assert all(abs(a / d - r) < 1e-3 for a, d, r in zip(steps["accepted"], drafted, rates) if a)
    assert (steps["k_drafted"] <= steps["k_chosen"]).all() and (steps["k_drafted"] < steps["k_chosen"]).sum() > 0
    assert first["tokens_per_step"] == one["emitted"].sum() / 32

    # The authors' per-run file lists the same runs in the same order: steps and tokens agree.
    with (DATA / "phase2_experiment_results.csv").open() as handle:
        per_run = list(csv.DictReader(handle))
    assert [int(r["num_steps"]) for r in per_run] == runs["n_steps"].tolist()
    assert [int(r["num_tokens"]) for r in per_run] == runs["n_tokens"].tolist()
    assert [f"fixed:{r['gamma']}" for r in per_run] == runs["policy"].tolist()


@real
def test_reimport_skips_everything(tmp_path: Path) -> None:
    with Store(tmp_path / "speckv.duckdb") as st:
        import_speckv(st, STEPS_CSV)
        again = import_speckv(st, STEPS_CSV)
        assert (again.runs_added, again.runs_skipped, again.steps) == (0, 240, 0)
        assert len(st.runs()) == 240 and len(st.steps()) == 5112


# ----- grouping ---------------------------------------------------------------------------------
def test_runs_split_on_key_change_or_step_restart(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "s.csv", [
        row(step=0), row(step=1), row(step=0),            # code gamma 2: prompts #0, #1
        row(gamma=4, step=0),                             # key change: gamma 4 #0
        row(step=0, task="math"),                         # key change: math #0
        row(step=0),                                      # code gamma 2 again: #2
    ])
    with Store(":memory:") as st:
        report = import_speckv(st, path)
        assert (report.runs_added, report.steps) == (5, 6)
        runs = st.runs()
        assert runs["prompt"].tolist() == ["speckv code #0", "speckv code #1", "speckv code #0",
                                           "speckv math #0", "speckv code #2"]
        assert runs["policy"].tolist() == ["fixed:2", "fixed:2", "fixed:4", "fixed:2", "fixed:2"]
        assert runs["n_steps"].tolist() == [2, 1, 1, 1, 1]
        assert [json.loads(c)["prompt_index"] for c in runs["config"]] == [0, 1, 0, 0, 2]


# ----- malformed files --------------------------------------------------------------------------
BAD = [
    ("missing column", HEADER.replace(",min_draft_confidence", ""), [row()[: row().rindex(",")]],
     r"line 1: .*missing column\(s\) min_draft_confidence"),
    ("extra column", HEADER + ",prompt", [row() + ",hi"], r"line 1: .*unexpected column\(s\) prompt"),
    ("bad number", HEADER, [row(step=0), "fp16,2,code,1,x,0.5,2,0.5,0.8,1.0,0.4"],
     r"line 3: column accepted is not a number \('x'\)"),
    ("accepted > gamma", HEADER, GOOD + [row(gamma=2, step=1, accepted=3)], r"line 5: accepted 3 > gamma 2"),
    ("tokens", HEADER, [row(accepted=1, produced=3)], r"line 2: tokens_produced 3 != accepted \+ 1"),
    ("gamma 0", HEADER, [row(gamma=1).replace("fp16,1,", "fp16,0,")], r"line 2: gamma is 0"),
    ("negative", HEADER, [row(step=0), row(step=-1)], r"line 3: column step is negative"),
    ("nan count", HEADER, ["fp16,2,code,0,nan,0.5,2,0.5,0.8,1.0,0.4"], r"line 2: column accepted is NaN"),
    ("step gap", HEADER, [row(step=0), row(step=2)], r"line 3: step 2 follows step 0"),
    ("no step 0", HEADER, [row(step=3)], r"line 2: a run starts at step 3"),
    ("short row", HEADER, ["fp16,2,code,0"], r"line 2: 4 fields, expected 11"),
    ("header only", HEADER, [], "has a header but no rows"),
]


@pytest.mark.parametrize(("case", "header", "lines", "pattern"), BAD, ids=[b[0] for b in BAD])
def test_malformed_csv_is_refused_and_adds_nothing(tmp_path: Path, case: str, header: str,
                                                   lines: list[str], pattern: str) -> None:
    db = tmp_path / "s.duckdb"
    with Store(db) as st:
        import_speckv(st, write_csv(tmp_path / "good.csv", GOOD))
        before = (st.runs()["run_id"].tolist(), len(st.steps()))
        bad = write_csv(tmp_path / "bad.csv", lines, header)
        with pytest.raises(StoreError, match=pattern) as info:
            import_speckv(st, bad)
        msg = str(info.value)
        assert "\n" not in msg and str(bad) in msg
        assert (st.runs()["run_id"].tolist(), len(st.steps())) == before


@pytest.mark.parametrize(("content", "pattern"), [(None, "does not exist"), ("", "is empty"),
                                                  ("\n\n", "is empty")])
def test_missing_or_empty_file(tmp_path: Path, content: str | None, pattern: str) -> None:
    path = tmp_path / "x.csv"
    if content is not None:
        path.write_text(content)
    with Store(":memory:") as st:
        with pytest.raises(StoreError, match=f"{path} {pattern}"):
            import_speckv(st, path)
        assert st.runs().empty


# ----- the CLI ----------------------------------------------------------------------------------
def test_cli_import_json_then_text_then_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main

    csv_path = write_csv(tmp_path / "s.csv", GOOD)
    db = tmp_path / "cli.duckdb"
    assert main(["import-speckv", str(csv_path), "--db", str(db), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"runs_added": 2, "runs_skipped": 0, "steps": 3, "path": str(csv_path),
                   "db": str(db)}
    assert main(["import-speckv", str(csv_path), "--db", str(db)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"imported 0 runs (0 steps) from {csv_path} into {db}; 2 already there")

    missing = tmp_path / "nope.csv"
    other_db = tmp_path / "other.duckdb"
    assert main(["import-speckv", str(missing), "--db", str(other_db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(missing) in err[0]
    assert not other_db.exists()  # a typo'd path creates no database

    bad = write_csv(tmp_path / "bad.csv", [row(accepted=3)])
    assert main(["import-speckv", str(bad), "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2: accepted 3 > gamma 2" in err[0]
    with Store(db) as st:
        assert len(st.runs(source="speckv")) == 2
