"""Reduced-vocabulary draft heads (engine/runtime/vocab_head.py): the maps, the ranking file, and
exactness: greedy output unchanged, sampling still follows the target's law."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import PROMPTS, _chi2_pvalue, _gen, _hf_greedy

from engine.decode.policies import parse_proposers
from engine.lab.generation import encode_prompt
from engine.oracles.draft import DraftModelProposer, draft_read
from engine.oracles.sampling import Sampler, rejection_sample, warp
from engine.oracles.target import TargetVerifier
from engine.runtime import vocab_head
from engine.runtime.forward import forward_logits
from tiny import CHARS


def _always(i, d) -> bool:
    return True


def test_d2t_t2d_round_trip():
    ids = torch.tensor([0, 2, 3, 7, 11])
    d2t, t2d = vocab_head.maps(ids, 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(torch.arange(5) + d2t, ids)  # target id = draft index + offset
    assert torch.equal(t2d.nonzero()[:, 0], ids) and int(t2d.sum()) == len(ids)
    assert torch.equal(t2d.cumsum(0)[ids] - 1, torch.arange(5))  # and back: draft index of a covered id


def test_choose_ids_forces_eos_and_follows_the_ranking():
    ranking = torch.tensor([9, 4, 50, 1, 7])  # 50 is past this vocabulary: skipped
    assert vocab_head.choose_ids(ranking, 3, 10, [2]).tolist() == [2, 4, 9]
    assert vocab_head.choose_ids(ranking, 6, 10, [2]).tolist() == [0, 1, 2, 4, 7, 9]  # then unranked by id
    assert vocab_head.choose_ids(ranking, 10, 10, [2]).tolist() == list(range(10))


@pytest.mark.parametrize("k", [None, 0, -3])  # None: one more than the vocabulary
def test_bad_head_sizes_are_one_line_errors(tiny_pair, k):
    with pytest.raises(ValueError, match="head size") as e:
        vocab_head.sub_head(tiny_pair, tiny_pair.vocab_size + 1 if k is None else k)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="must be an integer"):
        parse_proposers("draft:vocab=many")


def test_too_big_head_names_the_vocabulary(tiny_pair):
    V = tiny_pair.vocab_size
    with pytest.raises(ValueError, match=f"head size {V + 1} exceeds the vocabulary {V}"):
        _gen(tiny_pair, encode_prompt(tiny_pair.tokenizer, PROMPTS[0], chat=True), f"fixed:2@draft:vocab={V + 1}",
             max_new_tokens=4)


def test_ranking_file_loads_and_covers_eos():
    data = vocab_head.load_file(str(vocab_head.RANK_FILE))
    rank, counts = data["rank"].long(), data["count"]
    assert vocab_head.RANK_FILE.stat().st_size < 1 << 20
    assert sorted(rank.tolist()) == list(range(49152))  # a permutation of SmolLM2's ids
    assert 2 in rank[:32].tolist()  # <|im_end|>, the embedded model's EOS, among the forced specials
    top = rank[32:1000]  # past the specials, counts fall
    assert bool((counts[top][:-1] >= counts[top][1:]).all()) and int(counts.sum()) > 1_000_000


def test_sub_head_is_cached_on_the_pair_and_slices_the_head(tiny_pair):
    h = vocab_head.sub_head(tiny_pair, 16)
    assert vocab_head.sub_head(tiny_pair, 16) is h and h.weight.is_contiguous()
    assert set(tiny_pair.eos_ids) <= set(h.ids.tolist())
    w = tiny_pair.draft.get_output_embeddings().weight
    assert torch.equal(h.weight, w[h.ids])
    assert dataclasses.replace(tiny_pair).vocab_heads == {}  # another pair (another draft): its own heads


@torch.inference_mode()
def test_sub_head_logits_are_the_full_heads_rows(tiny_pair):
    """Same state, same rows: the sub-head's logits equal the full head's at its ids, read at once
    or in pieces (the draft's row invariance with the body-only read)."""
    ids = encode_prompt(tiny_pair.tokenizer, PROMPTS[1], chat=True)
    h = vocab_head.sub_head(tiny_pair, 24)
    full, _ = forward_logits(tiny_pair.draft, ids, None, 1, tiny_pair.vocab_size, gather=True)  # [1, V]
    sub, _ = draft_read(tiny_pair, ids, None, h)  # [1, K]
    torch.testing.assert_close(sub, full[:, h.ids], rtol=1e-5, atol=1e-5)
    cut = len(ids) - 3
    _, cache = draft_read(tiny_pair, ids[:cut], None, h)
    pieces = [draft_read(tiny_pair, [t], cache, h)[0] for t in ids[cut:]][-1]
    if tiny_pair.draft_row_invariant:
        assert torch.equal(pieces, sub)


@pytest.mark.parametrize("k", [8, 32, 64])
def test_greedy_output_is_unchanged(tiny_pair, k):
    for prompt in PROMPTS[:3]:
        ids = encode_prompt(tiny_pair.tokenizer, prompt, chat=True)
        assert _gen(tiny_pair, ids, f"fixed:3@draft:vocab={k}", max_new_tokens=30).token_ids == _hf_greedy(tiny_pair, ids, 30)


def test_greedy_draft_is_the_argmax_over_the_head(tiny_pair):
    ids = encode_prompt(tiny_pair.tokenizer, PROMPTS[2], chat=True)
    h = vocab_head.sub_head(tiny_pair, 8)
    sampler = Sampler(0.0, 1.0, 0, tiny_pair.device)
    with torch.inference_mode():
        proposer = DraftModelProposer(tiny_pair, ids[:-1], sampler, head=h)
        proposer.update(0, ids[-1:])  # as after a prefill: the newest token pending
        drafted = proposer.propose(1, _always)
        full, _ = forward_logits(tiny_pair.draft, ids, None, 1, tiny_pair.vocab_size, gather=True)
    assert drafted[0].token_id == int(h.ids[full[0, h.ids].argmax()])


def test_rejection_sampling_with_p_zero_off_the_head_preserves_the_target_law():
    """Synthetic: the draft's law lives on 3 of 10 ids, the target's on all; the emitted tokens
    follow q (the residual max(0, q − p) supplies the ids the draft cannot propose)."""
    gen = torch.Generator().manual_seed(0)
    V, N = 10, 20000
    head = vocab_head.build(torch.randn(V, 4), 3, V, [], ranking=torch.tensor([7, 1, 4]))
    q = torch.softmax(torch.randn(2, V, generator=gen), -1)  # [k+1, V]
    p = head.spread(torch.softmax(torch.randn(3, generator=gen), -1), V)[None]  # [1, V]
    assert p[0, ~head.t2d].abs().sum() == 0 and head.ids.tolist() == [1, 4, 7]
    out = []
    for _ in range(N):
        x = int(torch.multinomial(p[0], 1, generator=gen))
        n, nxt = rejection_sample([x], p, q, gen)
        out.append(x if n else nxt)
    assert _chi2_pvalue(out, q[0]) > 1e-3


@pytest.mark.slow
@torch.inference_mode()
def test_sampling_with_a_small_head_follows_the_target_law(tiny_pair):
    """End to end: one verify step repeated (rewound after each) with a 6-token draft head: its p
    is zero off those 6 ids, the target's law is not; the first emitted token must still follow
    the target's law."""
    T, N, K = 1.0, 1500, 6
    pair = dataclasses.replace(tiny_pair, eos_ids=frozenset())
    V = pair.vocab_size
    ids = encode_prompt(pair.tokenizer, CHARS[:20], chat=True)
    sampler = Sampler(T, 1.0, 0, pair.device)
    head = vocab_head.sub_head(pair, K)
    verifier, proposer = TargetVerifier(pair, ids, sampler), DraftModelProposer(pair, ids, sampler, head=head)
    first = verifier.prefill()
    proposer.update(0, [first])
    q = warp(pair.target(torch.tensor([ids + [first]])).logits[0, -1, :V], T, 1.0)  # [V]
    off = ~head.t2d
    assert float(q[off].sum()) > 0.3  # most of the target's mass lies off the head: the residual carries it
    out, accepted = [], 0
    for _ in range(N):
        drafted = proposer.propose(1, _always)
        assert float(drafted[0].p[off].abs().sum()) == 0.0 and bool(head.t2d[drafted[0].token_id])
        n, emitted = verifier.verify(drafted)
        out.append(emitted[0])
        accepted += n
        verifier.rewind(len(ids) + 1)
        proposer.rewind(len(ids), [first])
    assert 0 < accepted < N
    assert _chi2_pvalue(out, q) > 1e-3


def test_bench_heads_reports_every_size(tiny_pair):
    from bench.heads import format_report, measure

    res = measure(tiny_pair, (8, 0), agree_per_task=1, live_prompts=1, max_new=6, agree_tokens=6, reps=2)
    rows = {r["head"]: r for r in res["rows"]}
    assert set(rows) == {"8", "full"} and rows["full"]["coverage"] == 1.0 and rows["8"]["coverage"] <= 1.0
    assert rows["8"]["agreement"] <= rows["8"]["coverage"] and all(r["tau_at_4"] >= 1.0 for r in rows.values())
    assert "full" in format_report(res)


def test_cost_tables_price_the_draft_through_the_head_its_runs_read(tiny_pair, monkeypatch):
    """measure_costs times the draft as a run's proposer reads it: through the pair's default
    sub-head (the embedded draft's 8,192 rows), not the full head (which doubled the draft's price
    at bf16 here: 6.0 ms a token in the table against 3.2 ms live), in its drafted token and both
    catch-up reads alike."""
    from engine.lab import profiling
    from engine.oracles import draft as oracle_draft
    from engine.oracles import draft_head

    pair = dataclasses.replace(tiny_pair, draft_vocab=tiny_pair.vocab_size // 2)
    head = draft_head(pair)
    assert head is vocab_head.sub_head(pair, pair.vocab_size // 2) and draft_head(tiny_pair) is None
    heads = []

    def spy(p, ids, cache, h=None):
        heads.append(h)
        return draft_read(p, ids, cache, h)

    monkeypatch.setattr(profiling, "draft_read", spy)  # the catch-up reads
    monkeypatch.setattr(oracle_draft, "draft_read", spy)  # the proposer's own reads
    costs = profiling.measure_costs(pair, buckets=(8,), reps=1, proposers=("draft",))
    assert heads and all(h is head for h in heads), {type(h).__name__ for h in heads}
    assert costs.drafting("draft").ms[0] > 0


def test_an_int8_draft_scores_its_sub_head_in_int8():
    """A draft that reads its body in int8 (bf16 on a CPU) scores its sub-head through the same
    kernel: its rows int8 with a scale each, the logits what the bf16 rows give to int8 rounding.
    Asked for an fp32 head, or for a draft that does not read int8, the head stays as it was."""
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(300, 64, generator=gen).bfloat16()
    head = vocab_head.build(emb, 100, 300, [2], ranking=torch.randperm(300, generator=gen), int8=True)
    q, scale = head.int8
    assert q.dtype == torch.int8 and q.shape == head.weight.shape and scale.shape == (100,)
    h = torch.randn(1, 64, generator=gen)
    want = (h.bfloat16().float() @ head.weight.float().t())  # [1, K]
    got = head.logits(h)
    assert got.shape == (1, 100) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0.0)
    assert vocab_head.build(emb, 100, 300, [2], int8=False).int8 is None
    assert vocab_head.build(emb.float(), 100, 300, [2], int8=True).int8 is None  # fp32: no int8 kernel


def test_a_draft_on_the_row_invariant_kernels_scores_its_sub_head_through_them():
    """A draft whose body reads the row-invariant kernels scores its sub-head there too (bf16 rows
    in AMX tiles where the CPU has them): fp32 scores of the head's own bf16 rows, one routine for
    every scoring. Without the kernels, or for a width they do not read, the head stays a gemv."""
    from engine.runtime.kernels import rowdot

    if rowdot.unavailable() is not None:
        pytest.skip(rowdot.unavailable())
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(300, 64, generator=gen).bfloat16()
    head = vocab_head.build(emb, 96, 300, [2], ranking=torch.randperm(300, generator=gen), row=True)
    assert isinstance(head.row, rowdot.RowLinear) and head.int8 is None
    assert (head.row.tensors[0].dim() == 4) == rowdot.amx()  # tiles where AMX reads them
    h = torch.randn(1, 64, generator=gen).bfloat16()
    want = h.float() @ head.weight.float().t()  # [1, K]
    got = head.logits(h)
    assert got.shape == (1, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0.0)
    assert torch.equal(head.logits(h.clone()), got)
    assert vocab_head.build(torch.randn(300, 40).bfloat16(), 96, 300, [2], row=True).row is None  # width 40


def test_a_draft_that_does_not_read_int8_keeps_a_plain_sub_head(tiny_pair):
    pair = dataclasses.replace(tiny_pair)  # a fresh dict of heads
    assert vocab_head.sub_head(pair, pair.vocab_size // 2).int8 is None
