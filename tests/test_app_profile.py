"""The Profile page, driven headless with AppTest on the tiny test models: one click starts a
sweep in the background, its table shows once it ends, a second start is refused in one line."""
from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from apptest import APP, _errors  # noqa: F401 - the fixture app_env comes from conftest
from engine.lab.decode_lock import decode_slot
from engine.service.sweeps.jobs import RUNNER
from store import Store


@pytest.fixture(autouse=True)
def _no_sweep_left():
    """The runner is process-wide: no test may leave a sweep running for the next."""
    RUNNER.wait(300)
    yield
    RUNNER.stop()
    RUNNER.wait(300)


def _page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=120)
    return at.switch_page("views/profile.py").run()


def test_profile_page_renders_with_one_click_defaults(app_env):
    at = _page()
    assert not at.exception and not _errors(at)
    assert at.title[0].value == "Profile"
    assert at.text_input(key="profile_name").value.startswith("ui-")
    assert at.multiselect(key="profile_tiers").value == ["fp32"]
    assert at.multiselect(key="profile_kv_tiers").value == ["native"]
    assert at.multiselect(key="profile_policies").value == ["ar", "fixed:1", "fixed:2", "fixed:4", "rakv"]
    assert at.number_input(key="profile_max_new").value == 32
    assert at.number_input(key="profile_per_task").value == 1
    assert at.checkbox(key="profile_trace").value is True
    assert not at.get("progress")  # nothing runs yet


def test_start_runs_the_default_sweep_in_the_background_and_shows_its_table(app_env):
    at = _page()
    at.text_input(key="profile_name").set_value("ui-test")
    at.button(key="profile_start").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    end = RUNNER.wait(300)
    assert end.name == "ui-test" and end.state == "finished", end.error
    at.run()
    assert not at.exception and not _errors(at), _errors(at)
    assert not at.get("progress")
    assert "Sweep ui-test" in at.success[0].value
    table = at.dataframe[0].value
    assert set(table["policy"]) == {"ar", "fixed:1", "fixed:2", "fixed:4", "rakv"}
    assert list(table["setting"].unique()) == ["fp32"]
    with Store(app_env, read_only=True) as s:
        assert len(s.runs(sweep="ui-test")) == 4 * 5  # heldout: one prompt per task, four tasks
        assert len(s.traces()) == 4  # traced too, for replay and retrain


def test_a_second_start_while_one_runs_is_one_line(app_env):
    at = _page()
    at.text_input(key="profile_name").set_value("ui-busy")
    at.multiselect(key="profile_policies").set_value(["ar"])
    at.checkbox(key="profile_trace").set_value(False)
    with decode_slot("test"):  # the sweep waits for the slot, so it is surely running
        at.button(key="profile_start").click().run()
        assert not at.exception and not _errors(at), _errors(at)
        bar = at.get("progress")
        assert len(bar) == 1 and "0/4 runs" in bar[0].proto.text
        at.button(key="profile_start").click().run()
        lines = _errors(at) + [w.value for w in at.warning]
        assert lines == ["a sweep (ui-busy, 0/4 done) is already running: wait for it or stop it"]
        at.button(key="profile_stop").click().run()  # pressed while waiting: nothing runs
    end = RUNNER.wait(120)
    assert (end.state, end.ran) == ("stopped", 0)
    at.run()
    assert not at.exception and not _errors(at)
    assert "stopped; start ui-busy again to resume" in at.info[0].value


def test_the_page_shows_this_machines_verify_kernels(app_env):
    from engine.runtime.kernels.probe import ROWS, cpu_name

    at = _page()
    at.toggle(key="profile_kernels").set_value(True).run()
    assert not at.exception and not _errors(at)
    tables = [d.value for d in at.dataframe if "vs_stock" in d.value.columns]
    assert len(tables) == 1, [i.value for i in at.info]
    rows = tables[0]
    assert len(rows) == rows["shape"].nunique() * len(ROWS) and (rows["vs_stock"] <= 1.0).all()
    assert any(c.value.startswith(f"{cpu_name()}, ") for c in at.caption)
