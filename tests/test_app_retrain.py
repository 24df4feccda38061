"""Retraining on the workbench: Store.activate_controller, and the Replay & retrain page's
train → compare with the active version → activate (or not) flow on the tiny test models."""
from __future__ import annotations

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from apptest import _errors, open_page, store_costs_and_traces  # noqa: F401 - the fixture app_env comes from conftest
from store import Store, StoreError


def _active(s: Store) -> dict[str, list[int]]:
    c = s.controllers()
    return {n: sorted(int(v) for v in df.loc[df["active"].fillna(False).astype(bool), "version"])
            for n, df in c.groupby("name")}


def _comparison(at: AppTest):
    """The new-vs-active table (AppTest's dataframes carry no key): the one with a `new:` column."""
    tables = [d.value for d in at.dataframe if any(str(c).startswith("new: ") for c in d.value.columns)]
    assert len(tables) == 1
    return tables[0]


def test_activate_controller_switches_one_name_in_one_step():
    with Store(":memory:") as s:
        params = {"w": np.zeros(2)}
        for _ in range(2):
            s.add_controller("speckv", params, {"kind": "mlp"}, "traces", activate=False)
        s.add_controller("speckv-rf", params, {"kind": "rf"}, "traces", activate=True)
        assert _active(s) == {"speckv": [], "speckv-rf": [1]}
        s.activate_controller("speckv", 1)
        assert _active(s) == {"speckv": [1], "speckv-rf": [1]}  # another name is left alone
        s.activate_controller("speckv", 2)
        assert _active(s) == {"speckv": [2], "speckv-rf": [1]}
        with pytest.raises(StoreError) as err:
            s.activate_controller("speckv", 7)
        assert str(err.value) == "no controller 'speckv' version 7 in :memory: (versions: 1, 2)"
        with pytest.raises(StoreError, match="no controller 'nope' in :memory:; run `python -m engine retrain`"):
            s.activate_controller("nope", 1)
        assert _active(s) == {"speckv": [2], "speckv-rf": [1]}  # a refused switch changes nothing
        assert s.controller("speckv")[1]["kind"] == "mlp"
    with Store(":memory:", read_only=False) as s, pytest.raises(StoreError, match="no controller"):
        s.activate_controller("speckv", 1)


def test_train_compares_with_the_active_version_and_activates_only_when_asked(app_env, tiny_pair):
    store_costs_and_traces(app_env, tiny_pair)
    at = open_page("views/retrain.py")
    assert not at.exception and not _errors(at)
    assert at.radio(key="retrain_source").value == "traces"

    at.radio(key="retrain_source").set_value("runs").run()  # no live runs yet: one line says so
    at.button(key="retrain").click().run()
    errors = _errors(at)
    assert len(errors) == 1 and "no runs runs" in errors[0] and "\n" not in errors[0]

    at.radio(key="retrain_source").set_value("traces").run()
    at.button(key="retrain").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    table = _comparison(at)
    assert list(table.columns) == ["new: speckv v1"]  # nothing active to compare with
    assert {"test correlation", "replay gain vs fixed:4", "replay gain vs the best fixed γ",
            "decision latency (ms, median)"} <= set(table.index)
    assert table.loc["gain measured by", "new: speckv v1"] == "exact replay"
    with Store(app_env, read_only=True) as s:
        assert _active(s) == {"speckv": [], "speckv-rf": []}
    at.button(key="retrain_activate").click().run()
    assert not at.exception and not _errors(at)
    assert at.success[0].value == "speckv v1 is now active (with speckv-rf v1)"
    with Store(app_env, read_only=True) as s:
        assert _active(s) == {"speckv": [1], "speckv-rf": [1]}

    at.button(key="retrain").click().run()  # a second training: beside the active one, left inactive
    assert not at.exception and not _errors(at), _errors(at)
    table = _comparison(at)
    assert list(table.columns) == ["new: speckv v2", "active: speckv v1"]
    assert table.loc["trained on"].tolist() == ["traces", "traces"]
    assert [b.label for b in at.button if b.key == "retrain_activate"] == ["Activate v2"]
    at.radio(key="retrain_source").set_value("speckv").run()  # any rerun: still not active
    with Store(app_env, read_only=True) as s:
        assert _active(s) == {"speckv": [1], "speckv-rf": [1]}
