"""Prompt lookup (n-gram) drafting: the proposal is copied from the context itself, no model
runs. The context's newest tokens are looked up among its earlier ones, and what followed the
latest earlier occurrence is proposed (HF's `prompt_lookup_num_tokens`, vLLM's `ngram`)."""
from __future__ import annotations

from typing import Callable

import torch

from engine.decode.records import DraftToken
from engine.decode.step import draft_tokens
from engine.oracles.sampling import Sampler

NGRAM_MAX = 16  # longest suffix looked up: each emitted token costs O(max) dict operations
UNBOUNDED = 1 << 30  # lookahead of a match: a copy can go on past the context's end (see NgramProposer)
OPTIONS = {"max": "max_ngram", "min": "min_ngram"}  # the policy spec's option names → constructor arguments


class NgramProposer:
    """Drafts by copying from the context (prompt + everything emitted).

    The match: the longest suffix of the context, of length max_ngram down to min_ngram, that also
    occurs earlier; of its earlier occurrences the latest (vLLM's choice: the most recent text
    predicts the next best; HF takes the first). The proposal: the tokens that followed it.

    A continuation shorter than k (the occurrence lies fewer than k tokens before the context's
    end, at distance d) is not cut there, as HF and vLLM cut it: it is copied on at the same
    distance, past the context's end into the drafted tokens themselves (LZ77's overlapping copy),
    so token j is context[start + j mod d]. The match says the text repeats with period d, and that
    is what the copy continues: a target stuck in a loop shorter than k (greedy decoding's common
    failure, and prompt lookup's best case) gets k tokens a step instead of d. So every match can
    propose any k; the policy's k and keep_drafting bound it, as they bound a model's draft.

    The index makes a step O(max_ngram + k) whatever the context's length: every n-gram gets an id
    (interned as (its (n-1)-gram's id, last token)), and each id of length in [min, max] maps to
    where the continuation of its latest occurrence starts, once that occurrence has a follower.
    `propose` changes nothing: a proposal that is dropped needs no rollback (profiling's trace
    proposes at every position and moves on with update(0, [next token]))."""

    def __init__(self, prompt_ids: list[int], sampler: Sampler, vocab_size: int, max_ngram: int = 3,
                 min_ngram: int = 1, name: str = "ngram") -> None:
        _check_option("max", max_ngram, 1, NGRAM_MAX)
        _check_option("min", min_ngram, 1, NGRAM_MAX)
        if min_ngram > max_ngram:
            raise ValueError(f"ngram option min must be ≤ max, got min={min_ngram}, max={max_ngram}")
        self.sampler, self.vocab_size = sampler, vocab_size  # one-hot laws are [vocab_size], as the target's
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self.unread = (0, 0)  # it reads nothing with a model
        self.tokens: list[int] = []  # the context: the prompt and every emitted token
        self._ids: dict[tuple[int, int], int] = {}  # (id of an n-gram, next token) → the (n+1)-gram's id; 0 = empty
        self._ends: list[int] = []  # [min(max, len)]: ids of the 1…max-grams ending at the newest token
        self._starts: dict[int, int] = {}  # n-gram id → where the continuation of its latest occurrence starts
        for t in prompt_ids:
            self._append(t)

    @classmethod
    def from_options(cls, prompt_ids: list[int], sampler: Sampler, vocab_size: int, options: dict[str, str],
                     name: str = "ngram") -> "NgramProposer":
        """From the policy spec's options (`@ngram:max=3,min=2`), strings as written there."""
        kwargs = {}
        for key, value in options.items():
            if key not in OPTIONS:
                raise ValueError(f"unknown ngram option {key!r} (known: {', '.join(OPTIONS)})")
            try:
                kwargs[OPTIONS[key]] = int(value)
            except ValueError:
                raise ValueError(f"ngram option {key} must be an integer, got {value!r}") from None
        return cls(prompt_ids, sampler, vocab_size, name=name, **kwargs)

    def lookahead(self) -> int:
        """Tokens it can propose now, without running a model: 0 without a match; with one, any
        number (the copy goes on past the context's end), UNBOUNDED."""
        return 0 if self._match() is None else UNBOUNDED

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        start = self._match()
        if start is None or k == 0:
            return []
        period = len(self.tokens) - start  # ≥ 1: the occurrence lies before the suffix
        ids = [self.tokens[start + j % period] for j in range(k)]
        # A prompt token past the target's vocabulary: it can never be accepted, nor given a law [V].
        ids = ids[: next((j for j, x in enumerate(ids) if x >= self.vocab_size), k)]
        return draft_tokens(len(ids), keep_drafting, lambda j: self._token(ids[j]))

    def update(self, accepted: int, emitted: list[int]) -> None:
        # `emitted` already holds the accepted drafted tokens and the target's one; there is no
        # draft state to keep or crop, so the outcome is only context, whoever drafted.
        for t in emitted:
            self._append(t)

    def _token(self, x: int) -> DraftToken:
        # A deterministic proposal: its law is one-hot, so rejection sampling accepts x with
        # probability q(x) and resamples from norm(max(0, q − p)) = q without x. Exact.
        p = None
        if not self.sampler.greedy:  # greedy acceptance never reads p
            p = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.sampler.gen.device)  # [V]
            p[x] = 1.0
        return DraftToken(x, 0.0, 1.0, p=p)

    def _match(self) -> int | None:
        """Where the continuation of the longest suffix's latest earlier occurrence starts."""
        for n in range(len(self._ends), self.min_ngram - 1, -1):
            start = self._starts.get(self._ends[n - 1])
            if start is not None:
                return start
        return None

    def _append(self, t: int) -> None:
        position = len(self.tokens)
        # The n-grams ending at the previous token now have a follower, t: their latest occurrence.
        for n in range(self.min_ngram, len(self._ends) + 1):
            self._starts[self._ends[n - 1]] = position
        # The n-gram ending at t is the (n-1)-gram ending before it, extended by t.
        prev = [0] + self._ends[: self.max_ngram - 1]
        self._ends = [self._ids.setdefault((g, t), len(self._ids) + 1) for g in prev]
        self.tokens.append(t)


def _check_option(key: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"ngram option {key} must be an integer in [{lo}, {hi}], got {value!r}")
