"""The Export page, driven headless with AppTest on the tiny test models."""
from __future__ import annotations

import json

import yaml

from apptest import _app, _errors  # noqa: F401 - the fixture app_env comes from conftest
from engine.service.tuned_config import TunedConfig, from_dict
from store import Store


def _export_page():
    at = _app()
    at.switch_page("views/export.py").run()
    assert not at.exception, at.exception
    return at


def test_export_page_renders_the_four_forms(app_env):
    at = _export_page()
    assert not _errors(at), _errors(at)
    assert at.title[0].value == "Export"
    assert at.text_input(key="export_policy").value == "rakv"  # no run stored yet: the defaults
    codes = [c.value for c in at.code]
    assert len(codes) == 4
    shown = from_dict(json.loads(codes[0]))
    assert shown.policy == "rakv" and shown.target == str(TunedConfig(target=shown.target).target)
    assert from_dict(yaml.safe_load(codes[1])) == shown
    assert json.loads(codes[2])["num_assistant_tokens_schedule"] == "constant"
    assert json.loads(codes[3])["method"] == "draft_model"
    assert len(at.get("download_button")) == 4
    assert [b.label for b in at.button] == ["Save to store"]


def test_save_shows_the_version_and_lists_it(app_env):
    at = _export_page()
    at.text_input(key="export_policy").set_value("fixed:3").run()
    at.text_input(key="export_name").set_value("tuned")
    at.button(key="export_save").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    assert [s.value for s in at.success] == ["saved as tuned v1"]
    at.selectbox(key="export_format").set_value("vllm")
    at.button(key="export_save").click().run()
    assert [s.value for s in at.success] == ["saved as tuned v2"]
    table = at.dataframe[0].value
    assert list(table["version"]) == [2, 1] and list(table["format"]) == ["vllm", "json"]
    with Store(app_env) as st:
        stored = st.exports("tuned")
    assert from_dict(json.loads(stored["content"].iloc[0])).policy == "fixed:3"
    assert json.loads(stored["content"].iloc[1])["num_speculative_tokens"] == 3


def test_bad_input_is_one_error_line(app_env):
    at = _export_page()
    at.text_input(key="export_policy").set_value("warp:9").run()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and "\n" not in errors[0] and "unknown policy 'warp:9'" in errors[0], errors
    assert not at.code  # nothing exported from a bad config
    at.text_input(key="export_policy").set_value("fixed:4")
    at.number_input(key="export_gamma_min").set_value(6).run()
    errors = _errors(at)
    assert len(errors) == 1 and "gamma_min ≤ gamma_max ≤ 8, got 6..4" in errors[0], errors


def test_the_form_starts_from_the_latest_run(app_env):
    from engine.service.tuned_config import from_run

    run = {"run_id": "r1", "target_tier": "bf16", "kv_tier": "int8", "policy": "fixed:2", "temperature": 0.0,
           "top_p": 1.0, "max_new_tokens": 33, "config": json.dumps({"draft_tier": "fp32", "reuse": False})}
    cfg = from_run(run, None, None)
    assert (cfg.target_tier, cfg.kv_tier, cfg.policy, cfg.max_new_tokens, cfg.draft_tier, cfg.reuse, cfg.source) == (
        "bf16", "int8", "fixed:2", 33, "fp32", False, "run r1")
    assert from_run(dict(run, policy="nonsense", kv_tier="q9"), None, None).policy == "rakv"  # kept the default
    with Store(app_env) as st:
        st.add_run(dict(run, run_id=None, target="t", draft="d", device="cpu", prompt="p", output="",
                        token_ids=[], n_tokens=0, n_steps=0), [])
    at = _export_page()
    assert not _errors(at), _errors(at)
    assert at.text_input(key="export_policy").value == "fixed:2"
    assert at.selectbox(key="export_kv_tier").value == "int8"
    assert at.number_input(key="export_max_new").value == 33
