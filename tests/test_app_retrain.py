"""Retraining on the workbench: Store.activate_controller, the Replay & retrain page's train →
compare with the active version → activate (or not) flow on the tiny test models, and a version
that would make `speckv` worse: never activated by default, by the CLI or the page, and said why."""
from __future__ import annotations

import json

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


def _not_worse(monkeypatch) -> None:
    """Whatever the tiny random pair's controller scores, treat it as no worse: these tests are
    about the compare → activate flow, the verdicts have their own below."""
    import engine.training.retrain as T

    monkeypatch.setattr(T, "shortfalls", lambda report: [])


def _worse(monkeypatch, corr: float = -0.316, gain: float = -0.18) -> None:
    """A controller worse than the best fixed γ, as issue 48 met it: the real training and replay,
    with the test correlation and the held-out gain vs the best fixed γ (fixed:4) set to `corr`
    and `gain` (the tiny pair's own figures vary with the random models)."""
    import engine.service.replays as R
    import engine.training.retrain as T

    real_scores, real_gain = T.scores, R._replay_gain
    monkeypatch.setattr(T, "scores", lambda pred, x, y: dict(real_scores(pred, x, y), corr=corr))

    def replay_gain(st, mlp, trace_ids, active=None):
        return dict(real_gain(st, mlp, trace_ids, active), gain_vs_best_fixed=gain, best_fixed={"fp32": "fixed:4"})

    monkeypatch.setattr(R, "_replay_gain", replay_gain)


WHY = "its held-out replay is 18% below the best fixed γ (fixed:4) and its test correlation is -0.32"
NONE_ACTIVE = ("no version is active, and with none active `speckv` uses the newest version not held back "
               "(store/tables.py `read_controller`), not this one")


def test_train_compares_with_the_active_version_and_activates_only_when_asked(app_env, tiny_pair, monkeypatch):
    store_costs_and_traces(app_env, tiny_pair)
    _not_worse(monkeypatch)
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
    assert "replay gain vs the active version (same prompts)" in table.index  # v1 replayed on v2's test prompts
    assert table.loc["replay gain vs the active version (same prompts)", "active: speckv v1"] == "—"


def test_shortfalls_name_every_way_a_version_is_worse():
    from engine.training.retrain import Report, shortfalls

    def report(**kw) -> Report:
        base = dict(source="traces", protocol="prompt", n_train=10, n_test=3, test_corr=0.4, test_mse=0.1,
                    rf_test_corr=0.5, rf_test_mse=0.1, decision_ms_median=0.01, rf_decision_ms_median=0.1,
                    whatif_kind="exact replay", whatif_gain_vs_fixed4=0.1, whatif_gain_vs_best_fixed=0.02,
                    whatif={"best_fixed": {"fp32": "fixed:2", "bf16": "fixed:1"}})
        return Report(**(base | kw))

    assert shortfalls(report()) == []
    assert shortfalls(report(test_corr=0.0)) == ["its test correlation is 0.00"]  # ≤ 0 counts
    assert shortfalls(report(test_corr=float("nan"))) == [
        "its test correlation is undefined (one predicted rate for every test row)"]
    assert shortfalls(report(whatif_gain_vs_best_fixed=-0.031)) == [
        "its held-out replay is 3.1% below the best fixed γ (fixed:1 at bf16, fixed:2 at fp32)"]
    assert shortfalls(report(active_version=2, whatif_gain_vs_active=-0.25)) == [
        "its held-out replay is 25% below the active v2's on the same prompts"]
    assert shortfalls(report(active_version=2, whatif_gain_vs_active=0.0)) == []  # as good as the active one
    scored = report(whatif_kind="predictor-scored", whatif_gain_vs_best_fixed=-0.5,
                    whatif={"best_fixed": 3.1, "best_fixed_policy": {"fp32": "fixed:4"}})
    assert shortfalls(scored) == ["its predictor-scored held-out gain is 50% below the best fixed γ (fixed:4)"]


def test_cli_retrain_keeps_a_worse_version_inactive_and_says_why_in_one_line(app_env, tiny_pair, monkeypatch,
                                                                              capsys):
    from engine.cli.main import main

    store_costs_and_traces(app_env, tiny_pair)
    db = str(app_env)
    _worse(monkeypatch)
    assert main(["retrain", "--db", db]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "activated" in line]
    assert said == [f"speckv v1 stored, not activated: {WHY}; {NONE_ACTIVE}; `--activate` makes it active anyway"]
    assert "v1 (traces, prompt split" in out and "; not active)" in out
    with Store(db, read_only=True) as s:
        assert _active(s) == {"speckv": [], "speckv-rf": []}

    assert main(["retrain", "--db", db, "--activate"]) == 0  # asked for: activated, and said what it costs
    assert f"speckv v2 activated although {WHY}" in capsys.readouterr().out.splitlines()
    with Store(db, read_only=True) as s:
        assert _active(s) == {"speckv": [2], "speckv-rf": [2]}

    assert main(["retrain", "--db", db, "--json"]) == 0  # the report says it; the line goes to stderr
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert (r["version"], r["activated"], r["active_version"]) == (3, False, 2)
    assert r["whatif_gain_vs_active"] == 0.0  # the same data, seed and model as v2: replayed, no better
    assert cap.err.strip().splitlines() == [f"speckv v3 stored, not activated: {WHY}; `speckv` keeps using v2; "
                                            "`--activate` makes it active anyway"]
    with Store(db, read_only=True) as s:
        assert _active(s) == {"speckv": [2], "speckv-rf": [2]}

    assert main(["retrain", "--db", db, "--activate", "--no-activate"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --activate and --no-activate contradict each other: "
                                               "pass one of them")

    monkeypatch.undo()  # a version that is not worse is activated by default, without a word
    _not_worse(monkeypatch)
    assert main(["retrain", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "; active)" in out and "activated" not in out
    with Store(db, read_only=True) as s:
        assert _active(s) == {"speckv": [4], "speckv-rf": [4]}


def test_cli_retrain_verdict_agrees_with_the_real_figures(app_env, tiny_pair, capsys):
    """Nothing patched: on the tiny random pair the controller is what it is; whether it was
    activated follows from its own report, and a held-back one is said in one line."""
    from engine.cli.main import main

    store_costs_and_traces(app_env, tiny_pair)
    assert main(["retrain", "--db", str(app_env), "--json"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    worse = r["whatif_gain_vs_best_fixed"] < 0 or not r["test_corr"] > 0
    assert r["activated"] is not worse and bool(r["shortfalls"]) is worse
    lines = cap.err.strip().splitlines()
    assert (len([x for x in lines if "not activated" in x]) == 1) is worse
    if r["whatif_gain_vs_best_fixed"] < 0:
        assert "below the best fixed γ" in lines[-1]


def test_page_says_why_a_worse_version_is_not_activated_and_asks_first(app_env, tiny_pair, monkeypatch):
    store_costs_and_traces(app_env, tiny_pair)
    _worse(monkeypatch)
    at = open_page("views/retrain.py")
    at.button(key="retrain").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    assert [w.value for w in at.warning] == [f"speckv v1 stored, not activated: {WHY}; {NONE_ACTIVE}"]
    assert not [b for b in at.button if b.key == "retrain_activate"]  # no plain Activate for a worse version
    assert at.checkbox(key="retrain_confirm_v1").label == f"Activate v1 anyway, although {WHY}"
    with Store(app_env, read_only=True) as s:
        assert _active(s) == {"speckv": [], "speckv-rf": []}

    at.checkbox(key="retrain_confirm_v1").check().run()
    assert [b.label for b in at.button if b.key == "retrain_activate"] == ["Activate v1 anyway"]
    at.button(key="retrain_activate").click().run()
    assert not at.exception and not _errors(at)
    assert at.success[0].value == "speckv v1 is now active (with speckv-rf v1)"
    with Store(app_env, read_only=True) as s:
        assert _active(s) == {"speckv": [1], "speckv-rf": [1]}

    at.button(key="retrain").click().run()  # beside an active version: it keeps running
    assert not at.exception and not _errors(at), _errors(at)
    assert [w.value for w in at.warning] == [f"speckv v2 stored, not activated: {WHY}; `speckv` keeps using v1"]
    assert not at.checkbox(key="retrain_confirm_v2").value  # a new version asks again
    assert not [b for b in at.button if b.key == "retrain_activate"]
