import torch
from transformers.cache_utils import DynamicLayer

from engine.kv.cache import GrowingCache, GrowingLayer, new_cache


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
