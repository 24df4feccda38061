"""The Runs page, driven headless with AppTest on the tiny test models."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from apptest import _errors, open_page, page_links
from store import Store


def _runs_page() -> AppTest:
    return open_page("views/runs.py")


def test_no_database_is_an_empty_state(app_env):
    at = _runs_page()
    assert not at.exception and not _errors(at)
    assert at.title[0].value == "Runs"
    assert "No database" in at.info[0].value
    links = page_links(at)
    assert any(p.startswith("Live decode") for p in links) and any(p.startswith("Profile") for p in links), links
    assert not app_env.exists()  # reading never creates the file


def test_stored_runs_are_filtered_plotted_and_downloadable(app_env, tiny_pair):
    from engine.service.generation import Request, generate

    with Store(app_env) as s:
        for task, prompt in [("code", "def f(x):"), ("chat", "Hi there")]:
            for pol in ("ar", "fixed:2", "fixed:4"):
                generate(tiny_pair, Request(prompt, pol, task=task, max_new_tokens=12), s, context=None)
    at = _runs_page()
    assert not at.exception and not _errors(at), _errors(at)
    assert [t.label for t in at.tabs] == ["Runs", "Acceptance", "Best γ", "Tokens/s by policy"]
    assert not at.get("vega_lite_chart")  # the runs tab opens first: no figure is made for the others
    assert len(at.dataframe) == 1 and len(at.dataframe[0].value) == 6
    labels = [b.proto.label for b in at.get("download_button")]
    assert labels == ["Runs (CSV)", "Runs (Parquet)", "Steps (CSV)", "Steps (Parquet)"]
    assert any("6 of 6 runs" in c.value for c in at.caption)

    def open_tab(label: str) -> None:
        at.session_state["runs_tab"] = label
        at.run()
        assert not at.exception and not _errors(at), _errors(at)
        assert bool(at.get("download_button")) == (label == "Runs")  # only the open tab is drawn

    open_tab("Acceptance")  # acceptance against the draft's signals
    assert len(at.get("vega_lite_chart")) == 1 and any("drafting steps" in c.value for c in at.caption)
    open_tab("Best γ")  # the heatmap and its table
    assert len(at.get("vega_lite_chart")) == 1
    best = at.dataframe[0].value
    assert sorted(best["task"]) == ["chat", "code"] and set(best["best_gamma"]) <= {0, 2, 4}
    assert set(best["gammas"]) == {3}
    open_tab("Tokens/s by policy")
    assert len(at.get("vega_lite_chart")) == 1
    assert sorted(at.dataframe[0].value["policy"]) == ["ar", "fixed:2", "fixed:4"]

    # A filter narrows every view.
    at.multiselect(key="runs_policies").set_value(["fixed:2"]).run()
    assert not at.exception and not _errors(at)
    assert any("2 of 6 runs" in c.value for c in at.caption)
    assert list(at.dataframe[0].value["policy"]) == ["fixed:2"]
    open_tab("Runs")
    assert list(at.dataframe[0].value["policy"]) == ["fixed:2", "fixed:2"]
    at.multiselect(key="runs_policies").set_value(["ar"]).run()  # ar drafts nothing: no acceptance points
    open_tab("Acceptance")
    assert any("No drafting steps" in c.value for c in at.caption)


def test_corrupt_db_is_one_line_and_left_untouched(app_env):
    garbage = b"\x00garbage, not DuckDB\xff" * 100
    app_env.write_bytes(garbage)
    at = _runs_page()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert app_env.read_bytes() == garbage
    assert not at.get("download_button")
