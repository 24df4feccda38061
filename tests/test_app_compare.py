"""The Compare page, driven headless with AppTest on the tiny test models."""
from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from apptest import _errors, open_page, page_links
from store import Store


def _compare() -> AppTest:
    return open_page("views/compare.py")


def test_renders_on_an_empty_db(app_env):
    at = _compare()
    assert not at.exception and not _errors(at)
    assert at.title[0].value == "Compare"
    assert at.multiselect(key="compare_policies").value == ["ar", "fixed:4", "rakv"]
    assert at.number_input(key="compare_max_new").value == 48
    assert at.text_area(key="compare_prompts").value.count("\n") == 0  # one prompt
    # The what-if tab without traces leads to the Profile page, not to a command line.
    assert "No acceptance traces" in at.info[0].value and "python -m" not in at.info[0].value
    assert any(link.startswith("Profile") for link in page_links(at)), page_links(at)
    assert not app_env.exists()  # looking stores nothing


def test_two_greedy_policies_side_by_side_and_stored(app_env):
    at = _compare()
    at.multiselect(key="compare_policies").set_value(["ar", "fixed:2"])
    at.number_input(key="compare_max_new").set_value(12)
    at.button(key="compare_run").click().run()
    assert not at.exception and not _errors(at), _errors(at)

    table = at.dataframe[0].value
    assert len(table) == 2 and list(table["policy"]) == ["ar", "fixed:2"]
    assert (table["tokens_per_s"] > 0).all() and table["acceptance_rate"].isna().tolist() == [True, False]
    assert list(table["proposers"]) == ["—", "draft 100%"]  # the proposer mix: who drafted the drafting steps
    assert len(at.get("vega_lite_chart")) == 1  # the γ timelines
    assert any("identical" in s.value for s in at.success), [s.value for s in at.success]
    assert any(s.value.startswith("Stored 2 runs") for s in at.success)

    with Store(app_env, read_only=True) as s:
        runs = s.runs()
    assert sorted(runs["policy"]) == ["ar", "fixed:2"] and set(runs["max_new_tokens"]) == {12}
    labels = {json.loads(c)["compare"] for c in runs["config"]}
    assert len(labels) == 1 and labels.pop().startswith("compare-")
    assert runs["output"].nunique() == 1  # greedy: the same output, token for token
    assert list(runs["token_ids"].iloc[0]) == list(runs["token_ids"].iloc[1])

    at.run()  # a rerun keeps showing the result
    assert not at.exception and len(at.dataframe[0].value) == 2


def test_proposer_forms_are_offered_and_their_mix_shown(app_env):
    at = _compare()
    assert {"fixed:4@ngram", "rakv@draft", "rakv@ngram"} <= set(at.multiselect(key="compare_policies").options)
    at.text_area(key="compare_prompts").set_value("abc abc abc abc abc")
    at.multiselect(key="compare_policies").set_value(["fixed:2", "fixed:4@ngram"])
    at.number_input(key="compare_max_new").set_value(12)
    at.button(key="compare_run").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    mix = dict(zip(at.dataframe[0].value["policy"], at.dataframe[0].value["proposers"]))
    assert mix["fixed:2"] == "draft 100%" and mix["fixed:4@ngram"] in ("ngram 100%", "—")
    assert any("identical" in s.value for s in at.success)  # greedy: the n-gram drafts change nothing


def test_one_policy_is_a_one_line_error(app_env):
    at = _compare()
    at.multiselect(key="compare_policies").set_value(["ar"])
    at.button(key="compare_run").click().run()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0] and "2 to 4" in errors[0], errors
    assert not at.dataframe and not app_env.exists()  # nothing ran, nothing stored


def test_whatif_replays_the_stored_traces(app_env, tiny_pair):
    from engine.lab.profiling import measure_costs, trace

    with Store(app_env) as s:
        s.add_costs(measure_costs(tiny_pair, buckets=(8,), reps=2).to_rows(2))
        for task, prompt in [("code", "def f(x):"), ("chat", "Hi there")]:
            t = trace(tiny_pair, prompt, task, 12)
            s.add_trace(t.row, t.positions)
    at = _compare()
    assert not at.exception and not _errors(at) and not at.info
    at.multiselect(key="compare_whatif_policies").set_value(["ar", "fixed:2", "fixed:4"])
    at.button(key="compare_whatif_run").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    table = at.dataframe[0].value
    assert list(table.columns) == ["ar", "fixed:2", "fixed:4"]
    assert {task for _, task in table.index} == {"all", "chat", "code"}
    assert (table.to_numpy() > 0).all()
    assert len(at.get("vega_lite_chart")) == 1


def test_corrupt_db_is_one_line_and_left_untouched(app_env):
    garbage = b"not a duckdb file\x00\x01" * 64
    app_env.write_bytes(garbage)
    at = _compare()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert app_env.read_bytes() == garbage


def test_sampling_with_one_seed_shows_where_outputs_differ(app_env):
    at = _compare()
    at.multiselect(key="compare_policies").set_value(["ar", "fixed:4", "fixed:1"])
    at.number_input(key="compare_max_new").set_value(16)
    at.number_input(key="compare_temperature").set_value(1.0)
    at.number_input(key="compare_seed").set_value(7)
    at.button(key="compare_run").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    assert len(at.dataframe[0].value) == 3
    assert any("sampling · seed 7" in c.value for c in at.caption)
    said = [s.value for s in at.success if "identical" in s.value] + [i.value for i in at.info if "differ" in i.value]
    assert len(said) == 1, said
    if "differ" in said[0]:  # each policy against the first: where it parts, how many tokens differ
        versus = at.dataframe[1].value
        assert list(versus["policy"]) == ["ar", "fixed:4", "fixed:1"] and versus["differing"].iloc[0] == 0
    with Store(app_env, read_only=True) as s:
        assert set(s.runs()["seed"]) == {7}
