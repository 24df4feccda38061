"""The EAGLE head and its proposer on tiny random models: exact output, the head's cache against
a full read, storage, and training."""

import pytest
import torch

from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.oracles.eagle import EagleProposer
from engine.oracles.sampling import Sampler
from engine.oracles.target import TargetVerifier
from engine.runtime import eagle_head as eaglelib
from engine.runtime.models import load_pair
from engine.runtime.prefix.cache import PrefixCache
from engine.training.eagle_distill import EagleDistillConfig, FeatureShard, _batch, featurize, step_loss

PROMPTS = ["Hello there", "def f(x): return", "2+2=", "Tell me a story about a cat."]


def _hf_greedy(pair, ids, n):
    x = torch.tensor([ids])
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               pad_token_id=pair.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_the_eagle_proposer_equals_hf_generate(eagle_pair, prompt):
    ids = encode_prompt(eagle_pair.tokenizer, prompt, chat=True)
    ref = _hf_greedy(eagle_pair, ids, 40)
    for policy in ("fixed:1@eagle", "fixed:4@eagle", "fixed:8@eagle"):
        g = Generation(eagle_pair, ids, make_policy(policy), GenConfig(max_new_tokens=40)).run()
        assert g.token_ids == ref, policy
        drafted = [r for r in g.records[1:] if r.k_drafted]
        assert drafted and {r.proposer for r in drafted} == {"eagle"}


def test_the_heads_cache_gives_what_a_full_read_gives(eagle_pair):
    """The proposer reads the prompt's rows at once, later rows one by one, drafts on guessed
    rows and drops them: its first drafted token's law equals the head reading every real row in
    one causal pass."""
    pair = eagle_pair
    ids = encode_prompt(pair.tokenizer, PROMPTS[3], chat=True)
    sampler = Sampler(0.0, 1.0, 0, pair.device)
    with torch.inference_mode():
        v = TargetVerifier(pair, ids, sampler)
        prop = EagleProposer(pair, ids, sampler, v)
        first = v.prefill()
        for _ in range(6):  # three tokens drafted and verified per step
            drafted = prop.propose(3, lambda j, t: True)
            n, emitted = v.verify(drafted)
            prop.update(n, emitted)
        got = prop.propose(1, lambda j, t: True)[0]
        feats, toks = v.features(), v.tokens  # rows for positions 0 … len(toks) − 2
        full = pair.eagle(feats[None].float(), torch.tensor([toks[1:]]))[0, -1]  # [H]
        want = pair.eagle.logits(full)
    assert first == toks[len(ids)]
    assert got.token_id == int(pair.eagle.vocab_map[want.argmax()])
    p = torch.softmax(want, -1)
    assert got.confidence == pytest.approx(float(p.max()), rel=1e-4)


def test_sampling_with_the_eagle_proposer_is_reproducible_and_in_vocabulary(eagle_pair):
    ids = encode_prompt(eagle_pair.tokenizer, PROMPTS[0], chat=True)
    runs = [Generation(eagle_pair, ids, make_policy("fixed:3@eagle"),
                       GenConfig(max_new_tokens=30, temperature=1.0, seed=s)).run().token_ids for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_eagle_after_a_prefix_cache_hit_stays_exact(eagle_pair):
    ids = encode_prompt(eagle_pair.tokenizer, PROMPTS[1], chat=True)
    ref = _hf_greedy(eagle_pair, ids, 30)
    cache = PrefixCache(1 << 26)
    for kind in ("miss", "exact"):
        g = Generation(eagle_pair, ids, make_policy("fixed:3@eagle"), GenConfig(max_new_tokens=30), prefix=cache).run()
        assert g.token_ids == ref and g.summary.prefix_hit == kind


def test_a_saved_head_loads_with_its_pair_and_refuses_another_target(eagle_pair, tiny_dirs, tmp_path):
    out = tmp_path / "head"
    eaglelib.save_head(eagle_pair.eagle, out, dict(target="tiny", target_fingerprint=eaglelib.draftlib.fingerprint(
        eagle_pair.target.get_input_embeddings().weight)))
    pair = load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu", eagle=str(out))
    assert pair.eagle is not None and pair.eagle.shape == eagle_pair.eagle.shape
    assert torch.equal(pair.eagle.vocab_map, eagle_pair.eagle.vocab_map)
    ids = encode_prompt(pair.tokenizer, PROMPTS[2], chat=True)
    g = Generation(pair, ids, make_policy("fixed:4@eagle"), GenConfig(max_new_tokens=20)).run()
    assert g.token_ids == _hf_greedy(pair, ids, 20)
    with pytest.raises(ValueError, match="not an EAGLE head directory"):
        load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu", eagle=str(tmp_path))
    with pytest.raises(ValueError, match="not for this one"):
        load_pair(str(tiny_dirs[1]), str(tiny_dirs[1]), device="cpu", eagle=str(out))
    assert load_pair(str(tiny_dirs[0]), str(tiny_dirs[1]), device="cpu").eagle is None  # no head by default


def test_training_lowers_the_loss_on_a_batch(eagle_pair):
    torch.manual_seed(1)
    seqs = [torch.randint(0, eagle_pair.vocab_size, (24,)).tolist() for _ in range(4)]
    shard = featurize(eagle_pair.target, seqs, batch=2)
    assert shard.feats.shape == (96, eagle_pair.eagle.shape.hidden)
    batch = _batch(shard.sequences(), [0, 1, 2, 3])
    emb = eagle_pair.target.get_input_embeddings().weight.detach().float()
    head = eaglelib.build_head(eagle_pair.target, emb, torch.arange(emb.shape[0]))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    cfg = EagleDistillConfig()
    first = None
    for _ in range(30):
        loss, stats = step_loss(head, batch, cfg)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first and {"acc1", "acc2", "ce1", "ce2"} <= set(stats)


def test_feature_shards_round_trip(tmp_path):
    s = FeatureShard(torch.arange(5, dtype=torch.int32), torch.tensor([0, 2, 5]), torch.randn(5, 3).half(),
                     torch.arange(5, dtype=torch.int32))
    s.save(tmp_path / "s.safetensors")
    back = FeatureShard.load(tmp_path / "s.safetensors")
    assert [len(t) for t, _, _ in back.sequences()] == [2, 3] and torch.equal(back.feats, s.feats)
