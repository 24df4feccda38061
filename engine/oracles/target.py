"""The target as the verifier: its prefill (what the prefix cache offers taken first), one read
of [newest token, d_1 … d_k] that scores every draft prefix at once, acceptance by the sampler,
the cache rolled back to what stood, and its KV offloaded and restored between steps. The step
loop hands it only tokens (docs/architecture.md, "Oracles")."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from engine.decode.records import DraftToken
from engine.decode.tree import ROOT, DraftTree
from engine.oracles.sampling import Sampler
from engine.runtime import invariance
from engine.runtime.eagle_head import Rows
from engine.runtime.forward import crop_to, forward_logits, forward_tree_logits
from engine.runtime.kv.cache import held_bytes_per_token, new_cache
from engine.runtime.kv.calibration import CodecKit
from engine.runtime.kv.offload import Offloaded, SlowTier, Timing, drop, offload, restore
from engine.runtime.models import ModelPair
from engine.runtime.prefix.cache import Entry, Hit, PrefixCache, fill, kv_of


def target_reads(pair: ModelPair, kv_tier: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the target's reads run in at `kv_tier`: row-invariant at a lossy tier (a key
    one ULP off can cross a quantization step, so a verify must store what plain steps store),
    where the pair's target allows it; HF's own forward otherwise."""
    if kv_tier != "native" and pair.target_row_invariant:
        return invariance.row_invariant_reads
    return contextlib.nullcontext


class TargetVerifier:
    """One target forward over [newest token, d_1 … d_k] scores every draft prefix at once. With
    a prefix cache, the prefill takes what the longest stored prefix offers (engine/runtime/prefix/cache.py)."""

    plain_reuses_shape = False  # a plain step costs the same whatever read came before it

    def __init__(self, pair: ModelPair, prompt_ids: list[int], sampler: Sampler,
                 prefix: PrefixCache | None = None, kv_tier: str = "native") -> None:
        self.pair, self.sampler, self.prefix = pair, sampler, prefix
        self.kv_tier = kv_tier  # the tier of the target's KV cache (engine/runtime/kv/tiers.py)
        # At a lossy tier every read of the target runs row-invariant where the pair allows it.
        self.reads = target_reads(pair, kv_tier)
        self.tokens = list(prompt_ids)  # the context: the prompt and every emitted token
        self.n_prompt = len(prompt_ids)
        self.cache = None  # holds all of `tokens` but the newest, the next input
        self.ended = False
        self.hit = Hit("off" if prefix is None else "miss", 0)
        self._prompt_logits: torch.Tensor | None = None  # [V], kept for the prefix cache
        self._offloaded: tuple | None = None  # (manifest, slow tier, codec kit) while the cache is away
        # The target's final-norm states of the positions it read, for an EAGLE head (pair.feature_tap).
        self.feats = Rows() if pair.feature_tap is not None else None
        self.feature_start = 0  # the first position with a feature: those before came from the prefix cache
        self.restore_timing: Timing | None = None  # the last restore's, per window

    @property
    def reused(self) -> int:
        return self.hit.reused

    def prefill(self, take: Callable[[int], int] = lambda offered: offered) -> int:
        """`take(offered)`: how many of the reusable positions to take (a policy's choice)."""
        target = self.pair.target
        if self.prefix is not None:
            self.hit = self.prefix.lookup(self.key(), self.tokens)
            taken = take(self.hit.reused) if self.hit.reused else 0
            if taken < self.hit.reused:  # fewer positions than offered: no stored logits either
                self.hit = Hit("partial", taken, self.hit.entry) if taken > 0 else Hit("declined", 0)
        cache = new_cache(target, self.kv_tier)
        if self.hit.reused:
            fill(cache, self.hit.entry.kv, self.hit.reused)
        self.feature_start = cache.get_seq_length()
        if self.hit.logits is not None:  # an exact repeat: nothing left to read
            logits = self.hit.logits[None]  # [1, V]
        else:
            with self.reads():
                logits, cache = forward_logits(target, self.tokens[self.hit.reused:], cache, 1, self.pair.vocab_size)
            self._keep_features()
        self.cache, self._prompt_logits = cache, logits[0]
        first, _ = self.sampler.choose(logits[0])
        return self._emit([first])[0]

    def key(self) -> tuple:
        """Whose states a prefix-cache entry holds: the pair, its tiers (the KV tier's among them:
        an entry holds the target's KV in that tier's stored form), the device."""
        p = self.pair
        return (p.target_name, p.target_tier, p.draft_name, p.draft_tier, str(p.device), p.exact_verify, self.kv_tier)

    def remember(self, draft_cache) -> bool:
        """Stores this run's context (prompt and output, as the cache holds them) and the draft's
        state in the prefix cache; False when the budget refuses it."""
        n = len(self.tokens) - 1
        d = draft_cache.get_seq_length() if draft_cache is not None else 0
        return self.prefix.put(Entry(self.key(), tuple(self.tokens[:n]), kv_of(self.cache, n), self.n_prompt,
                                     self._prompt_logits, kv_of(draft_cache, d) if d else None, d, self.kv_tier))

    def held_bytes_per_token(self) -> int:
        """What the target's cache holds per token at its KV tier."""
        return held_bytes_per_token(self.cache)

    def offload(self, slow: SlowTier, window: int, kit: CodecKit | None = None, name: str = "gen") -> Offloaded:
        """Moves the target's cache to `slow` in windows of `window` tokens (coded with `kit`'s
        codec when given) and drops it; the next read restores it (`ensure_cache`)."""
        assert self.cache is not None and self._offloaded is None, "nothing to offload"
        n = len(self.tokens) - 1
        off = offload(kv_of(self.cache, n), self.tokens[:n], self.kv_tier, slow, name, window,
                      kit.codec(self.kv_tier) if kit else None, kit.mu(self.kv_tier) if kit else None)
        self._offloaded, self.cache = (off, slow, kit), None
        return off

    def ensure_cache(self) -> None:
        """Restores an offloaded cache (pipelined, window by window); a restore that fails raises
        and leaves the cache offloaded, never half filled."""
        if self._offloaded is None:
            return
        off, slow, kit = self._offloaded
        self.restore_timing = Timing()
        kv = restore(off, slow, kit.codec(self.kv_tier) if kit else None, kit.mu(self.kv_tier) if kit else None, self.restore_timing)
        self.cache = fill(new_cache(self.pair.target, self.kv_tier), kv, len(off.tokens))
        self._offloaded = None
        drop(off, slow)

    @contextlib.contextmanager
    def _verify_reads(self) -> Iterator[None]:
        """What a verify read runs in, a chain's or a tree's: batch-invariant where the pair verifies
        exactly, and the KV tier's reads."""
        with invariance.verifying() if self.pair.exact_verify else contextlib.nullcontext(), self.reads():
            yield

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        self.ensure_cache()
        pair, draft = self.pair, [d.token_id for d in drafted]
        with self._verify_reads():
            logits, self.cache = forward_logits(pair.target, [self.tokens[-1]] + draft, self.cache,
                                                len(draft) + 1, pair.vocab_size)  # [k+1, V]
        self._keep_features()
        p = torch.stack([d.p for d in drafted]) if drafted and not self.sampler.greedy else None  # [k, V]
        n, nxt = self.sampler.accept(draft, p, logits)
        return n, self._emit(draft[:n] + [nxt])

    def verify_tree(self, tree: DraftTree) -> tuple[list[int], list[int]]:
        """One target read of the root (the newest token) and every node of `tree`, each row after
        its own path; acceptance walks down from the root (greedy, or multi-draft speculative
        sampling) and the cache keeps the root and the accepted path. Returns (accepted rows,
        emitted tokens: the accepted nodes' and one of the target's, cut at EOS)."""
        self.ensure_cache()
        pair, start = self.pair, len(self.tokens) - 1  # the root's position: the cache holds the rest
        tree.check(pair.max_context - start, pair.vocab_size)
        with self._verify_reads():
            logits, self.cache = forward_tree_logits(pair.target, [self.tokens[-1]] + tree.tokens, self.cache,
                                                     tree.mask(), tree.positions(start), pair.vocab_size)  # [N+1, V]
        path, nxt = self.sampler.accept_tree(tree, logits)
        self.cache.keep_rows(start, [ROOT] + path)
        if self.feats is not None:
            self.feats.append(self.pair.feature_tap.last[[ROOT] + path])  # [1 + n, H]: the kept rows' states
        return path, self._emit([tree.tokens[r - 1] for r in path] + [nxt])

    def _emit(self, new: list[int]) -> list[int]:
        eos = next((i for i, x in enumerate(new) if x in self.pair.eos_ids), None)
        if eos is not None:  # EOS ends the text where it stands
            new, self.ended = new[: eos + 1], True
        self.tokens.extend(new)
        if self.cache is not None:
            crop_to(self.cache, len(self.tokens) - 1)  # drop what the target read past the accepted
        if self.feats is not None:
            self.feats.crop(min(self.feats.length, len(self.tokens) - 1 - self.feature_start))
        return new

    def _keep_features(self) -> None:
        if self.feats is not None:
            self.feats.append(self.pair.feature_tap.last)  # [S, H] of the rows just read

    def features(self) -> torch.Tensor:
        """[T, H]: the target's final-norm state at positions feature_start … (those it has read)."""
        assert self.feats is not None, "the pair keeps no features (no EAGLE head loaded)"
        return self.feats.view()

    def rewind(self, length: int) -> None:
        """Back to the first `length` context tokens (cost measurement repeats one step)."""
        del self.tokens[length:]
        crop_to(self.cache, length - 1)
        if self.feats is not None:
            self.feats.crop(min(self.feats.length, max(0, length - 1 - self.feature_start)))
        self.ended = False
