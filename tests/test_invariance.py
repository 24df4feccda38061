"""The draft's row-invariant forward (engine/runtime/invariance.py): reads of any chunking agree bit for
bit, attention still computes attention, and a model the probe rejects is left as it was."""
import pytest
import torch

from engine.oracles.draft import draft_read
from engine.runtime import invariance
from engine.runtime.forward import BODY, crop_to, forward_last_state, forward_logits
from engine.runtime.kv.cache import new_cache


def _tiny(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    from tiny import save_tiny_llama

    path = save_tiny_llama(tmp_path / "m", seed=3, layers=2, hidden=64)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def test_rowinv_attention_is_causal_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module:
        num_key_value_groups, is_causal = 3, True

    gen = torch.Generator().manual_seed(0)
    past, q_len = 11, 5
    q = torch.randn(1, 6, q_len, 16, generator=gen)  # [B, H, q, D]
    k, v = (torch.randn(1, 2, past + q_len, 16, generator=gen) for _ in range(2))  # [B, Hkv, kv, D]
    mask = (torch.arange(past + q_len)[None, :] <= torch.arange(q_len)[:, None] + past)[None, None]
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask)
    got, _ = invariance.rowinv_attention(Module(), q, k, v, None)
    assert got.shape == want.shape == (1, q_len, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariant_reads_agree_in_any_chunking(tmp_path, dtype):
    model = _tiny(tmp_path, dtype)
    ids = torch.randint(5, 80, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        exact, _ = forward_logits_of(_tiny(tmp_path, torch.float64), ids)
        plain_logits, _ = forward_logits_of(model, ids)
        if not invariance.make_row_invariant(model):
            # Some CPUs round some row counts differently whatever the padding (fp32 on this one):
            # then the probe must leave HF's forward in place, and the pair reads row by row
            # (test_the_pair_reads_its_draft_in_chunks_that_match_one_at_a_time covers that path).
            assert model.config._attn_implementation == "sdpa"
            assert torch.equal(forward_logits_of(model, ids)[0], plain_logits)
            return
        inv_logits, _ = forward_logits_of(model, ids)
        # The same model, only rounded differently: no further from float64 than HF's own forward.
        err_plain, err_inv = ((lg.double() - exact).abs().max() for lg in (plain_logits, inv_logits))
        assert err_inv <= 1.5 * err_plain + 1e-6, (err_inv, err_plain)
        reads = [_read_in(model, ids, chunks) for chunks in ([1] * 100, [100], [3, 30, 67], [64, 36])]
    for logits, kv in reads[1:]:
        assert torch.equal(logits, reads[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kv, reads[0][1]))


def test_a_rejected_model_is_left_as_it_was(tmp_path, monkeypatch):
    model = _tiny(tmp_path, torch.float32)
    ids = list(range(5, 40))
    with torch.inference_mode():
        before, _ = forward_logits_of(model, ids)
    monkeypatch.setattr(invariance, "_reads_agree", lambda m: False)
    assert not invariance.make_row_invariant(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert getattr(model, BODY, None) is None  # nor the lean body read
    with torch.inference_mode():
        after, _ = forward_logits_of(model, ids)
    assert torch.equal(before, after)


def test_the_pair_reads_its_draft_in_chunks_that_match_one_at_a_time(tiny_pair):
    """Live catch-up (several tokens) lands where a trace (one at a time) does, whichever way the
    draft reads (row-invariant chunks where the load-time probe allowed it, row by row else)."""
    ids = [5 + (7 * i) % 70 for i in range(90)]
    with torch.inference_mode():
        _, one = forward_logits(tiny_pair.draft, ids[:10], None, 1, tiny_pair.vocab_size, gather=True)
        for t in ids[10:]:
            single, one = draft_read(tiny_pair, [t], one)
        _, many = forward_logits(tiny_pair.draft, ids[:10], None, 1, tiny_pair.vocab_size, gather=True)
        chunked, many = draft_read(tiny_pair, ids[10:], many)  # 80 tokens: more than CATCHUP_ROWS
        assert torch.equal(single, chunked)
        crop_to(one, 50), crop_to(many, 50)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(one.layers, many.layers))


def forward_logits_of(model, ids):
    out = model(input_ids=torch.tensor([ids]), cache=new_cache(model), use_cache=True)
    return out.logits[0].float(), out.cache  # [S, V]


def _read_in(model, ids, chunks):
    cache, pos = new_cache(model), 20
    out = model(input_ids=torch.tensor([ids[:pos]]), cache=cache, use_cache=True, logits_to_keep=1)
    for n in chunks:
        out = model(input_ids=torch.tensor([ids[pos : pos + n]]), cache=out.cache, use_cache=True, logits_to_keep=1)
        pos += n
    return out.logits[0, -1], [t for layer in out.cache.layers for t in (layer.keys, layer.values)]


def test_an_int8_stored_draft_reads_through_the_int8_kernel_row_invariant(tmp_path):
    """A SpecLab draft loaded for decoding at bf16 on a CPU keeps its int8-stored matrices and
    reads them through torch's int8 weight-only kernel: each linear computes rows · int8ᵀ · scale
    (what its dequantized weight holds, to bf16 rounding), the row-invariance probe takes it, and
    reads in any chunking agree bit for bit. At fp32, or loaded for training, nothing changes."""
    from transformers import AutoModelForCausalLM

    from engine.runtime import draft_model as draftlib
    from tiny import save_tiny_llama

    target = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "t", seed=3, layers=2, hidden=64)).eval()
    emb = target.get_input_embeddings().weight.detach().float()
    draftlib.save_draft(draftlib.build_draft(target, [0, 1]), tmp_path / "d", {"target_fingerprint": draftlib.fingerprint(emb)})
    cpu = torch.device("cpu")
    draft = draftlib.load_draft(tmp_path / "d", emb, cpu, torch.bfloat16, int8=True)
    linears = [m for m in draft.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.speclab_int8[0].dtype == torch.int8 for m in linears)
    gen = torch.Generator().manual_seed(0)
    assert invariance.make_row_invariant(draft)
    for m in linears:
        x = torch.randn(3, m.in_features, generator=gen).bfloat16()
        want = torch.nn.functional.linear(x.float(), m.weight.float())  # the dequantized weight
        torch.testing.assert_close(m(x).float(), want, atol=0.02, rtol=0.02)
    ids = torch.randint(5, 80, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        reads = [_read_in(draft, ids, chunks) for chunks in ([1] * 100, [100], [3, 30, 67])]
    for logits, kv in reads[1:]:
        assert torch.equal(logits, reads[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kv, reads[0][1]))
    for dtype, int8 in ((torch.float32, True), (torch.bfloat16, False)):
        other = draftlib.load_draft(tmp_path / "d", emb, cpu, dtype, int8=int8)
        assert not any(hasattr(m, "speclab_int8") for m in other.modules())


def _lean_and_hf_reads(model, ids, chunks):
    """(lean, HF) reads of `ids` after a 20-token prompt in `chunks`, each: the states and
    full-head logits of every read's last token, and the cache's keys and values."""
    def reads():
        out, (state_cache, logit_cache) = [], (None, None)
        for i, n in enumerate([20] + chunks):
            start = 20 + sum(chunks[: i - 1]) if i else 0
            state, state_cache = forward_last_state(model, ids[start : start + n], state_cache)
            logits, logit_cache = forward_logits(model, ids[start : start + n], logit_cache, 1, gather=True)
            out += [state, logits]
        return out + [t for layer in state_cache.layers for t in (layer.keys, layer.values)]

    with torch.inference_mode():
        lean = reads()
        body = model.__dict__.pop(BODY)  # HF's own forward, patched row-invariant
        try:
            hf = reads()
        finally:
            setattr(model, BODY, body)
    return lean, hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_body_reads_bit_for_bit_what_hf_reads(tmp_path, dtype):
    """A row-invariant draft reads through the lean body (engine/runtime/lean_body.py): the same
    operations as HF's forward without its machinery, so every state, logit and cached key is
    HF's bit for bit, in any chunking; an int8 draft's q/k/v and gate/up read as one product."""
    from transformers import AutoModelForCausalLM

    from engine.runtime import draft_model as draftlib
    from tiny import save_tiny_llama

    target = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "t", seed=3, layers=2, hidden=64)).eval()
    emb = target.get_input_embeddings().weight.detach().float()
    draftlib.save_draft(draftlib.build_draft(target, [0, 1]), tmp_path / "d", {"target_fingerprint": draftlib.fingerprint(emb)})
    int8_draft = draftlib.load_draft(tmp_path / "d", emb, torch.device("cpu"), torch.bfloat16, int8=True)
    models = [int8_draft, _tiny(tmp_path, dtype)]
    ids = torch.randint(5, 80, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    for model in models:
        if not invariance.make_row_invariant(model):
            assert model is not int8_draft  # the int8 kernel rounds every row alike (test above)
            continue
        body = getattr(model, BODY)
        stacked = model is int8_draft
        assert all((s is not None) == stacked for s in body.qkv + body.gate_up)
        for chunks in ([1] * 12, [12], [3, 1, 8], [60]):
            lean, hf = _lean_and_hf_reads(model, ids, chunks)
            assert len(lean) == len(hf) and all(torch.equal(a, b) for a, b in zip(lean, hf)), chunks
