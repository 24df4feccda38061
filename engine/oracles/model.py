"""Model-backed oracles: the draft model proposes, the target verifies. Each owns its KV cache
and what it has read; the step loop hands them only tokens (docs/architecture.md, "Oracles")."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from engine.decode.records import UNBOUNDED, DraftToken
from engine.decode.step import draft_tokens
from engine.oracles.sampling import Sampler, draft_signals
from engine.runtime import invariance
from engine.runtime.eagle_head import Rows
from engine.runtime.forward import crop_to, forward_last_state, forward_logits
from engine.runtime.kv.cache import held_bytes_per_token, new_cache
from engine.runtime.kv.calibration import CodecKit
from engine.runtime.kv.offload import Offloaded, SlowTier, Timing, drop, offload, restore
from engine.runtime.models import ModelPair
from engine.runtime.prefix_cache import Entry, Hit, PrefixCache, fill, kv_of
from engine.runtime.vocab_head import SubHead


def draft_read(pair: ModelPair, ids: list[int], cache, head: SubHead | None = None) -> tuple[torch.Tensor, object]:
    """The draft reads `ids` after `cache`: logits [1, V] of the last ([1, K] over `head`'s ids
    with a reduced-vocabulary head). Its state at a position must never depend on how many tokens
    each read took (the policy's path), or live runs would not replay their traces: a row-
    invariant draft reads in chunks the load-time probe checked, any other row by row
    (engine/runtime/invariance.py). A sub-head reads the body's last state (one contiguous row,
    whatever the read) and scores it once, after the last chunk."""
    if not pair.draft_row_invariant:
        with invariance.verifying() if len(ids) > 1 else contextlib.nullcontext():
            out, cache = _draft_chunk(pair, ids, cache, head)
    else:
        for i in range(0, len(ids), invariance.CATCHUP_ROWS):
            out, cache = _draft_chunk(pair, ids[i : i + invariance.CATCHUP_ROWS], cache, head)
    return (out if head is None else head.logits(out)), cache


def _draft_chunk(pair: ModelPair, ids: list[int], cache, head: SubHead | None) -> tuple[torch.Tensor, object]:
    """One read: logits [1, V] of the last id, or with a sub-head the body's last state [1, H]."""
    if head is None:
        return forward_logits(pair.draft, ids, cache, 1, pair.vocab_size, gather=True)
    return forward_last_state(pair.draft, ids, cache)


class DraftModelProposer:
    """Drafts token by token with the pair's draft. It reads the context lazily (a run that never
    drafts never pays the draft's prefill): the prompt alone first, as a trace reads it, then the
    tokens emitted since it last read, in one catch-up read."""

    name = "draft"

    def __init__(self, pair: ModelPair, prompt_ids: list[int], sampler: Sampler,
                 hit: Callable[[], Hit] = lambda: Hit("off", 0), head: SubHead | None = None) -> None:
        self.pair, self.prompt_ids, self.sampler = pair, prompt_ids, sampler
        self.head = head  # a reduced-vocabulary LM head (`@draft:vocab=K`); None: the full head
        self.hit = hit  # the prefill's prefix-cache hit (asked at the first draft): its draft positions
        self.cache = None  # the draft's KV cache; None until it first drafts
        self.pending: list[int] = []  # context tokens not read yet, ending at the newest one
        self._kept = 0  # cache length before the last proposal's drafted tokens
        self._drafted = 0

    @property
    def unread(self) -> tuple[int, int]:
        """Context tokens the next draft reads before its own first token, (into an empty cache,
        after its cache): on a request's first draft the prompt (after the prefix cache's draft
        positions, if any), then what was emitted since it last drafted; the newest token, which
        every draft reads, is not counted."""
        warm = len(self.pending) - 1
        if self.cache is not None:
            return 0, warm
        reused = self._reusable()
        return (0, len(self.prompt_ids) - reused + warm) if reused else (len(self.prompt_ids), warm)

    def lookahead(self) -> int:
        return UNBOUNDED  # a model can always draft another token

    def _reusable(self) -> int:
        """Prompt positions the draft takes from the prefix cache. A draft that is not row-
        invariant takes them only from an exact repeat: a partial hit's positions were computed in
        another read's batch (not what reading this prompt gives), and its rest would be read
        row by row after them, several times slower than reading the whole prompt at once."""
        hit = self.hit()
        return hit.draft_positions() if self.pair.draft_row_invariant or hit.kind == "exact" else 0

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        self._drafted = 0
        if k == 0:
            return []
        if self.cache is None:
            reused = self._reusable()
            self.cache = fill(new_cache(self.pair.draft), self.hit().entry.draft_kv, reused) if reused else None
            if reused < len(self.prompt_ids):
                _, self.cache = self._read(self.prompt_ids[reused:])
        self._kept = self.cache.get_seq_length() + len(self.pending)
        feed = self.pending

        def next_token(j: int) -> DraftToken:
            nonlocal feed
            logits, self.cache = self._read(feed)  # [1, V], or [1, K] over the sub-head's ids
            x, p = self.sampler.choose(logits[0])  # p: the law x was drawn from
            signals = draft_signals(p)  # the same over [K] as over [V]: the rest of the law is zero
            if self.head is not None:  # back to target ids; p over [V], zero off the head (exact rejection)
                x, p = self.head.to_target(x), self.head.spread(p, self.pair.vocab_size)
            feed = [x]
            return DraftToken(x, *signals, p=p)

        drafted = draft_tokens(k, keep_drafting, next_token)
        self._drafted = len(drafted)
        return drafted

    def update(self, accepted: int, emitted: list[int]) -> None:
        if not self._drafted:
            self.pending.extend(emitted)  # in place: an `ar` run never reads, and copying would be O(n²)
            return
        # It read d_1 … d_{k-1} after the context; keep those the target accepted.
        kept = min(accepted, self._drafted - 1)
        crop_to(self.cache, self._kept + kept)
        self.pending, self._drafted = emitted[kept:], 0

    def rewind(self, read: int, pending: list[int]) -> None:
        """Back to having read `read` context tokens, `pending` after them (cost measurement)."""
        crop_to(self.cache, read)
        self.pending, self._drafted = list(pending), 0

    def _read(self, ids: list[int]) -> tuple[torch.Tensor, object]:
        return draft_read(self.pair, ids, self.cache, self.head)


def target_reads(pair: ModelPair, kv_tier: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the target's reads run in at `kv_tier`: row-invariant at a lossy tier (a key
    one ULP off can cross a quantization step, so a verify must store what plain steps store),
    where the pair's target allows it; HF's own forward otherwise."""
    if kv_tier != "native" and pair.target_row_invariant:
        return invariance.row_invariant_reads
    return contextlib.nullcontext


class TargetVerifier:
    """One target forward over [newest token, d_1 … d_k] scores every draft prefix at once. With
    a prefix cache, the prefill takes what the longest stored prefix offers (engine/runtime/prefix_cache.py)."""

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

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        self.ensure_cache()
        pair, draft = self.pair, [d.token_id for d in drafted]
        with invariance.verifying() if pair.exact_verify else contextlib.nullcontext(), self.reads():
            logits, self.cache = forward_logits(pair.target, [self.tokens[-1]] + draft, self.cache,
                                                len(draft) + 1, pair.vocab_size)  # [k+1, V]
        self._keep_features()
        p = torch.stack([d.p for d in drafted]) if drafted and not self.sampler.greedy else None  # [k, V]
        n, nxt = self.sampler.accept(draft, p, logits)
        return n, self._emit(draft[:n] + [nxt])

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
