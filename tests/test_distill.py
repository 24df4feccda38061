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
from engine.training import distill, distill_data


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
    steps = [r for r in log if "loss" in r]  # the first record is the draft before training: step 0
    assert meta["steps"] == cfg.steps == len(steps) and log[0]["step"] == 0
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
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
    assert [e.get("loss") for e in summary["log"]] == [e.get("loss") for e in whole_summary["log"]]


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


def test_the_card_carries_agreement_against_cpu_minutes(trained):
    cfg, out = trained
    meta = json.loads((Path(out) / MARKER).read_text())
    curve = meta["curve"]
    # The draft before training, every evaluation (eval_every = 20), and the end, in CPU-minutes.
    assert [p["step"] for p in curve] == [0, 20, 40] and curve[0]["cpu_min"] == 0
    assert all(a["cpu_min"] <= b["cpu_min"] for a, b in zip(curve, curve[1:])) and curve[-1]["cpu_min"] > 0
    assert all(0 <= p["heldout_agreement"] <= 1 for p in curve)
    assert curve[-1]["heldout_agreement"] == round(meta["heldout_agreement"], 4)
    assert "0 min" in distill.format_curve(curve)


def test_answers_kept_as_ids_rebuild_the_data_without_generating(tiny_dirs, tmp_path, monkeypatch):
    ids = tmp_path / "ids.safetensors"
    first = _cfg(tiny_dirs, tmp_path, work=str(tmp_path / "a"), stage="data", teacher_tier="fp32", ids=str(ids),
                 sharegpt_prompts=5)
    data_a = distill.run(first, progress=Bar, say=lambda m: None)
    assert ids.exists() and any(p.name.startswith("real-") for p in data_a.glob("*.safetensors"))

    def no_generation(*a, **k):
        raise AssertionError("answers kept in the ids file were generated again")

    monkeypatch.setattr(distill_data, "respond", no_generation)  # where the data stage calls it
    again = _cfg(tiny_dirs, tmp_path, work=str(tmp_path / "b"), stage="data", teacher_tier="fp32", ids=str(ids),
                 sharegpt_prompts=5)
    data_b = distill.run(again, progress=Bar, say=lambda m: None)
    names = sorted(p.name for p in data_a.glob("*.safetensors"))
    assert names == sorted(p.name for p in data_b.glob("*.safetensors"))
    for name in names:  # the same sequences, and the target's view of them rebuilt by teacher forcing
        a, b = distill.Shard.load(data_a / name), distill.Shard.load(data_b / name)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.label_start, b.label_start), name
        assert torch.equal(a.topk_idx[:, 0], b.topk_idx[:, 0]), name
        torch.testing.assert_close(a.topk_logp.float(), b.topk_logp.float(), atol=2e-2, rtol=0)


def test_an_ids_file_for_other_answers_is_refused_in_one_line(tiny_dirs, tmp_path):
    ids = tmp_path / "ids.safetensors"
    distill.run(_cfg(tiny_dirs, tmp_path, work=str(tmp_path / "a"), stage="data", ids=str(ids)),
                progress=Bar, say=lambda m: None)
    kept = ids.read_bytes()
    cases = [(dict(prompts_per_task=2), "answers other prompts"), (dict(max_new_tokens=7), "holds answers made with")]
    for i, (kw, message) in enumerate(cases):
        cfg = _cfg(tiny_dirs, tmp_path, work=str(tmp_path / f"w{i}"), stage="data", ids=str(ids), **kw)
        with pytest.raises(ValueError, match=message):
            distill.run(cfg, progress=Bar, say=lambda m: None)
    assert ids.read_bytes() == kept  # nothing stored changed
    ids.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a distill ids file"):
        distill.run(_cfg(tiny_dirs, tmp_path, work=str(tmp_path / "c"), stage="data", ids=str(ids)),
                    progress=Bar, say=lambda m: None)
