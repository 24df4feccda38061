import torch
from transformers.cache_utils import DynamicLayer

from engine.runtime.kv.cache import GrowingCache, GrowingLayer, new_cache


def test_growing_layer_matches_dynamic_layer_through_updates_and_crops():
    torch.manual_seed(0)
    grow, ref = GrowingLayer(), DynamicLayer()
    for n, crop in [(300, 0), (1, 0), (9, -6), (5, 0), (1, -1), (200, -150), (2, 0)]:
        k, v = torch.randn(1, 3, n, 8), torch.randn(1, 3, n, 8)
        gk, gv = grow.update(k, v)
        rk, rv = ref.update(k, v)
        assert torch.equal(gk, rk) and torch.equal(gv, rv)
        grow.crop(crop), ref.crop(crop)
        assert grow.get_seq_length() == ref.get_seq_length()
        assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)


def test_new_cache_picks_growing_for_full_attention(tiny_pair):
    assert isinstance(new_cache(tiny_pair.target), GrowingCache)


# -- KV tiers (engine/runtime/kv/tiers.py) ------------------------------------------------------------------
import pytest  # noqa: E402

from engine.runtime.kv import tiers as T  # noqa: E402
from engine.runtime.kv.cache import held_bytes_per_token  # noqa: E402

LOSSY = ("fp8", "int8")


def _same(a: T.Quantized, b: T.Quantized) -> bool:
    codes = lambda q: q.codes.view(torch.uint8) if q.codes.dtype == torch.float8_e4m3fn else q.codes  # noqa: E731
    return torch.equal(codes(a), codes(b)) and torch.equal(a.scale.view(torch.int16) if a.scale.dtype == torch.bfloat16
                                                           else a.scale, b.scale.view(torch.int16)
                                                           if b.scale.dtype == torch.bfloat16 else b.scale)


def _kv(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """[1, 3, n, 16] keys with per-token magnitudes over many binades and an outlier token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, n, 16, generator=g) * 10.0 ** torch.randint(-4, 4, (1, 3, n, 1), generator=g)
    x[..., 0, :] *= 50  # an attention-sink-like token
    return x.to(dtype)


@pytest.mark.parametrize("tier", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_path_independent(tier, dtype):
    """A block quantized at once equals it quantized token by token, or in uneven chunks: a
    token's stored form does not depend on the forward that wrote it."""
    x = _kv(37, dtype=dtype)
    whole = T.quantize(x, tier)
    assert whole.codes.dtype == (torch.float8_e4m3fn if tier == "fp8" else torch.int8)
    assert whole.scale.dtype == (torch.int8 if tier == "fp8" else torch.bfloat16) and whole.scale.shape == (1, 3, 37, 1)
    for cuts in ([1] * 37, [5, 1, 13, 2, 16]):
        pos, parts = 0, []
        for n in cuts:
            parts.append(T.quantize(x[..., pos : pos + n, :], tier))
            pos += n
        joined = T.Quantized(torch.cat([p.codes for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2))
        assert _same(joined, whole), cuts


@pytest.mark.parametrize("tier", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_is_idempotent(tier, dtype):
    """What attention reads at a tier quantizes to itself: a cache filled from dequantized values
    holds what the cold read held. Checked on 200 random blocks over 10 decades of scale."""
    g = torch.Generator().manual_seed(1)
    for i in range(200):
        scale = 10.0 ** (torch.rand(1, generator=g).item() * 10 - 6)
        x = (torch.randn(1, 2, 8, 32, generator=g) * scale * torch.rand(1, 2, 8, 1, generator=g) * 5).to(dtype)
        once = T.fake_quantize(x, tier)
        assert once.dtype == dtype
        # The values, not always the codes: a row whose largest code is 224 re-quantizes to
        # twice the codes under half the scale (fp8), the same numbers.
        assert torch.equal(T.dequantize(T.quantize(once, tier), tier, dtype), once), (i, scale)


def test_fake_quantize_error_is_the_tiers():
    x = _kv(64)
    rel = lambda y: ((y - x).abs() / x.abs().amax(-1, keepdim=True)).amax().item()  # noqa: E731
    # e4m3 keeps 3 mantissa bits (half a step: 2^-4 of the value) and a row's largest value
    # sits in [224, 448]; int8 rounds to half a step of amax / 127 (the bf16 scale adds 2^-9).
    assert 0 < rel(T.fake_quantize(x, "fp8")) <= 2**-4
    assert 0 < rel(T.fake_quantize(x, "int8")) <= 0.5 / 127 + 2**-8
    assert T.fake_quantize(x, "native") is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_values_round_trip_as_specified(dtype):
    big = torch.finfo(dtype).max
    rows = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],  # an all-zero head row: exact zeros, whatever its scale
        [-0.0, 0.0, -0.0, 0.0],
        [big, -big, 1.0, 0.0],  # the dtype's largest: stays finite (the code steps toward zero)
        [0.97 * big, 1.0, 2.0, 3.0],
        [1e-38, -1e-39, 0.0, 1e-40],  # tiny (fp32's smallest normals and subnormals)
        [448.0, 224.0, -1.0, 0.015625],  # exact e4m3 values under a scale of 2^0
        [127.0, -64.0, 1.0, 0.0],  # exact int8 values under a scale of 1
    ]).to(dtype)[None, None]  # [1, 1, 7, 4]
    for tier in LOSSY:
        q = T.quantize(rows, tier)
        back = T.dequantize(q, tier, dtype)
        assert back.dtype == dtype and torch.isfinite(back).all(), tier
        assert torch.equal(back[..., :2, :], rows[..., :2, :]) and (back[..., :2, :] == 0).all()
        assert torch.equal(T.fake_quantize(back, tier), back), tier  # edges are fixed points too
        top = back[0, 0, 2:4, 0].float()
        assert (top <= rows[0, 0, 2:4, 0].float()).all() and (top >= 0.9 * rows[0, 0, 2:4, 0].float()).all(), tier
        if dtype == torch.float32:  # each row's largest value keeps the tier's precision even at 1e-38
            assert abs(back[0, 0, 4, 0].item() - 1e-38) <= 1e-38 * 2**-4, tier
    fp8 = T.quantize(rows, "fp8")
    assert torch.equal(T.dequantize(fp8, "fp8", dtype)[..., 5, :], rows[..., 5, :])
    assert fp8.scale[0, 0, 5, 0].item() == 0 and fp8.scale[0, 0, 0, 0].item() == -126  # zeros: the lowest exponent
    int8 = T.quantize(rows, "int8")
    assert torch.equal(T.dequantize(int8, "int8", dtype)[..., 6, :], rows[..., 6, :])
    assert int8.scale[0, 0, 6, 0].item() == 1.0 and int8.scale[0, 0, 0, 0].item() == 0.0


@pytest.mark.parametrize("tier", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(tier, bad):
    x = _kv(4)
    x[0, 1, 2, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf") as e:
        T.quantize(x, tier)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown KV tier 'fp4'; known: native, fp8, int8"):
        T.quantize(_kv(1), "fp4")


@pytest.mark.parametrize("tier", T.KV_TIERS)
def test_tiered_layer_stores_the_compact_form_and_returns_what_attention_reads(tier):
    """Through appends, regrowth and crops: the buffers hold codes and scales, each update
    quantizes only the new tokens, and what it returns is fake_quantize of the whole context."""
    layer, ref = GrowingLayer(tier), DynamicLayer()
    torch.manual_seed(0)
    for n, crop in [(300, 0), (1, 0), (9, -6), (5, 0), (1, -1), (200, -150), (2, 0)]:
        k, v = _kv(n, seed=n), _kv(n, seed=n + 1)
        gk, gv = layer.update(k, v)
        rk, rv = ref.update(T.fake_quantize(k, tier), T.fake_quantize(v, tier))
        assert gk.dtype == torch.float32 and torch.equal(gk, rk) and torch.equal(gv, rv)
        layer.crop(crop), ref.crop(crop)
        assert layer.get_seq_length() == ref.get_seq_length()
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    codes = {"native": torch.float32, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[tier]
    scales = {"native": None, "fp8": torch.int8, "int8": torch.bfloat16}[tier]
    assert layer._k.dtype == layer._v.dtype == codes
    assert (layer._ks is None) if scales is None else layer._ks.dtype == layer._vs.dtype == scales
    k, v = layer.stored(layer.get_seq_length())
    assert k.codes.dtype == codes and k.codes.shape == (1, 3, layer.get_seq_length(), 16)


@pytest.mark.parametrize("tier", T.KV_TIERS)
def test_stored_form_restores_exactly(tier):
    cache = GrowingCache(tier, torch.float32)
    for i in range(3):
        cache.update(_kv(40, seed=i), _kv(40, seed=10 + i), i)
    cache.crop(-7)
    stored = cache.stored(25)
    fresh = GrowingCache(tier, torch.float32).restore(stored, 20)  # what the prefix cache's fill does
    assert fresh.get_seq_length() == 20
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.equal(a.keys[..., :20, :], b.keys) and torch.equal(a.values[..., :20, :], b.values)
    more_k, more_v = _kv(3, seed=99), _kv(3, seed=98)  # and it goes on as the original would
    assert all(map(torch.equal, fresh.update(more_k, more_v, 0), GrowingCache(tier, torch.float32).restore(stored, 20).update(more_k, more_v, 0)))
    if tier != "native":
        with pytest.raises(ValueError, match="cannot fill a native KV cache"):
            GrowingCache("native").restore(stored)


@pytest.mark.parametrize("tier", T.KV_TIERS)
def test_held_bytes_per_token_match_the_tier(tiny_pair, tier):
    from engine.runtime.forward import forward_logits

    model = tiny_pair.target
    cfg = model.config
    cache = new_cache(model, tier)
    forward_logits(model, list(range(5, 30)), cache, 1)
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    expect = T.bytes_per_token(tier, cfg.num_hidden_layers, heads, dim, 4)
    assert cache.bytes_per_token() == held_bytes_per_token(cache) == expect
    assert expect == {"native": 2 * 2 * 2 * 8 * 4, "fp8": 2 * 2 * 2 * 9, "int8": 2 * 2 * 2 * 10}[tier]
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer._k, layer._v, layer._ks, layer._vs)
               if t is not None)  # the buffers themselves: capacity × bytes per token
    assert held == cache.layers[0]._k.shape[-2] * expect


def test_a_lossy_tier_needs_the_growing_cache(tiny_pair):
    from transformers import AutoModelForCausalLM, MistralConfig

    sliding = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8))
    assert not isinstance(new_cache(sliding), GrowingCache)  # native: HF's own cache
    with pytest.raises(ValueError, match="KV tier fp8 needs a model whose layers all attend") as e:
        new_cache(sliding, "fp8")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown KV tier 'zip'"):
        new_cache(tiny_pair.target, "zip")
