"""Cross-request prefix reuse: the cache's budget, LRU order and collision safety, and greedy
output with reuse (miss, partial hit, exact repeat, after an eviction) equal to output without."""
import threading

import pytest
import torch

from engine.decode.policies import POLICY_EXAMPLES, make_policy
from engine.lab.generation import GenConfig, Generation, encode_messages, encode_prompt
from engine.runtime.prefix import cache as pc
from engine.runtime.prefix.cache import Entry, PrefixCache
from tiny import synthetic_context

KEY = ("target", "fp32", "draft", "fp32", "cpu", False)


def entry(tokens, key=KEY, positions=None) -> Entry:
    n = len(tokens) if positions is None else positions
    kv = [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]  # 2 × 32 bytes a position
    return Entry(key, tuple(tokens), kv, len(tokens), torch.zeros(8))


def test_budget_must_be_positive():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="budget must be > 0"):
            PrefixCache(bad)


def test_lru_eviction_keeps_bytes_under_the_budget():
    size = entry(range(10)).nbytes
    cache = PrefixCache(budget_bytes=2 * size + 1)  # room for two
    a, b, c, d = (entry([i] * 10) for i in (1, 2, 3, 4))
    assert cache.put(a) and cache.put(b)
    assert cache.lookup(KEY, [1] * 10).kind == "exact"  # a is now the most recently used
    assert cache.put(c)  # evicts b, the least recently used
    assert [e.tokens[0] for e in cache.entries()] == [1, 3]
    assert cache.put(d)  # evicts a
    assert [e.tokens[0] for e in cache.entries()] == [3, 4]
    s = cache.stats()
    assert s["evictions"] == 2 and s["bytes"] == 2 * size <= s["budget_bytes"] and s["peak_bytes"] <= s["budget_bytes"]
    assert cache.lookup(KEY, [2] * 10).kind == "miss"


def test_an_entry_over_the_budget_is_refused():
    cache = PrefixCache(budget_bytes=100)
    assert not cache.put(entry(range(10)))
    assert cache.stats()["refused"] == 1 and cache.stats()["bytes"] == 0


def test_hits_take_the_verified_common_prefix():
    cache = PrefixCache()
    cache.put(entry([7] * 16 + [1, 2, 3, 4]))
    exact = cache.lookup(KEY, [7] * 16 + [1, 2, 3, 4])
    assert (exact.kind, exact.reused) == ("exact", 20) and exact.logits is not None
    longer = cache.lookup(KEY, [7] * 16 + [1, 2, 3, 4, 5, 6])
    assert (longer.kind, longer.reused) == ("partial", 20)
    forks = cache.lookup(KEY, [7] * 16 + [1, 9])
    assert (forks.kind, forks.reused) == ("partial", 17)
    shorter = cache.lookup(KEY, [7] * 16 + [1, 2])  # a prefix of the stored prompt: its last token recomputed
    assert (shorter.kind, shorter.reused) == ("partial", 17) and shorter.logits is None
    assert cache.lookup(KEY, [8] * 20).kind == "miss"


def test_equal_digests_never_hand_out_another_prompts_state(monkeypatch):
    monkeypatch.setattr(pc, "digest", lambda key, tokens: b"same-bucket!")  # every entry collides
    cache = PrefixCache()
    cache.put(entry([1, 2, 3, 4]))
    cache.put(entry([5, 6, 7, 8]))
    cache.put(entry([1, 2, 3, 4], key=("another pair",)))
    hit = cache.lookup(KEY, [5, 6, 9])
    assert (hit.kind, hit.reused, hit.entry.tokens) == ("partial", 2, (5, 6, 7, 8))
    assert cache.lookup(KEY, [9, 9, 9]).kind == "miss"
    assert cache.lookup(("a third pair",), [1, 2, 3, 4]).kind == "miss"  # another session's model


def test_sessions_share_the_cache_from_threads():
    cache, errors = PrefixCache(budget_bytes=entry(range(10)).nbytes * 5), []

    def session(i: int) -> None:
        try:
            for j in range(50):
                cache.put(entry([i, j] + [0] * 8))
                hit = cache.lookup(KEY, [i, j] + [0] * 8)
                assert hit.kind == "miss" or hit.entry.tokens[:2] == (i, j)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and cache.stats()["bytes"] <= cache.budget


def _run(pair, ids, spec, cache, reuse=True, max_new=24):
    cfg = GenConfig(max_new_tokens=max_new, reuse=reuse)
    return Generation(pair, ids, make_policy(spec, synthetic_context()), cfg, prefix=cache).run()


@pytest.mark.parametrize("spec", POLICY_EXAMPLES)
def test_greedy_output_with_reuse_equals_output_without(tiny_pair, spec):
    tok = tiny_pair.tokenizer
    system = {"role": "system", "content": "You answer briefly. " * 6}
    first = encode_messages(tok, [system, {"role": "user", "content": "What is 2+2?"}])
    other = encode_messages(tok, [system, {"role": "user", "content": "Name a colour."}])
    plain = {tuple(ids): _run(tiny_pair, ids, "ar", None, reuse=False).token_ids for ids in (first, other)}
    cache = PrefixCache()
    kinds = []
    for ids in (first, first, other):  # a miss, an exact repeat, a partial hit on the system prompt
        g = _run(tiny_pair, ids, spec, cache)
        assert g.token_ids == plain[tuple(ids)], (spec, g.summary.prefix_hit)
        assert g.records[0].reuse == g.summary.reused_tokens
        kinds.append((g.summary.prefix_hit, g.summary.reused_tokens > 0))
    assert kinds == [("miss", False), ("exact", True), ("partial", True)]
    # After an eviction: a budget with room for one entry drops the first prompt's state.
    small = PrefixCache(budget_bytes=cache.entries()[0].nbytes * 3 // 2)
    for ids in (first, other, first):
        assert _run(tiny_pair, ids, spec, small).token_ids == plain[tuple(ids)]
    assert small.stats()["evictions"] >= 1


def test_no_reuse_neither_looks_up_nor_stores(tiny_pair):
    ids = encode_prompt(tiny_pair.tokenizer, "Hello there", chat=True)
    cache = PrefixCache()
    g = _run(tiny_pair, ids, "fixed:2", cache, reuse=False)
    assert (g.summary.prefix_hit, g.summary.reused_tokens) == ("off", 0)
    assert cache.stats()["lookups"] == cache.stats()["stored"] == 0


@pytest.mark.parametrize("row_invariant", [True, False])
def test_the_draft_proposes_with_reuse_what_it_proposes_cold(tiny_pair, row_invariant):
    """The draft's reused state is what reading the prompt gives, so drafts (and replay) are
    unchanged: a draft that is not row-invariant takes positions only from an exact repeat."""
    from dataclasses import replace

    pair = replace(tiny_pair, draft_row_invariant=row_invariant and tiny_pair.draft_row_invariant)
    tok = pair.tokenizer
    system = {"role": "system", "content": "You answer briefly. " * 6}
    first = encode_messages(tok, [system, {"role": "user", "content": "What is 2+2?"}])
    other = encode_messages(tok, [system, {"role": "user", "content": "Name a colour."}])
    cold = {tuple(ids): _run(pair, ids, "fixed:2", None, reuse=False) for ids in (first, other)}
    cache = PrefixCache()
    for ids in (first, first, other):
        g = _run(pair, ids, "fixed:2", cache)
        assert [r.entropies for r in g.records] == [r.entropies for r in cold[tuple(ids)].records], g.summary.prefix_hit


@pytest.mark.parametrize("kv_tier", ["fp8", "int8"])
def test_reuse_at_a_kv_tier_gives_what_a_cold_read_gives(tiny_pair, kv_tier):
    """An entry holds the target's KV in the tier's stored form (codes and scales) under a key
    naming the tier: filled into a fresh cache it is what reading the prompt cold gave, bit for
    bit, and a run at another KV tier never takes it."""
    tok = tiny_pair.tokenizer
    system = {"role": "system", "content": "You answer briefly. " * 6}
    first = encode_messages(tok, [system, {"role": "user", "content": "What is 2+2?"}])
    other = encode_messages(tok, [system, {"role": "user", "content": "Name a colour."}])

    def run(ids, spec, cache, kv, reuse=True):
        cfg = GenConfig(max_new_tokens=24, reuse=reuse, kv_tier=kv)
        return Generation(tiny_pair, ids, make_policy(spec, synthetic_context()), cfg, prefix=cache).run()

    cold = {tuple(ids): run(ids, "ar", None, kv_tier, reuse=False).token_ids for ids in (first, other)}
    cache = PrefixCache()
    native = run(first, "fixed:4", cache, "native")
    assert native.summary.prefix_hit == "miss"
    kinds = []
    for spec in ("fixed:4", "heuristic"):
        for ids in (first, first, other):  # a miss, an exact repeat, a partial hit; then all stored
            g = run(ids, spec, cache, kv_tier)
            assert g.token_ids == cold[tuple(ids)], (spec, g.summary.prefix_hit)
            kinds.append(g.summary.prefix_hit)
    assert kinds == ["miss", "exact", "partial", "exact", "exact", "exact"]
    tiered = [e for e in cache.entries() if e.key[-1] == kv_tier]
    plain = [e for e in cache.entries() if e.key[-1] == "native"]
    assert tiered and plain and all(isinstance(k, pc.Quantized) for e in tiered for k, _ in e.kv)
    per_position = lambda e: pc.kv_bytes(e.kv) / len(e.tokens)  # noqa: E731
    assert per_position(tiered[0]) < per_position(plain[0]) / 3  # 72 or 80 bytes a position, not 256


def test_evicted_entries_spill_to_the_slow_tier_and_come_back(tmp_path):
    from engine.runtime.kv.offload import SlowTier

    size = entry(range(10)).nbytes
    cache = PrefixCache(budget_bytes=size + 1, spill=pc.Spill(SlowTier(tmp_path), budget_bytes=10 * size, window=4))
    a, b = entry(range(10)), entry(range(20, 30))
    a.kv[0][0].normal_()  # distinct numbers, to see them come back bit for bit
    want = a.kv[0][0].clone()
    assert cache.put(a) and cache.put(b)  # b evicts a: spilled, not gone
    s = cache.stats()
    assert (s["spilled"], s["spilled_entries"], s["entries"]) == (1, 1, 1) and len(list(tmp_path.glob("*.kvw"))) == 3
    hit = cache.lookup(KEY, list(range(10)))
    assert hit.kind == "exact" and torch.equal(hit.entry.kv[0][0], want)  # restored, and b spilled in turn
    s = cache.stats()
    assert (s["spill_hits"], s["spilled_entries"], s["entries"]) == (1, 1, 1) and s["bytes"] <= s["budget_bytes"]
    # A corrupt spilled window: the stub is dropped and the lookup is a miss, never wrong state.
    for f in tmp_path.glob("*.kvw"):
        blob = bytearray(f.read_bytes())
        blob[-1] ^= 0xFF
        f.write_bytes(bytes(blob))
    assert cache.lookup(KEY, list(range(20, 30))).kind == "miss"
    assert cache.stats()["spill_errors"] == 1 and cache.stats()["spilled_entries"] == 0


def test_the_spill_tier_keeps_its_own_budget():
    from engine.runtime.kv.offload import SlowTier

    size = entry(range(10)).nbytes
    cache = PrefixCache(budget_bytes=size + 1, spill=pc.Spill(SlowTier(), budget_bytes=size + 200, window=10))
    for i in range(4):
        cache.put(entry([i] * 10))
    s = cache.stats()
    assert s["spilled"] == 3 and s["spilled_entries"] == 1 and s["spill_dropped"] == 2 and s["spill_bytes"] <= size + 200
    assert cache.lookup(KEY, [0] * 10).kind == "miss" and cache.lookup(KEY, [2] * 10).kind == "exact"


@pytest.mark.parametrize("kv_tier", ["native", "fp8"])
def test_greedy_output_after_a_spilled_hit_equals_output_without_reuse(tiny_pair, tmp_path, kv_tier):
    from engine.runtime.kv.offload import SlowTier

    ids_a = encode_prompt(tiny_pair.tokenizer, "Tell me a story about a cat.", chat=True)
    ids_b = encode_prompt(tiny_pair.tokenizer, "2+2=", chat=True)
    cfg = GenConfig(max_new_tokens=24, kv_tier=kv_tier)
    cold = Generation(tiny_pair, ids_a, make_policy("fixed:3"), GenConfig(max_new_tokens=24, kv_tier=kv_tier, reuse=False)).run()
    cache = PrefixCache(budget_bytes=1 << 30, spill=pc.Spill(SlowTier(tmp_path), budget_bytes=1 << 30, window=8))
    Generation(tiny_pair, ids_a, make_policy("fixed:3"), cfg, prefix=cache).run()
    cache.budget = cache.entries()[0].nbytes + 1  # room for one run's entry: the next one evicts it
    Generation(tiny_pair, ids_b, make_policy("fixed:3"), cfg, prefix=cache).run()
    assert cache.stats()["spilled"] == 1
    again = Generation(tiny_pair, ids_a, make_policy("fixed:3"), cfg, prefix=cache).run()
    assert again.summary.prefix_hit == "exact" and cache.stats()["spill_hits"] == 1
    assert again.token_ids == cold.token_ids


def test_the_workbench_cache_spills_to_a_folder_of_its_own():
    from pathlib import Path

    size = entry(range(10)).nbytes
    cache = pc.spilling(size + 1, window=5)
    folder = Path(cache.spill.slow.folder)
    cache.put(entry(range(10)))
    cache.put(entry(range(10, 20)))
    assert len(list(folder.glob("*.kvw"))) == 2 and cache.stats()["spill_bytes"] <= 4 * (size + 1)
    assert cache.lookup(KEY, list(range(10))).kind == "exact"
    del cache
    import gc

    gc.collect()
    assert not folder.exists()  # the temporary folder goes with the cache


# ---- the disk tier: entries across processes (engine/runtime/prefix/disk.py) ------------------------

def _disk(folder, budget=1 << 30, identity="", warn=None):
    from engine.runtime.prefix.disk import PrefixDisk

    return PrefixDisk(folder, budget, identity, warn=warn if warn is not None else (lambda m: None))


def test_the_disk_tier_evicts_the_least_recently_used_under_its_byte_budget(tmp_path):
    disk = _disk(tmp_path)
    assert disk.save(entry([1] * 20))
    size = disk.stats()["bytes"]
    disk.budget_bytes = 2 * size + size // 2  # room for two (equal token counts: equal sizes)
    assert disk.save(entry([2] * 20))
    assert disk.find(KEY, [1] * 20) is not None  # a use: [2]*20 is now the least recently used
    assert disk.save(entry([3] * 20))  # evicts [2]*20, not [1]*20 (written first, used since)
    s = disk.stats()
    assert (s["entries"], s["evictions"]) == (2, 1) and s["bytes"] <= disk.budget_bytes
    assert disk.find(KEY, [2] * 20) is None
    assert disk.find(KEY, [1] * 20) is not None and disk.find(KEY, [3] * 20) is not None
    disk.budget_bytes = size // 2  # an entry over the whole budget is not written at all
    assert not disk.save(entry([4] * 20)) and disk.stats()["refused"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "checksum"])
def test_a_damaged_disk_entry_is_removed_with_one_warning_and_read_as_a_miss(tmp_path, damage):
    warnings: list[str] = []
    disk = _disk(tmp_path, warn=warnings.append)
    stored = entry([5] * 20)
    stored.kv[0][0].normal_()
    assert disk.save(stored)
    [path] = disk.entries()
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) - 40] ^= 0xFF  # inside the arrays
    elif damage == "truncate":
        del blob[len(blob) // 2:]
    else:
        at = blob.index(b'"speclab.checksum":"') + len(b'"speclab.checksum":"')
        blob[at] = ord("0") if blob[at] != ord("0") else ord("1")
    path.write_bytes(bytes(blob))
    cache = PrefixCache(disk=disk)
    assert cache.lookup(KEY, [5] * 20).kind == "miss"  # never an exception, never the damaged state
    assert len(warnings) == 1 and path.name in warnings[0] and warnings[0].startswith("warning: "), warnings
    assert not path.exists() and disk.stats()["damaged"] == 1
    assert cache.lookup(KEY, [5] * 20).kind == "miss" and len(warnings) == 1  # gone: nothing more to say


def test_a_disk_entry_under_another_identity_is_not_taken(tmp_path):
    """The identity (the weights behind the names, torch, threads) is part of the key: an entry
    a process left for other weights at the same path is never handed out."""
    _disk(tmp_path, identity="weights-a").save(entry([6] * 20))
    assert _disk(tmp_path, identity="weights-b").find(KEY, [6] * 20) is None
    assert _disk(tmp_path, identity="weights-a").find(KEY, [6] * 20) is not None


def _same_kv(a, b) -> bool:
    def parts(kv):
        return [t for k, v in kv for q in (k, v) for t in ((q.codes, q.scale) if isinstance(q, pc.Quantized) else (q,))]

    return all(x is None and y is None or torch.equal(x, y) for x, y in zip(parts(a), parts(b), strict=True))


@pytest.mark.parametrize("kv_tier", ["native", "fp8", "int8"])
def test_a_later_process_takes_the_prefix_from_disk_bit_for_bit(tiny_pair, tmp_path, kv_tier):
    """Each PrefixCache stands for one CLI process: its memory starts empty, the folder is shared.
    The entry read back is the one stored, bit for bit (target KV in the tier's stored form,
    logits, draft KV), and greedy output with it equals output without reuse."""
    from engine.runtime.prefix.disk import PrefixDisk, pair_identity

    tok = tiny_pair.tokenizer
    system = {"role": "system", "content": "You answer briefly. " * 6}
    first = encode_messages(tok, [system, {"role": "user", "content": "What is 2+2?"}])
    other = encode_messages(tok, [system, {"role": "user", "content": "Name a colour."}])
    identity = pair_identity(tiny_pair)

    def process() -> PrefixCache:
        return PrefixCache(disk=PrefixDisk(tmp_path, 1 << 30, identity, tiny_pair.device))

    def run(ids, cache, reuse=True):
        cfg = GenConfig(max_new_tokens=24, reuse=reuse, kv_tier=kv_tier)
        return Generation(tiny_pair, ids, make_policy("fixed:3", synthetic_context()), cfg, prefix=cache).run()

    cold = {tuple(ids): run(ids, None, reuse=False).token_ids for ids in (first, other)}
    one = process()
    assert run(first, one).summary.prefix_hit == "miss"
    [kept] = one.entries()
    found = process().disk.find(kept.key, first)
    assert found is not None and found.tokens == kept.tokens and found.n_prompt == kept.n_prompt
    assert _same_kv(found.kv, kept.kv) and torch.equal(found.logits, kept.logits)
    assert found.draft_len == kept.draft_len > 0 and _same_kv(found.draft_kv, kept.draft_kv)
    for ids, kind in ((first, "exact"), (other, "partial")):
        g = run(ids, process())
        assert (g.summary.prefix_hit, g.summary.reused_tokens > 0) == (kind, True)
        assert g.token_ids == cold[tuple(ids)], kind
