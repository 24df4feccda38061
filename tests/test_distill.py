"""`engine distill` on a tiny random target: data, training, checkpoints, Ctrl-C, the draft."""
import json
import signal
from pathlib import Path

import pytest
import torch

from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.runtime.draft_model import MARKER, WEIGHTS
from engine.runtime.models import load_pair
from engine.training import distill


class Bar:
    """tqdm's interface, silent; optionally presses Ctrl-C after a given number of steps."""

    def __init__(self, it=None, total=None, initial=0, interrupt_at=None, **_):
        self.it, self.n, self.interrupt_at = it, initial, interrupt_at

    def __iter__(self):
        return iter(self.it)

    def update(self, k):
        self.n += k
        if self.interrupt_at == self.n:
            signal.raise_signal(signal.SIGINT)

    def set_postfix(self, **_):
        pass

    def close(self):
        pass


def _cfg(tiny_dirs, tmp_path, **kw):
    target, _ = tiny_dirs
    base = dict(target=str(target), out=str(tmp_path / "draft"), work=str(tmp_path / "work"), layers=[0, 1],
                prompts_per_task=3, text_docs=4, max_new_tokens=12, gen_batch=8, steps=40, batch_tokens=128,
                lr=3e-3, warmup=2, ckpt_every=5, eval_every=20, seed=0)
    return distill.DistillConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tiny_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    cfg = _cfg(tiny_dirs, tmp, data_rounds=2)
    out = distill.run(cfg, progress=Bar, say=lambda m: None)
    return cfg, out


def test_data_shards_hold_target_greedy_responses(trained, tiny_dirs):
    cfg, _ = trained
    data = Path(cfg.work) / "data"
    shards = sorted(p.name for p in data.glob("*.safetensors"))
    assert any(s.startswith("train-") for s in shards) and any(s.startswith("heldout-") for s in shards)
    assert any(s.startswith("text-") for s in shards)
    assert any(s.startswith("train-r1-") for s in shards)  # the second round of prompts
    assert len(distill.load_examples(data, "train")) == sum(len(distill.Shard.load(data / s).offsets) - 1
                                                          for s in shards if s.startswith("train-"))
    pair = load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu")
    ex = distill.load_examples(data, "train")[0]
    # The shard's response is the target's own greedy continuation, and its top-1 agrees.
    prompt = ex.tokens[: ex.label_start]
    out = Generation(pair, prompt, make_policy("ar"), GenConfig(max_new_tokens=ex.n_labels)).run().token_ids
    assert out == ex.tokens[ex.label_start:]
    assert ex.topk_idx[:, 0].tolist() == out


def test_training_lowers_the_loss_and_writes_a_draft(trained):
    cfg, out = trained
    meta = json.loads((Path(out) / MARKER).read_text())
    log = json.loads((Path(cfg.work) / "ckpt.json").read_text())["log"]
    assert meta["steps"] == cfg.steps == len(log)
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert (Path(out) / WEIGHTS).exists() and meta["init_layers"] == [0, 1]


def test_the_draft_loads_and_greedy_output_stays_the_targets(trained, tiny_dirs):
    _, out = trained
    pair = load_pair(str(tiny_dirs[0]), str(out), device="cpu")
    assert "SpecLab draft" in pair.draft_name
    ids = encode_prompt(pair.tokenizer, "Hello there", chat=True)
    ar = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=30)).run().token_ids
    spec = Generation(pair, ids, make_policy("fixed:4"), GenConfig(max_new_tokens=30)).run()
    assert spec.token_ids == ar and spec.summary.acceptance_rate is not None


def test_a_draft_refuses_another_target(trained, tmp_path):
    from tiny import save_tiny_llama

    _, out = trained
    other = save_tiny_llama(tmp_path / "other", seed=5)
    with pytest.raises(ValueError, match="was trained for target"):
        load_pair(str(other), str(out), device="cpu")


def test_ctrl_c_keeps_a_checkpoint_and_a_rerun_resumes(tiny_dirs, tmp_path, trained):
    cfg_done, _ = trained
    target = load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu").target
    from engine.runtime.draft_model import build_draft

    def fresh_cfg(work: str):
        # Reuse the module's data shards: only training is under test here.
        (tmp_path / work).mkdir()
        (tmp_path / work / "data").symlink_to(Path(cfg_done.work) / "data")
        return _cfg(tiny_dirs, tmp_path, steps=12, work=str(tmp_path / work))

    cfg = fresh_cfg("work")
    draft = build_draft(target, cfg.layers)
    with pytest.raises(KeyboardInterrupt, match="stopped at step 7"):
        distill.train(cfg, draft, Path(cfg.work) / "data", lambda **kw: Bar(interrupt_at=7, **kw), say=lambda m: None)
    resumed = build_draft(target, cfg.layers)  # the initial copy: only the checkpoint can carry it on
    summary = distill.train(cfg, resumed, Path(cfg.work) / "data", Bar, say=lambda m: None)
    whole_cfg = fresh_cfg("whole")
    whole = build_draft(target, whole_cfg.layers)
    whole_summary = distill.train(whole_cfg, whole, Path(whole_cfg.work) / "data", Bar, say=lambda m: None)
    # Interrupted at 7 and resumed, the draft is the one an uninterrupted run makes: the weights,
    # the optimizer's moments and the batch schedule all carried on from step 7.
    ours, theirs = dict(resumed.named_parameters()), dict(whole.named_parameters())
    for name, p in ours.items():
        if p.requires_grad:
            assert torch.equal(p, theirs[name]), name
    assert [e["loss"] for e in summary["log"]] == [e["loss"] for e in whole_summary["log"]]


def test_bad_layers_are_refused(tiny_dirs):
    target = load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu").target
    from engine.runtime.draft_model import build_draft

    with pytest.raises(ValueError, match="target layer indices"):
        build_draft(target, [0, 7])


def test_training_can_continue_from_a_shipped_draft(trained, tiny_dirs, tmp_path):
    cfg_done, out = trained
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "data").symlink_to(Path(cfg_done.work) / "data")
    cfg = _cfg(tiny_dirs, tmp_path, steps=5, layers=[0], init_from=str(out), out=str(tmp_path / "next"))
    nxt = distill.run(cfg, progress=Bar, say=lambda m: None)
    meta = json.loads((Path(nxt) / MARKER).read_text())
    assert meta["continued_from"] == str(out) and meta["init_layers"] == [0, 1]  # the draft's own layers
