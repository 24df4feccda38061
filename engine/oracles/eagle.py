"""The EAGLE proposer: the pair's feature-level head (engine/runtime/eagle_head.py) drafts from the target's
own final-norm hidden states, which the verifier keeps for every context position it has read.

The head's row i reads (f_i, x_{i+1}). The verifier knows f_i for every position but the newest
token's, so the real rows run up to the newest token; drafting d_1 reads the last real row, and
d_j (j ≥ 2) a guessed row (f̂, d_{j−1}) that the next update drops again. Reads are lazy, as the
draft model's: the prompt's rows in one read at the first draft, later rows one at a time, so
the head's state at a position never depends on the policy's path (replay needs that; see
docs/architecture.md, "Traces and replay")."""
from __future__ import annotations

from typing import Callable

import torch

from engine.decode.records import UNBOUNDED, DraftToken
from engine.decode.step import draft_tokens
from engine.oracles.sampling import Sampler, draft_signals
from engine.runtime.eagle_head import EagleHead, HeadCache
from engine.runtime.models import ModelPair


class EagleProposer:
    name = "eagle"

    def __init__(self, pair: ModelPair, prompt_ids: list[int], sampler: Sampler, verifier) -> None:
        assert pair.eagle is not None, "the pair has no EAGLE head"
        self.head: EagleHead = pair.eagle
        self.pair, self.sampler, self.verifier = pair, sampler, verifier
        self.n_prompt = len(prompt_ids)
        self.cache = HeadCache()
        self.start: int | None = None  # the first position with a feature (after a prefix-cache hit's)
        self.real = 0  # real rows in the cache: positions start … start + real − 1
        self._drafted = 0

    @property
    def unread(self) -> tuple[int, int]:
        """Rows its next draft reads first: (the prompt's, into an empty cache; the rest, one by one)."""
        v = self.verifier
        rows = len(v.tokens) - 1 - v.feature_start - self.real
        cold = max(0, self.n_prompt - v.feature_start) if self.real == 0 else 0
        return min(cold, rows), rows - min(cold, rows)

    def lookahead(self) -> int:
        return UNBOUNDED

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        self._drafted = 0
        if k == 0:
            return []
        fhat = self._catch_up()  # [1, H]: the guess at the newest token's feature
        if fhat is None:  # no feature read yet (an exact prefix-cache repeat): nothing to draft from
            return []

        def next_token(j: int) -> DraftToken:
            nonlocal fhat
            if j > 0:  # a guessed row: (f̂ of the previous position, the token drafted there)
                pos = self.start + self.cache.length
                fhat = self.head(fhat[None], torch.tensor([[drafted[-1].token_id]], device=fhat.device), pos, self.cache)[0]
            x, p = self._choose(fhat[-1])
            drafted.append(DraftToken(x, *draft_signals(p), p=p))
            return drafted[-1]

        drafted: list[DraftToken] = []
        draft_tokens(k, keep_drafting, next_token)
        self._drafted = len(drafted)
        return drafted

    def update(self, accepted: int, emitted: list[int]) -> None:
        # The guessed rows go; the verified positions' rows are read at the next draft.
        self.cache.crop(self.real)
        self._drafted = 0

    def _catch_up(self) -> torch.Tensor | None:
        """Reads the real rows not read yet (there is at least one after every step: each step
        emits a token); returns f̂ of the last one ([1, H]), None when there are no rows at all."""
        v = self.verifier
        feats, tokens = v.features(), v.tokens  # feats: [T, H] for positions feature_start …
        if self.start is None:
            self.start = v.feature_start
        assert self.start == v.feature_start, "the verifier's features moved under the head"
        end = len(tokens) - 1  # rows run to the newest token's predecessor
        if end <= self.start:
            return None
        assert feats.shape[0] >= end - self.start, (feats.shape, end, self.start)
        lo, out = self.start + self.real, None
        if self.real == 0 and lo < self.n_prompt:  # the prompt's rows, in one read
            out, lo = self._read(feats, tokens, lo, self.n_prompt), self.n_prompt
        for i in range(lo, end):
            out = self._read(feats, tokens, i, i + 1)
        assert out is not None, "a proposal with no new context"
        return out[-1:]

    def _read(self, feats: torch.Tensor, tokens: list[int], lo: int, hi: int) -> torch.Tensor:
        """Rows lo … hi − 1: (f_i, x_{i+1}) → f̂ [S, H]."""
        assert self.cache.length == self.real == lo - self.start, (self.cache.length, self.real, lo, self.start)
        f = feats[lo - self.start: hi - self.start].to(self.head.lm_rows.dtype)[None]  # [1, S, H]
        x = torch.tensor([tokens[lo + 1: hi + 1]], device=feats.device)  # [1, S]
        out = self.head(f, x, lo, self.cache)[0]  # [S, H]
        self.real += hi - lo
        return out

    def _choose(self, fhat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A token from the head's law, mapped to the target's ids; p over the full vocabulary."""
        logits = torch.full((self.pair.vocab_size,), float("-inf"), device=fhat.device)
        logits[self.head.vocab_map] = self.head.logits(fhat).float()  # [Vd] into [V]
        return self.sampler.choose(logits)
