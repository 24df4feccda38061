"""Hostile input, each a case: strange prompts on the Live page, SQL-looking values in the Runs
page's filters, config files that are huge, not files or not text, on the tiny pair. Each case is
either kept exactly as typed or refused in one line on the page (no traceback), and the stored data
changes only by the run a kept case stores."""
from __future__ import annotations

import pytest

from apptest import _app, _errors, open_page, press_generate  # noqa: F401 - the fixture app_env comes from conftest
from store import Store

OVER_CONTEXT = "the target's context"

# (case, prompt, None: kept as typed and stored | the refusal's words)
PROMPTS = [
    ("control characters", "a\x00b\x07c \x1b[31mred\x1b[0m\r\n\tend\x7f", None),
    ("right-to-left and emoji", "مرحبا بالعالم 👋🏽 שלום 🇺🇦 \u202eevil\u202c done", None),
    ("100k characters", "x" * 100_000, OVER_CONTEXT),
    ("longer than the context", "word " * 600, OVER_CONTEXT),
]


def _stored(db) -> tuple[list, int]:
    if not db.exists():
        return [], 0
    with Store(db, read_only=True) as st:
        return sorted(st.runs()["run_id"]), len(st.steps())


@pytest.mark.parametrize(("case", "prompt", "refusal"), PROMPTS, ids=[p[0] for p in PROMPTS])
def test_live_prompts_are_kept_exactly_or_refused_in_one_line(app_env, case, prompt, refusal):
    at = _app()
    at.selectbox(key="live_policy").set_value("fixed:4")
    at.number_input(key="live_max_new").set_value(8)
    at.text_area(key="live_prompt").set_value(prompt)
    before = _stored(app_env)
    press_generate(at)
    assert not at.exception, at.exception
    errors = _errors(at)
    runs, steps = _stored(app_env)
    if refusal is None:
        assert not errors, errors
        assert len(runs) == len(before[0]) + 1 and steps > before[1]
        with Store(app_env, read_only=True) as st:
            new = st.run(next(r for r in runs if r not in before[0]))
        assert new["prompt"] == prompt and new["n_tokens"] >= 1  # byte for byte, NULs and marks included
    else:
        assert len(errors) == 1 and "\n" not in errors[0] and refusal in errors[0], errors
        assert (runs, steps) == before  # nothing stored


SQLISH = ["x'; DROP TABLE runs; --", 'a" OR 1=1 --', "%' OR '%'='", "\\'; DELETE FROM steps; --"]


def test_sql_looking_values_in_the_runs_filters_select_only_themselves(app_env, tiny_pair):
    from engine.service.generation import Request, generate

    with Store(app_env) as st:  # runs whose task is SQL-looking text, beside a plain one
        for task in [*SQLISH, "chat"]:
            generate(tiny_pair, Request("Hi", "ar", task=task, max_new_tokens=4), st, context=None)
        before = (len(st.runs()), len(st.steps()))
    at = open_page("views/runs.py")
    assert not at.exception and not _errors(at)
    for task in SQLISH:
        at.multiselect(key="runs_tasks").set_value([task]).run()
        assert not at.exception and not _errors(at)
        shown = at.dataframe[0].value
        assert list(shown["task"]) == [task], (task, shown["task"].tolist())
    assert _stored_counts(app_env) == before  # the tables are whole


def _stored_counts(db) -> tuple[int, int]:
    with Store(db, read_only=True) as st:
        return len(st.runs()), len(st.steps())


@pytest.mark.parametrize("case", ["huge", "not a file", "a device", "binary", "wrong types"])
def test_config_files_that_are_not_configs_are_one_line(case, tmp_path, capsys):
    from engine.cli.main import main

    path = {"huge": tmp_path / "huge.yaml", "not a file": tmp_path, "a device": "/dev/zero",
            "binary": tmp_path / "bin.json", "wrong types": tmp_path / "edited.json"}[case]
    if case == "huge":
        path.write_text("policy: rakv\n" + "# padding\n" * 200_000)
    elif case == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 100)
    elif case == "wrong types":  # an exported config edited by hand
        path.write_text('{"policy": "rakv", "max_new_tokens": "lots", "temperature": [0]}')
    db = tmp_path / "x.duckdb"
    rc = main(["export", "--config", str(path), "--db", str(db)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"config {path}" in err and not db.exists(), err
