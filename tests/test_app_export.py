"""The Export page, driven headless with AppTest on the tiny test models."""
from __future__ import annotations

import json

import yaml

from apptest import _app, _errors  # noqa: F401 - the fixture app_env comes from conftest
from engine.service.export.tuned_config import TunedConfig, from_dict
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
    downloads = at.get("download_button")
    assert len(downloads) == 4
    assert [b.label for b in at.button] == ["Save to store", "Write directory"]


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
    from engine.service.export.tuned_config import from_run

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


def test_each_engine_says_whether_this_export_ran_there_and_what_it_gave(app_env):
    import os

    at = _export_page()
    lines = [m.value for m in at.markdown if m.value.startswith("- ")]
    assert len(lines) == 2 and all("not run there yet" in ln and "bench exports --policy rakv" in ln for ln in lines)
    cfg = TunedConfig(target=os.environ["SPECLAB_TARGET"], draft=os.environ["SPECLAB_DRAFT"], policy="fixed:4")
    result = {"tok_s": {"plain": 20.0, "speclab_export": 25.0}, "realized_speedup": 1.25, "predicted_speedup": 1.5,
              "realized_vs_predicted": 1.25 / 1.5, "identical": 1.0, "prompts": 12, "max_new_tokens": 64}
    with Store(app_env) as st:
        st.add_export_check({"engine": "transformers", "engine_version": "5.24.0", "device": "cpu",
                             "config": TunedConfig(**{**cfg.to_dict(), "max_new_tokens": 64}).to_dict(), "ran": True,
                             "reason": "", "result": result})
        st.add_export_check({"engine": "vllm", "engine_version": None, "device": "cpu", "config": cfg.to_dict(),
                             "ran": False, "reason": "no vLLM CPU environment at .venv-vllm", "result": {}})
        st.add_export_check({"engine": "vllm", "engine_version": None, "device": "cpu",  # another setting's
                             "config": TunedConfig(target=cfg.target, draft=cfg.draft, policy="fixed:2").to_dict(),
                             "ran": False, "reason": "other", "result": {}})
    at.text_input(key="export_policy").set_value("fixed:4").run()
    assert not at.exception and not _errors(at), _errors(at)
    hf, vllm = [m.value for m in at.markdown if m.value.startswith("- ")]
    assert hf.startswith("- Hugging Face 5.24.0 (fp32)") and "1.25× its plain decoding" in hf
    assert "predicted 1.50× (realized/predicted 0.83)" in hf and "100% of 12 prompts" in hf
    assert vllm.startswith("- vLLM: did not run") and vllm.endswith("no vLLM CPU environment at .venv-vllm")


def test_write_directory_writes_a_checked_export(app_env, tmp_path):
    from engine.service.export.model_dir import check_export_dir, summary

    at = _export_page()
    at.text_input(key="export_policy").set_value("fixed:3").run()
    at.selectbox(key="export_dir_format").set_value("hf")
    at.text_input(key="export_dir").set_value(str(tmp_path / "out")).run()
    at.button(key="export_dir_write").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    out = tmp_path / "out"
    assert [s.value for s in at.success] == [summary(out, check_export_dir(out))]
    # The sidebar's draft (a Hugging Face model directory) is copied in, named relative to the export.
    assert json.loads((out / "hf_generate_kwargs.json").read_text())["assistant_model"] == "draft"
    assert "draft draft/" in at.success[0].value
    at.button(key="export_dir_write").click().run()  # the same directory again: one line, nothing lost
    errors = _errors(at)
    assert len(errors) == 1 and "exists and is not an empty directory" in errors[0], errors


def test_a_tree_policy_adds_its_static_tree_as_a_fifth_form(app_env):
    at = _export_page()
    at.text_input(key="export_policy").set_value("tree:6x2").run()
    assert not at.exception and not _errors(at), _errors(at)
    codes = [c.value for c in at.code]
    assert len(codes) == 5 and len(at.get("download_button")) == 5
    tree = json.loads(codes[4])
    assert len(tree["tree_choices"]) == 6 and tree["tree_choices"][0] == [0] and "prior" in tree["from"]
    assert json.loads(codes[3])["num_speculative_tokens"] == tree["depth"]
    assert any("no token-tree field" in i.value for i in at.info) or any(
        "no token-tree field" in c.value for c in at.caption)
