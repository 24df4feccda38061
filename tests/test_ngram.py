"""The n-gram (prompt lookup) proposer: its proposals against a brute-force scan, the step
outcome's bookkeeping, its options, and exact decoding with it on the tiny model pair."""
import dataclasses
import random

import pytest
import torch
from test_speculative import PROMPTS, _chi2_pvalue

from engine.decode.policies import make_policy
from engine.decode.step import ModelledClock, Setting, decode
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.oracles.ngram import NGRAM_MAX, UNBOUNDED, NgramProposer
from engine.oracles.sampling import Sampler, rejection_sample, warp
from engine.oracles.target import TargetVerifier

GREEDY = Sampler(0.0, 1.0, None, torch.device("cpu"))
V = 64  # vocabulary of the synthetic contexts


def _always(j, token) -> bool:
    return True


def _ngram(ctx, max_ngram=3, min_ngram=1, sampler=GREEDY, vocab_size=V) -> NgramProposer:
    return NgramProposer(list(ctx), sampler, vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)


def _proposal(p: NgramProposer, k: int) -> list[int]:
    return [d.token_id for d in p.propose(k, _always)]


def _brute(ctx: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The definition, scanned: the longest suffix (max … min) with an earlier occurrence, its
    latest one, and k tokens copied from after it, on into the copied tokens themselves."""
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for j in range(L - n - 1, -1, -1):
            if ctx[j : j + n] == ctx[L - n :]:
                out = list(ctx)
                for i in range(k):
                    out.append(out[j + n + i])
                return out[L:]
    return []


@pytest.mark.parametrize("ctx, kw, k, expected", [
    ([1, 2, 3, 4, 1, 2], {}, 2, [3, 4]),  # suffix [1, 2] occurred at 0: what followed it
    ([1, 2, 3, 4, 1, 2], {}, 6, [3, 4, 1, 2, 3, 4]),  # past the context's end: the copy goes on at distance 4
    ([5, 1, 7, 1, 8, 1], {}, 4, [8, 1, 8, 1]),  # [1]'s latest earlier occurrence (at 3), not its first
    ([1, 2, 9, 3, 2, 7, 1, 2], {}, 3, [9, 3, 2]),  # the longer suffix [1, 2] beats [2]'s later occurrence
    ([1, 2, 9, 3, 2, 7, 1, 2], {"max_ngram": 1}, 4, [7, 1, 2, 7]),  # max 1: only [2], latest at 4
    ([5, 1, 7, 1], {"min_ngram": 2}, 3, []),  # [7, 1] never occurred before; [1] is under min
    ([5, 1, 7, 1], {"min_ngram": 1, "max_ngram": 1}, 3, [7, 1, 7]),  # min = max
    ([4, 4], {}, 3, [4, 4, 4]),  # a loop of period 1 drafts k, not 1
    ([3, 3, 3, 3, 3], {}, 5, [3, 3, 3, 3, 3]),
    ([1, 2, 3], {}, 4, []),  # no repeat: nothing to propose
    ([4], {}, 4, []),
    ([], {}, 4, []),
    ([1, 2, 1], {}, 0, []),  # k = 0 drafts nothing
])
def test_proposals_on_hand_made_contexts(ctx, kw, k, expected):
    p = _ngram(ctx, **kw)
    assert _proposal(p, k) == expected
    assert _brute(ctx, k, kw.get("min_ngram", 1), kw.get("max_ngram", 3)) == expected


def test_index_proposes_what_a_brute_force_scan_proposes():
    """Random streams (small alphabets, so repeats and loops abound; tiny contexts; min = max
    every third run), fed as steps: each proposal, at each step, is the scan's."""
    checks = 0
    for seed in range(300):
        rng = random.Random(seed)
        alphabet = rng.randint(1, 5)
        hi = rng.randint(1, 6)
        lo = hi if seed % 3 == 0 else rng.randint(1, hi)
        ctx = [rng.randrange(alphabet) for _ in range(rng.randint(0, 8))]
        p = _ngram(ctx, max_ngram=hi, min_ngram=lo)
        for _ in range(rng.randint(1, 30)):
            k = rng.randint(0, 8)
            proposal = _proposal(p, k)
            assert proposal == _brute(ctx, k, lo, hi), (seed, ctx, k, lo, hi)
            assert p.lookahead() == (UNBOUNDED if _brute(ctx, 1, lo, hi) else 0)
            # A step: some of the proposal stands (as often a real target's would), then one token of its own.
            n = rng.randint(0, len(proposal))
            emitted = proposal[:n] + [rng.randrange(alphabet)]
            p.update(n, emitted)
            ctx += emitted
            assert p.tokens == ctx
            checks += 1
    assert checks > 2000


def test_update_extends_the_context_by_what_was_emitted():
    """`emitted` holds the accepted drafted tokens and the target's: after it the context is
    the old one plus `emitted`, whoever drafted, and the next match is looked up in it."""
    p = _ngram([1, 2, 3, 4, 5, 1, 2])
    drafted = _proposal(p, 4)
    assert drafted == [3, 4, 5, 1]
    assert _proposal(p, 4) == drafted  # proposing changes nothing: a dropped proposal needs no rollback
    p.update(2, [3, 4, 9])  # 3 and 4 accepted, then the target's 9
    assert p.tokens == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]
    assert _proposal(p, 3) == []  # 9 is new
    p.update(0, [1, 2])  # a step another proposer drafted: context all the same
    assert p.tokens[-3:] == [9, 1, 2] and _proposal(p, 3) == [3, 4, 9]  # [9, 1, 2] is new; [1, 2]'s latest occurrence is at 5


def test_lookahead_says_whether_there_is_a_match():
    p = _ngram([1, 2, 3])
    assert p.lookahead() == 0 and p.unread == (0, 0) and p.name == "ngram"
    p.update(0, [2])
    assert p.lookahead() == UNBOUNDED  # [2] occurred at 1; the copy can go on for any k
    p.update(0, [7])
    assert p.lookahead() == 0


def test_draft_tokens_are_certain_and_one_hot_under_sampling():
    greedy = _ngram([1, 2, 1]).propose(3, _always)
    assert [(d.token_id, d.entropy, d.confidence, d.p) for d in greedy] == [(2, 0.0, 1.0, None), (1, 0.0, 1.0, None),
                                                                             (2, 0.0, 1.0, None)]
    sampled = _ngram([1, 2, 1], sampler=Sampler(0.8, 1.0, 0, torch.device("cpu"))).propose(2, _always)
    for d in sampled:
        assert d.p.shape == (V,) and d.p.dtype == torch.float32 and d.p.device.type == "cpu"
        assert d.p[d.token_id] == 1.0 and d.p.sum() == 1.0


def test_keep_drafting_stops_the_copy():
    p = _ngram([1, 2, 3, 4, 1])
    seen = []
    drafted = p.propose(4, lambda j, token: seen.append((j, token.token_id)) or j < 1)
    assert [d.token_id for d in drafted] == [2, 3] and seen == [(0, 2), (1, 3)]


def test_tokens_past_the_vocabulary_end_the_draft():
    """A prompt token the target's logits do not cover can never be emitted, nor given a law [V]."""
    p = _ngram([5, V + 3, 6, 5], vocab_size=V)
    assert _proposal(p, 3) == []
    p = _ngram([5, 6, V + 3, 5], vocab_size=V)
    assert _proposal(p, 3) == [6]


@pytest.mark.parametrize("kw, msg", [
    ({"max_ngram": 0}, r"ngram option max must be an integer in \[1, 16\], got 0"),
    ({"max_ngram": NGRAM_MAX + 1}, "option max must be an integer in"),
    ({"min_ngram": 0}, r"ngram option min must be an integer in \[1, 16\], got 0"),
    ({"max_ngram": 2.0}, "option max must be an integer"),
    ({"min_ngram": True}, "option min must be an integer"),
    ({"max_ngram": 2, "min_ngram": 3}, "ngram option min must be ≤ max, got min=3, max=2"),
])
def test_bad_options_are_value_errors_naming_the_option(kw, msg):
    with pytest.raises(ValueError, match=msg):
        NgramProposer([1, 2], GREEDY, V, **kw)


def test_options_as_the_policy_spec_writes_them():
    p = NgramProposer.from_options([1], GREEDY, V, {"max": "4", "min": "2"})
    assert (p.max_ngram, p.min_ngram) == (4, 2)
    assert NgramProposer.from_options([1], GREEDY, V, {}).max_ngram == 3
    with pytest.raises(ValueError, match="unknown ngram option 'n' \\(known: max, min\\)"):
        NgramProposer.from_options([1], GREEDY, V, {"n": "2"})
    with pytest.raises(ValueError, match="ngram option max must be an integer, got 'x'"):
        NgramProposer.from_options([1], GREEDY, V, {"max": "x"})
    with pytest.raises(ValueError, match="option min must be ≤ max"):
        NgramProposer.from_options([1], GREEDY, V, {"min": "5"})


def _decode(pair, ids, policy: str, sampler: Sampler, n: int, **kw) -> tuple[list[int], list]:
    verifier = TargetVerifier(pair, ids, sampler)
    proposer = NgramProposer(ids, sampler, pair.vocab_size, **kw)
    with torch.inference_mode():
        records = list(decode(proposer, verifier, make_policy(policy), Setting(len(ids), n, pair.target_tier, "native"),
                              ModelledClock()))
    return [t for r in records for t in r.token_ids], records


def test_greedy_decoding_with_ngram_drafts_is_plain_greedy(tiny_pair):
    """The tiny target falls into loops, where copies are accepted: the output is still plain
    greedy decoding's, token for token."""
    accepted = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tiny_pair.tokenizer, prompt, chat=True)
        plain = Generation(tiny_pair, ids, make_policy("ar"), GenConfig(max_new_tokens=40)).run().token_ids
        for policy, kw in [("fixed:4", {}), ("fixed:8", {"max_ngram": 2, "min_ngram": 2})]:
            out, records = _decode(tiny_pair, ids, policy, GREEDY, 40, **kw)
            assert out == plain, (prompt, policy, kw)
            accepted += sum(r.accepted for r in records)
    assert accepted > 20  # measured: 45 (fixed:4 alone: 8 + 2 + 16 + 19)


def test_rejection_sampling_of_one_hot_drafts_preserves_the_target_law():
    """Synthetic q: whatever the copy proposes, the emitted tokens follow q (accepted with
    q(x), resampled from q without x)."""
    gen = torch.Generator().manual_seed(0)
    vocab, N = 8, 8000
    q = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)  # [k+1, V]
    sampler = Sampler(1.0, 1.0, 0, torch.device("cpu"))
    likely = [int(q[0].argmax()), int(q[1].argmax())]  # copied, so that acceptances are frequent
    c = min(set(range(vocab)) - set(likely))
    drafted = _ngram([c, *likely, c], sampler=sampler, vocab_size=vocab).propose(2, _always)
    draft, p = [d.token_id for d in drafted], torch.stack([d.p for d in drafted])  # p: [2, V]
    assert draft == likely
    first, second = [], []
    for _ in range(N):
        n, nxt = rejection_sample(draft, p, q, gen)
        out = draft[:n] + [nxt]
        first.append(out[0])
        if out[0] == draft[0]:  # accepted (a rejection never resamples the drafted token): the next follows q[1]
            second.append(out[1])
    assert _chi2_pvalue(first, q[0]) > 1e-3
    assert len(second) > 300 and _chi2_pvalue(second, q[1]) > 1e-3


def copy_context(tiny_pair, T: float = 0.8, top_p: float = 0.95) -> dict:
    """A context whose copy the target finds likely, for the end-to-end sampling tests: ids =
    head, a, v, tail, a (a copy from [a] proposes [v, tail[0]]), with the target's laws q1 of the
    next token and q2 of the one after v."""
    pair = dataclasses.replace(tiny_pair, eos_ids=frozenset())  # no early stop: two tokens every time
    V_pair, tok = pair.vocab_size, pair.tokenizer
    head, tail, a = tok("The cat sat on")["input_ids"], tok(" mat.")["input_ids"], tok("Q")["input_ids"][0]
    assert a not in head + tail
    with torch.inference_mode():
        # ids_v = head, a, v, tail, a: max_ngram 1 copies [v, tail[0]]. Take the v the target likes most there.
        ctx = torch.tensor([head + [a, v] + tail + [a] for v in range(V_pair)])  # [V, S]
        q_v = warp(pair.target(ctx).logits[:, -1, :V_pair], T, top_p)  # [V, V]
        likes = q_v.diagonal().clone()
        likes[a] = 0
        v = int(likes.argmax())
        ids = head + [a, v] + tail + [a]
        q1 = q_v[v]  # [V]
        q2 = warp(pair.target(torch.tensor([ids + [v]])).logits[0, -1, :V_pair], T, top_p)  # [V]: after the copy's first
    assert q1[v] > 0.3  # measured 0.42: the copy is accepted often enough to test the second token
    return dict(pair=pair, ids=ids, v=v, tail=tail, a=a, q1=q1, q2=q2, sampler=Sampler(T, top_p, 0, pair.device))


def two_token_law_holds(c: dict, proposer, N: int = 1200) -> None:
    """One verify of the proposer's [v, tail[0]] after c's context, repeated (rewound after each):
    its first two emitted tokens against the target's own sampling law."""
    verifier = TargetVerifier(c["pair"], c["ids"], c["sampler"])
    first, second = [], []
    with torch.inference_mode():
        verifier.prefill()
        for _ in range(N):
            verifier.rewind(len(c["ids"]))  # back to the context ids, its next token unread
            drafted = proposer.propose(2, _always)
            assert [d.token_id for d in drafted] == [c["v"], c["tail"][0]]
            _, emitted = verifier.verify(drafted)
            first.append(emitted[0])
            if emitted[0] == c["v"]:
                second.append(emitted[1])
    assert _chi2_pvalue(first, c["q1"]) > 1e-3
    assert len(second) > 300 and _chi2_pvalue(second, c["q2"]) > 1e-3


def test_sampling_with_ngram_drafts_follows_the_target_law(tiny_pair):
    """End to end through the target verifier: a context whose copy the target finds likely."""
    c = copy_context(tiny_pair)
    two_token_law_holds(c, NgramProposer(c["ids"], c["sampler"], c["pair"].vocab_size, max_ngram=1))
