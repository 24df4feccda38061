"""The draft model as a proposer: it drafts token by token, reading the context lazily, and its
reads never depend on how many tokens each took (a live run replays its trace). The step loop hands
it only tokens (docs/architecture.md, "Oracles")."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from engine.decode.records import UNBOUNDED, DraftToken
from engine.decode.step import draft_tokens
from engine.decode.tree import ROOT, TREE_WIDTH, DraftTree, budget_tree_shape
from engine.oracles.sampling import Sampler, draft_signals
from engine.oracles.tree_growth import grow
from engine.runtime import invariance
from engine.runtime.forward import crop_to, forward_last_state, forward_logits, forward_tree_states
from engine.runtime.kv.cache import GrowingCache, new_cache
from engine.runtime.models import ModelPair
from engine.runtime.prefix.cache import Hit, fill
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
        # The width its token trees take for a policy that chooses their shape; 0 where its cache
        # cannot read trees (a sliding-window or recurrent draft).
        self.tree_width = TREE_WIDTH if isinstance(new_cache(pair.draft), GrowingCache) else 0

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

    def _read_prompt(self) -> None:
        """The draft's lazy prefill, at its first draft: the prompt after the prefix cache's positions."""
        if self.cache is None:
            reused = self._reusable()
            self.cache = fill(new_cache(self.pair.draft), self.hit().entry.draft_kv, reused) if reused else None
            if reused < len(self.prompt_ids):
                _, self.cache = self._read(self.prompt_ids[reused:])

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        self._drafted = 0
        if k == 0:
            return []
        self._read_prompt()
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

    def propose_tree(self, nodes: int, width: int) -> DraftTree:
        """A token tree of at most `nodes` after the context (oracles/tree_growth.py), each level
        one tree read of the draft. Its cache keeps the context only: the accepted nodes are read
        again, as context, before the next draft (`update` hears them as a step that drafted none)."""
        budget_tree_shape(nodes, width, self.pair.vocab_size)
        self._drafted = 0
        self._read_prompt()
        if len(self.pending) > 1:  # all but the newest token, the tree's root
            _, self.cache = self._read(self.pending[:-1])
            del self.pending[:-1]
        if not isinstance(self.cache, GrowingCache):
            raise ValueError(f"the draft {self.pair.draft_name}'s cache cannot read token trees "
                             "(a sliding-window or recurrent model): draft chains instead")
        start, root = self.cache.get_seq_length(), self.pending[-1]
        held: dict[int, int] = {}  # tree row → its place in the cache after `start` (levels read so far)

        def read(tree: DraftTree, rows: list[int]) -> torch.Tensor:
            """The draft's laws after `rows` (one level), read after the levels before it, which
            the cache keeps: each row attends to the context, its ancestors and itself."""
            before = len(held)
            allowed = [[False] * (before + len(rows)) for _ in rows]  # [S, T]: over the tree's keys
            for i, r in enumerate(rows):
                for a in ([ROOT] + tree.path(r)[:-1]) if r != ROOT else []:
                    allowed[i][held[a]] = True
                allowed[i][before + i] = True
            held.update({r: before + i for i, r in enumerate(rows)})
            ids = [root] if rows == [ROOT] else [tree.tokens[r - 1] for r in rows]
            states = forward_tree_states(self.pair.draft, ids, self.cache, allowed,
                                         [start + tree.depth(r) for r in rows], list(range(len(rows))))  # [1, H] each
            if self.head is None:
                logits = self.pair.draft.get_output_embeddings()(torch.cat(states))  # [len(rows), V]
                laws = self.sampler.law(logits[:, : self.pair.vocab_size].float())
            else:  # the sub-head's law over its K ids, spread over the target's (zero off the head)
                laws = torch.stack([self.head.spread(self.sampler.law(self.head.logits(h)[0]), self.pair.vocab_size)
                                    for h in states])
            return laws

        try:
            return grow(read, nodes, width, self.sampler, self.name)
        finally:
            crop_to(self.cache, start)  # the context only

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
