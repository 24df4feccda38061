"""The Streamlit front end, driven headless with AppTest on the tiny test models."""
from __future__ import annotations

import json
import re
import time

import pytest
from streamlit.testing.v1 import AppTest

from apptest import APP, _app, _errors, open_page, press_generate, store_costs_and_traces  # noqa: F401 - the fixture app_env comes from conftest
from engine.decode.costs import CostTable
from store import Store


def test_app_renders(app_env):
    at = _app()
    assert not at.exception
    assert not _errors(at)
    assert at.title[0].value == "Live decode"
    assert [b.label for b in at.button] == ["Generate"]
    # The sidebar starts from the environment.
    assert at.sidebar.text_input(key="speclab_db").value == str(app_env)
    assert at.selectbox(key="live_policy").value == "rakv"  # engine.decode.policies.DEFAULT_POLICY
    assert at.checkbox(key="live_chat").value is True


def test_generate_streams_summarises_and_stores(app_env):
    at = _app()
    at.text_area(key="live_prompt").set_value("Hello, how are you?")
    at.selectbox(key="live_policy").set_value("fixed:4")
    at.number_input(key="live_max_new").set_value(16)
    press_generate(at)
    assert not at.exception
    assert not _errors(at), _errors(at)

    metrics = {m.label: m.value for m in at.metric}
    assert set(metrics) == {"Tokens/s", "TTFT ms", "Tokens/step", "Mean accepted",
                            "Acceptance rate", "Prefix reuse", "Stop reason"}
    assert metrics["Prefix reuse"] in {"miss", "partial", "exact"}  # reuse is on by default
    assert float(metrics["Tokens/s"]) > 0
    assert metrics["Stop reason"] in {"EOS", "max tokens", "context full"}
    assert len(at.get("vega_lite_chart")) == 1

    saved = [s.value for s in at.success]
    assert len(saved) == 1 and saved[0].startswith("Stored as run "), saved
    run_id = saved[0].split()[3]

    table = at.dataframe[0].value
    assert list(table["step"]) == list(range(len(table)))
    assert table["emitted"].sum() <= 16
    # Who drafted each step: fixed:4 drafts with the draft model; the prefill (and a step the
    # budget leaves no room to draft) with nobody. The γ timeline marks the draft's points.
    assert table["proposer"].iloc[0] == "" and set(table["proposer"]) <= {"", "draft"}
    assert (table["proposer"] == "draft").any()
    # The γ panel shapes each drafted point by its proposer; the legend lists who drafted only.
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    gamma = next(v for row in spec["vconcat"] for v in row["hconcat"] if v["title"] == "Chosen γ")
    assert gamma["layer"][1]["encoding"]["shape"]["scale"] == {"domain": ["draft"], "range": ["circle"]}

    with Store(app_env) as store:
        run = store.run(run_id)
        steps = store.steps(run_id)
    assert run["policy"] == "fixed:4" and run["prompt"] == "Hello, how are you?"
    assert run["n_tokens"] == table["emitted"].sum() and 1 <= run["n_tokens"] <= 16
    assert len(steps) == len(table) and list(steps["step"]) == list(table["step"])
    # The output the page shows is the stored output (the tiny char model may emit specials only).
    shown = [t.value for t in at.text]
    assert run["output"] in shown

    # A rerun (any widget) still shows the last result from session state, with the sidebar.
    at.run()
    assert not at.exception
    assert at.sidebar.text_input(key="speclab_db").value == str(app_env)
    assert {m.label for m in at.metric} == set(metrics)
    assert run["output"] in [t.value for t in at.text]


def test_cost_aware_policies_run_live_and_say_what_they_miss(app_env):
    from engine.service.costs.jobs import MEASURER

    at = _app()
    at.text_input(key="live_policy_spec").set_value("rakv")  # a fresh database: no cost table yet
    at.number_input(key="live_max_new").set_value(12)
    press_generate(at, timeout=120)
    assert not at.exception and not _errors(at), _errors(at)
    why = at.dataframe[0].value["why"].tolist()  # every choice says why, in one line
    assert why[0] == "prefill" and all(w and "\n" not in w for w in why)
    # It did not wait for a table: it read probed costs and says so at every step.
    assert all(w.endswith("costs probed, no measured table yet") for w in why[1:]), why
    # Each names the proposer it drafts with (rakv chooses among all the pair has), or plain.
    said = ("draft γ", "ngram γ", "suffix γ", "probe draft", "probe ngram", "probe suffix", "plain")
    assert all(w.startswith(said) for w in why[1:]), why
    proposers = at.dataframe[0].value["proposer"].tolist()
    assert all(p in ("", "draft", "ngram", "suffix") for p in proposers) and all(
        w.startswith(p) for p, w in zip(proposers[1:], why[1:]) if p), (proposers, why)
    # After the run the table is measured in the background and stored: the buckets a 12-token run
    # reaches (64 and 256 tokens, two for a slope), for the draft model, the n-gram lookup and the suffix counts.
    status = MEASURER.wait(120)
    assert status.state == "finished", status
    with Store(app_env) as store:
        costs = store.costs()
        assert list(store.runs()["policy"]) == ["rakv"] and len(costs) == 6 and set(costs["ctx_bucket"]) == {64, 256}
        assert sorted(costs["proposer"]) == ["draft"] * 2 + ["ngram"] * 2 + ["suffix"] * 2
    at.run()
    assert any("cost table measured for" in c.value for c in at.caption)
    press_generate(at)  # the next run reads the stored table
    shown = at.dataframe[0].value
    why = shown["why"].tolist()
    assert not any("probed" in w for w in why), why
    # The figures a `why` gives are the stored table's: its plain step at the step's context.
    with Store(app_env) as store:
        table = CostTable.from_rows(store.costs().to_dict("records"))
    plain = [(re.search(r"vs ([\d.]+) plain|\(([\d.]+) ms/token\)", w), c)
             for w, c in zip(why[1:], shown["context_len"].tolist()[1:])]
    plain = [(m, c) for m, c in plain if m]  # a probe's or a skipped draft's why gives no plain figure
    assert plain, why
    assert all(float(m.group(1) or m.group(2)) == round(table.step_ms(0, c), 1) for m, c in plain), (why, table)
    at.text_input(key="live_policy_spec").set_value("speckv")  # no controller trained yet
    press_generate(at)
    errors = _errors(at)
    assert len(errors) == 1 and "python -m engine retrain" in errors[0] and "\n" not in errors[0]


def test_a_policy_with_a_named_proposer_drafts_with_it(app_env):
    at = _app()
    options = at.selectbox(key="live_policy").options
    assert {"fixed:4@ngram", "rakv@draft", "rakv@ngram"} <= set(options)  # no EAGLE head on the tiny pair
    assert not any("eagle" in o for o in options)
    at.text_area(key="live_prompt").set_value("abc abc abc abc abc")  # something to look up
    at.selectbox(key="live_policy").set_value("fixed:4@ngram")
    at.number_input(key="live_max_new").set_value(12)
    press_generate(at)
    assert not at.exception and not _errors(at), _errors(at)
    table = at.dataframe[0].value
    assert set(table["proposer"]) <= {"", "ngram"}
    with Store(app_env) as store:
        run = store.runs().iloc[0]
        steps = store.steps(run["run_id"])
    assert run["policy"] == "fixed:4@ngram" and list(steps["proposer"]) == list(table["proposer"])


def test_a_tree_policy_draws_each_steps_tree_with_its_accepted_path(app_env):
    """tree:4x2 on the Live page: the result draws a step's token tree (Graphviz), the slider walks
    the tree steps, and the steps are stored with their trees' shapes and drafted tokens."""
    at = _app()
    at.text_area(key="live_prompt").set_value("abc abc abc abc abc")
    at.text_input(key="live_policy_spec").set_value("tree:4x2")  # typed: any shape (the box offers tree:8x3)
    at.number_input(key="live_max_new").set_value(16)
    press_generate(at)
    assert not at.exception and not _errors(at), _errors(at)
    dots = at.get("graphviz_chart")
    assert len(dots) == 1 and "digraph tree" in dots[0].proto.spec and "n0 -> n1" in dots[0].proto.spec
    with Store(app_env) as store:
        steps = store.steps(store.runs().iloc[0]["run_id"])
    trees = steps[steps["k_drafted"] > 0]
    assert len(trees) and all(len(p) == len(d) == k for p, d, k in
                              zip(trees["tree_parents"], trees["draft_ids"], trees["k_drafted"]))
    sliders = at.select_slider(key="live_tree_step") if len(trees) > 1 else None
    if sliders is not None:
        sliders.set_value(int(trees["step"].iloc[-1])).run()
        assert not at.exception and len(at.get("graphviz_chart")) == 1


def test_bad_policy_is_one_line_error(app_env):
    at = _app()
    at.text_input(key="live_policy_spec").set_value("fixed:99")
    at.button(key="live_generate").click().run(timeout=60)
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert "fixed:k" in errors[0] and "99" in errors[0]
    assert not at.metric  # nothing ran
    assert not app_env.exists()  # and nothing was stored


def test_engine_errors_are_one_line(app_env, monkeypatch):
    # fp16 on CPU is refused by the engine; a missing model directory too.
    import torch

    if torch.cuda.is_available():
        pytest.skip("fp16 is valid on CUDA")
    at = _app()
    at.selectbox(key="live_tier").set_value("fp16")
    at.button(key="live_generate").click().run(timeout=60)
    assert not at.exception
    assert len(_errors(at)) == 1 and "fp16" in _errors(at)[0]

    at.sidebar.text_input(key="speclab_target").set_value("/nonexistent/model").run()
    at.selectbox(key="live_tier").set_value("fp32")
    at.button(key="live_generate").click().run(timeout=60)
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0] and "/nonexistent/model" in errors[0]


def test_replay_page_shows_policies_side_by_side_and_retrains(app_env, tiny_pair, monkeypatch):
    import engine.training.retrain as T
    from engine.service.generation import Request, generate

    # The compare → activate flow, whatever the tiny random pair's controller scores (the verdict
    # that holds a worse version back has its own tests: tests/test_app_retrain.py).
    monkeypatch.setattr(T, "shortfalls", lambda report: [])
    store_costs_and_traces(app_env, tiny_pair)
    at = open_page("views/retrain.py")
    assert not at.exception and not _errors(at)
    assert at.title[0].value == "Replay & retrain"
    table = at.dataframe[0].value
    assert {"ar", "fixed:4", "rakv"} <= set(table.index) and list(table.columns) == ["fp32"]
    at.button(key="retrain").click().run()  # from the traces, the default source
    assert not at.exception and not _errors(at)
    assert "speckv v1 (and speckv-rf v1) trained from traces; not active" in at.success[0].value
    with Store(app_env, read_only=True) as s:
        assert set(s.controllers()["name"]) == {"speckv", "speckv-rf"}
        assert not s.controllers()["active"].any()  # activating is the user's choice
    at.button(key="retrain_activate").click().run()
    assert not at.exception and not _errors(at)
    assert "speckv v1 is now active" in at.success[0].value
    with Store(app_env, read_only=True) as s:
        assert s.controllers()["active"].all()
    at.button(key="calibrate").click().run()  # no live runs yet: says what to run, changes nothing
    assert not at.exception and not _errors(at) and "python -m engine profile" in at.warning[0].value
    with Store(app_env) as s:
        for pol in ("ar", "fixed:2"):
            for prompt in ("def f(x):", "Hi there"):
                generate(tiny_pair, Request(prompt, pol, task="chat", max_new_tokens=16), s, context=None)
    at.button(key="calibrate").click().run()
    assert not at.exception and not _errors(at) and not at.warning
    assert "live / measured step time for k = 0..8" in at.success[-1].value
    with Store(app_env, read_only=True) as s:
        assert len(s.costs()["step_factor"].iloc[0]) == 9


def test_replay_page_without_traces_says_what_to_run(app_env):
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.switch_page("views/retrain.py").run()
    assert not at.exception and not _errors(at)
    assert "No acceptance traces" in at.info[0].value
    link = at.page_link[0]  # a first step to click, not a command to type
    assert link.proto.label == "Profile a sweep first" and link.proto.page.endswith("profile")


def test_two_sessions_generating_at_once_on_a_fresh_database_keep_both_runs(app_env):
    """Two browser sessions press Generate together on a database that does not exist yet: the
    decode slot runs them one after the other and the store keeps both runs (they used to race
    on creating the schema and the second run was lost)."""
    import threading

    sessions = [_app(), _app()]
    for i, at in enumerate(sessions):
        at.text_area(key="live_prompt").set_value(f"Hello number {i}")
        at.selectbox(key="live_policy").set_value("fixed:4")
        at.number_input(key="live_max_new").set_value(12)
    start = threading.Barrier(2)

    def press(at: AppTest, delay: float) -> None:
        start.wait()
        # The second press comes a moment later: CPython 3.11 compiles scripts with a process-wide
        # AST recursion counter, and two threads compiling at once can fail with "AST constructor
        # recursion depth mismatch" (python/cpython#106905). The decodes still overlap: each takes
        # seconds, so the second finds the decode slot taken.
        time.sleep(delay)
        press_generate(at, timeout=120)

    threads = [threading.Thread(target=press, args=(at, 0.5 * i)) for i, at in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for at in sessions:
        assert not at.exception and not _errors(at), _errors(at)
        assert [s.value for s in at.success][0].startswith("Stored as run ")
    with Store(app_env, read_only=True) as s:
        assert sorted(s.runs()["prompt"]) == ["Hello number 0", "Hello number 1"]


def test_the_page_says_which_policy_runs_and_why_a_bad_length_is_refused(app_env):
    at = _app()
    at.number_input(key="live_max_new").set_value(0)
    at.button(key="live_generate").click().run()
    errors = _errors(at)
    assert errors == ["max new tokens must be a whole number from 1 to 8192, got 0"], errors
    at.number_input(key="live_max_new").set_value(8)
    at.text_input(key="live_policy_spec").set_value("fixed:2")  # the box still says rakv: the typed spec runs
    press_generate(at)
    assert not _errors(at), _errors(at)
    caption = [c.value for c in at.caption if "fixed:2" in c.value]
    assert caption and "greedy" in caption[0] and "seed None" not in caption[0], [c.value for c in at.caption]
    with Store(app_env) as store:
        assert list(store.runs()["policy"]) == ["fixed:2"]
