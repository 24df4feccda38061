"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; Arctic Inference's `suffix`): drafts from
the COUNTS of what followed the context's suffix, in this request's prompt and output and in the
outputs of earlier requests. No model runs.

Two count tries of bounded depth: one per request (prompt + everything emitted, grown token by
token) and one over the cross-request history (`SuffixHistory`: earlier requests' outputs, least
recently used first out under a token budget), which a run reads through a snapshot taken at its
start, so its proposals are a function of its context and that snapshot alone (the exactness
duty, docs/architecture.md "Traces and replay"). From the longest context suffix with a follower a
path is drawn greedily by the highest count; each token's estimated probability is the product of
the count ratios along the path (count(s·t) / Σ_u count(s·u)), and the path stops where that falls
below `prob`, at K_MAX tokens, or at as many tokens as the match is long (a 2-token match drafts at
most 2: Arctic's max_spec_factor 1, so a one-token coincidence never drafts 8). Of the two paths
(this request's, the history's) the one expecting more accepted tokens (Σ of its probabilities,
Arctic's score) drafts; this request's wins ties. So the length adapts to the match and to how
often its continuation held: `lookahead()` is the path's length."""
from __future__ import annotations

import hashlib
import math
import threading
import weakref
from array import array
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from engine.decode.records import K_MAX, DraftToken
from engine.decode.step import draft_tokens

# Longest n-gram counted: a path of K_MAX tokens needs a match of K_MAX (see the module doc), and
# a level-`depth` n-gram has no follower in the trie, so depth ≥ K_MAX + 1; 12 leaves a longer
# context to separate frequent continuations. Measured on held-out responses of the embedded
# target, τ at γ = 4 stops moving past depth 6, while the history's trie grows by ~0.7 nodes per
# token per level (~130 bytes a node): depth 12 holds 100,000 tokens of SmolLM2 text in ~110 MB.
DEPTH = 12
DEPTH_MAX = 64  # trie levels are bytes; past this the per-token cost outweighs any longer match
# A path token is drafted while its estimated probability is ≥ this: at fp32 a drafted token costs
# ~0.28 of a plain step in the verify (81 ms for 5 tokens against 38 ms for 1), so a token right
# less often than that costs more than it saves (Arctic drafts down to 0.1 on GPUs, where a verify
# token is nearly free). Measured on held-out outputs: τ 1.239 at 0.3 vs 1.241 at 0.1, for 1%
# fewer modelled ms per token.
MIN_PROB = 0.3
# Tokens of earlier outputs kept (~780 responses of 128 tokens, ~110 MB of trie); rebuilding the
# trie after an eviction takes under 1 s on this project's 2-core CPU.
SUFFIX_BUDGET = 100_000
LOW_WATER = 0.75  # an eviction frees down to this share of the budget, so rebuilding the trie is rare
_STRIDE = 1 << 32  # a child's key: parent node × _STRIDE + token (token ids are < 2^32)
OPTIONS = {"budget": ("budget", int), "depth": ("depth", int), "prob": ("min_prob", float)}  # spec → (argument, type)


class CountTrie:
    """Occurrence counts of every n-gram (1 ≤ n ≤ depth) of the streams pushed into it, as a trie
    of interned node ids (0: the empty n-gram) in flat arrays, so a node costs one dict entry and
    21 bytes: count[v] occurrences of v's n-gram; total[v] those followed by a token (Σ of its
    children's counts); best[v] its child with the highest count (the latest to reach it on a tie:
    the most recent text predicts best, as prompt lookup's latest occurrence); link[v] the node of
    v's n-gram without its first token; level[v] its length; last[v] its last token.

    A trie of all n-grams is closed under prefixes and suffixes, so the longest suffix of a
    stream present in it moves by suffix links, Aho-Corasick style (`follow`, amortized O(1) a
    token), and each pushed token walks the suffixes of the previous n-gram (O(depth))."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.child: dict[int, int] = {}  # parent × _STRIDE + token → node
        self.count, self.total, self.best = array("i", [0]), array("i", [0]), array("i", [0])
        self.link, self.last, self.level = array("i", [0]), array("i", [-1]), array("B", [0])

    @property
    def nodes(self) -> int:
        return len(self.count) - 1

    def clone(self) -> "CountTrie":
        twin = CountTrie(self.depth)
        twin.child = dict(self.child)
        for name in ("count", "total", "best", "link", "last", "level"):
            setattr(twin, name, array(getattr(self, name).typecode, getattr(self, name)))
        return twin

    def push(self, end: int, t: int) -> int:
        """Token t after a stream whose newest n-gram (its last min(depth, len) tokens) is node
        `end` (0 for a new stream): every n-gram ending at t is counted once; returns the newest."""
        if self.level[end] == self.depth:  # the n-grams ending at t extend ones of ≤ depth − 1 tokens
            end = self.link[end]
        child, count, total, best = self.child, self.count, self.total, self.best
        chain, made = [], []  # the n-grams ending at t, longest first; which of them are new
        v = end
        while True:
            c = child.get(v * _STRIDE + t)
            if c is None:
                c = child[v * _STRIDE + t] = self._node(v, t)
                made.append(len(chain))
            count[c] += 1
            total[v] += 1
            if count[c] >= count[best[v]]:  # best[v] = 0 (count 0) before v had a follower
                best[v] = c
            chain.append(c)
            if v == 0:
                break
            v = self.link[v]
        for i in made:  # chain[i] without its first token is chain[i + 1]; a unigram's is the root
            self.link[chain[i]] = chain[i + 1] if i + 1 < len(chain) else 0
        return chain[0]

    def _node(self, parent: int, t: int) -> int:
        for column, value in ((self.count, 0), (self.total, 0), (self.best, 0), (self.link, 0), (self.last, t)):
            column.append(value)
        self.level.append(self.level[parent] + 1)
        return len(self.count) - 1

    def follow(self, v: int, t: int) -> int:
        """The node of the longest suffix of (v's n-gram, then t) that occurs here (0: none), v
        being the longest suffix of the stream before t that occurs here."""
        if self.level[v] == self.depth:
            v = self.link[v]
        child, link = self.child, self.link
        while True:
            c = child.get(v * _STRIDE + t)
            if c is not None:
                return c
            if v == 0:
                return 0
            v = link[v]

    def path(self, v: int, cap: int, min_prob: float) -> tuple[list[int], list[float], float]:
        """The greedy path after node v: (tokens, each one's count ratio, score = Σ of the running
        products). At each token the longest suffix with a follower is taken (v first, then its
        links: past the depth and at the context's own end the shorter context speaks); the path
        stops at `cap` tokens or where the running product would fall below `min_prob`.
        O(depth + cap): every link step shortens what one path step lengthened."""
        count, total, best, link = self.count, self.total, self.best, self.link
        tokens: list[int] = []
        ratios: list[float] = []
        p, score = 1.0, 0.0
        while len(tokens) < cap:
            while v and not total[v]:
                v = link[v]
            if not v:
                break
            c = best[v]
            r = count[c] / total[v]
            if p * r < min_prob:
                break
            p *= r
            score += p
            tokens.append(self.last[c])
            ratios.append(r)
            v = c
        return tokens, ratios, score

    def start(self, v: int) -> int:
        """The longest suffix of node v's n-gram (v first) that has a follower; 0: none."""
        while v and not self.total[v]:
            v = self.link[v]
        return v


def prompt_key(prompt_ids: Iterable[int]) -> str:
    """A request's key in the history: its prompt's tokens, digested (a prompt asked again
    replaces its earlier output; a benchmark leaves a prompt's own output out by it)."""
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=12).hexdigest()


def check_budget(budget: object, where: str = "suffix option budget") -> int:
    """`budget` if a positive int; else a one-line ValueError naming `where` (a flag, an option)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"{where} must be a positive number of tokens, got {budget!r}")
    return budget


class SuffixHistory:
    """The outputs of earlier requests, for the suffix proposer: request key → its output tokens,
    least recently used first out when the tokens held would pass `budget` (an eviction frees down
    to LOW_WATER of it: removing a request rebuilds the trie, so that happens once per quarter
    budget of new tokens, not per request), and their CountTrie.

    One per loaded pair and process (the CLI's, the workbench's), fed when a run ends
    (`add`). A run reads a `snapshot()`: a frozen view that shares the trie until the live history
    next changes (then the live one copies it first, if the snapshot is still held), so every
    policy of a comparison starts from the history as it stood before the comparison. `without`
    and `limited` give frozen views of part of it."""

    def __init__(self, budget: int = SUFFIX_BUDGET, depth: int = DEPTH) -> None:
        self.budget, self.depth = check_budget(budget, "the suffix history budget"), depth
        self.frozen = False
        self.trie = CountTrie(depth)
        self._requests: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lent: weakref.ref | None = None  # the newest snapshot, which shares self.trie
        self._lock = threading.Lock()  # workbench sessions share one history

    @classmethod
    def from_outputs(cls, items: Iterable[tuple[str, Iterable[int]]], budget: int = SUFFIX_BUDGET,
                     depth: int = DEPTH) -> "SuffixHistory":
        """A history of `items` ((key, output tokens), oldest first; a key again replaces its
        earlier output): the newest that fit in `budget`, its trie built at once."""
        h = cls(budget, depth)
        for key, tokens in items:
            h._requests.pop(key, None)
            h._requests[key] = tuple(tokens)[-budget:]
        h._requests = _newest(h._requests, budget)
        h.trie = _trie_of(h._requests.values(), depth)
        return h

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self._requests.values())

    def __len__(self) -> int:
        return len(self._requests)

    def keys(self) -> list[str]:
        """Request keys, least recently used first."""
        return list(self._requests)

    def add(self, key: str, tokens: Iterable[int]) -> None:
        """A finished request's output (its last `budget` tokens if longer), the newest; one with
        the same key before is replaced."""
        if self.frozen:
            raise ValueError("a suffix history snapshot never changes: add to the live history")
        tokens = tuple(tokens)[-self.budget:]
        with self._lock:
            gone = self._requests.pop(key, None) is not None
            held = self.tokens
            if held + len(tokens) > self.budget:  # least recently used first, down to the low-water mark
                low = min(self.budget - len(tokens), int(self.budget * LOW_WATER))
                while self._requests and held > max(low, 0):
                    held -= len(self._requests.popitem(last=False)[1])
                gone = True
            self._requests[key] = tokens
            if gone:
                self.trie = _trie_of(self._requests.values(), self.depth)
            else:
                if self._lent is not None and self._lent() is not None:  # a snapshot still reads it
                    self.trie = self.trie.clone()
                _push_stream(self.trie, tokens)
            self._lent = None

    def snapshot(self) -> "SuffixHistory":
        """A frozen view of the history as it stands (it shares the trie: O(requests))."""
        if self.frozen:
            return self
        with self._lock:
            view = self._view(self._requests.copy(), self.trie)
            self._lent = weakref.ref(view)
        return view

    def without(self, key: str) -> "SuffixHistory":
        """A frozen view without request `key` (a benchmark's prompt must not find its own output)."""
        if key not in self._requests:
            return self.snapshot()
        with self._lock:
            kept = OrderedDict((k, t) for k, t in self._requests.items() if k != key)
        return self._view(kept, _trie_of(kept.values(), self.depth))

    def limited(self, budget: int) -> "SuffixHistory":
        """A frozen view of the most recently used requests that fit in `budget` tokens (the
        `@suffix:budget=N` option); the whole history when it fits."""
        check_budget(budget)
        if self.tokens <= budget:
            return self.snapshot()
        with self._lock:
            kept = _newest(self._requests, budget)
        return self._view(kept, _trie_of(kept.values(), self.depth), budget)

    def describe(self) -> dict:
        """What a trace records of the history its suffix proposals read: size and a digest of
        its requests (keys and tokens, in order)."""
        h = hashlib.blake2b(digest_size=12)
        for k, t in self._requests.items():
            h.update(k.encode())
            h.update(array("q", t).tobytes())
        return dict(requests=len(self), tokens=self.tokens, budget=self.budget, digest=h.hexdigest())

    def _view(self, requests: OrderedDict, trie: CountTrie, budget: int | None = None) -> "SuffixHistory":
        view = SuffixHistory(budget or self.budget, self.depth)
        view._requests, view.trie, view.frozen = requests, trie, True
        return view


def _newest(requests: OrderedDict, budget: int) -> OrderedDict:
    """The most recently used requests whose tokens fit in `budget` together, in their order."""
    kept: list[tuple[str, tuple[int, ...]]] = []
    held = 0
    for key, tokens in reversed(requests.items()):
        if held + len(tokens) > budget:
            break
        kept.append((key, tokens))
        held += len(tokens)
    return OrderedDict(reversed(kept))


def _push_stream(trie: CountTrie, tokens: Iterable[int]) -> None:
    end = 0  # a new stream: its n-grams never span another request's
    for t in tokens:
        end = trie.push(end, t)


def _trie_of(streams: Iterable[tuple[int, ...]], depth: int) -> CountTrie:
    """The CountTrie of `streams` (in order), built level by level with numpy: the counts, best
    children and links that pushing them token by token makes (tested), in less than half the
    time (100,000 tokens: 0.8 s against 1.7 s here), since an eviction or a leave-one-out history
    rebuilds it whole."""
    streams = [s for s in streams if s]
    trie = CountTrie(depth)
    if not streams:
        return trie
    tok = np.concatenate([np.asarray(s, dtype=np.int64) for s in streams])  # [N]
    lens = np.array([len(s) for s in streams])
    age = np.arange(len(tok)) - np.repeat(np.cumsum(lens) - lens, lens)  # [N] tokens before p in its stream
    below = np.zeros(len(tok), dtype=np.int64)  # [N] node of the (n−1)-gram ending at p (the root for n = 1)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("parent", "last", "count", "seen", "link", "level")}
    size = 1  # nodes so far, the root included
    for n in range(1, depth + 1):
        at = np.nonzero(age >= n - 1)[0]  # [M] positions where an n-gram ends
        if not at.size:
            break
        parent = below[at - 1] if n > 1 else np.zeros(len(at), dtype=np.int64)  # the (n−1)-gram before p
        keys, first, inv = np.unique(parent * _STRIDE + tok[at], return_index=True, return_inverse=True)
        seen = np.zeros(len(keys), dtype=np.int64)
        np.maximum.at(seen, inv, at)  # each n-gram's latest occurrence: ties go to it, as push's do
        cols["parent"].append(keys // _STRIDE)
        cols["last"].append(keys % _STRIDE)
        cols["count"].append(np.bincount(inv, minlength=len(keys)))
        cols["seen"].append(seen)
        cols["link"].append(below[at[first]])  # the n-gram without its first token: the (n−1)-gram ending at p
        cols["level"].append(np.full(len(keys), n))
        trie.child.update(zip(keys.tolist(), range(size, size + len(keys))))
        nxt = np.zeros(len(tok), dtype=np.int64)
        nxt[at] = size + inv
        below, size = nxt, size + len(keys)
    c = {k: np.concatenate([np.zeros(1, dtype=np.int64), *v]) for k, v in cols.items()}
    c["last"][0] = -1
    total = np.bincount(c["parent"][1:], weights=c["count"][1:], minlength=size).astype(np.int64)
    order = np.lexsort((c["seen"][1:], c["count"][1:], c["parent"][1:])) + 1  # by parent, count, recency
    ends = order[np.r_[c["parent"][order][1:] != c["parent"][order][:-1], True]]  # each parent's best child
    best = np.zeros(size, dtype=np.int64)
    best[c["parent"][ends]] = ends
    for name, values in (("count", c["count"]), ("total", total), ("best", best), ("link", c["link"]),
                         ("last", c["last"]), ("level", c["level"])):
        column = getattr(trie, name)
        setattr(trie, name, array(column.typecode, values.astype(np.dtype(column.typecode)).tobytes()))
    return trie


class SuffixProposer:
    """Drafts the suffix path (module docstring) from this request's counts and the history's.

    `propose` changes nothing (a dropped proposal needs no rollback) and `propose(k)` is the
    first min(k, m) tokens of the m-token path, which `lookahead()` reports: the path depends on
    the context and the history snapshot alone, never on k, so traces and replay hold."""

    def __init__(self, prompt_ids: list[int], sampler, vocab_size: int, history: SuffixHistory | None = None,
                 depth: int = DEPTH, min_prob: float = MIN_PROB, budget: int | None = None,
                 name: str = "suffix") -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= DEPTH_MAX:
            raise ValueError(f"suffix option depth must be an integer in [1, {DEPTH_MAX}], got {depth!r}")
        if not (isinstance(min_prob, (int, float)) and 0 < min_prob <= 1):
            raise ValueError(f"suffix option prob must be a number in (0, 1], got {min_prob!r}")
        if budget is not None:
            check_budget(budget)
        history = history if history is not None else SuffixHistory()
        self.history = history.limited(budget) if budget is not None else history.snapshot()
        self.sampler, self.vocab_size, self.min_prob, self.name = sampler, vocab_size, float(min_prob), name
        self.unread = (0, 0)  # it reads nothing with a model
        self.tokens: list[int] = []  # the context: the prompt and every emitted token
        self._own = CountTrie(depth)
        self._end = 0  # this request's newest n-gram in its own trie
        self._seen = 0  # the longest suffix of the context that occurs in the history
        self._path: tuple[list[int], list[float]] | None = None  # the proposal at this context, once made
        for t in prompt_ids:
            self._append(t)

    @classmethod
    def from_options(cls, prompt_ids: list[int], sampler, vocab_size: int, options: dict[str, str],
                     history: SuffixHistory | None = None, name: str = "suffix") -> "SuffixProposer":
        """From the policy spec's options (`@suffix:budget=5000,depth=8,prob=0.2`), strings as written there."""
        kwargs: dict = {}
        for key, value in options.items():
            if key not in OPTIONS:
                raise ValueError(f"unknown suffix option {key!r} (known: {', '.join(OPTIONS)})")
            arg, kind = OPTIONS[key]
            try:
                kwargs[arg] = kind(value)
            except ValueError:
                raise ValueError(f"suffix option {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {value!r}") from None
        return cls(prompt_ids, sampler, vocab_size, history, name=name, **kwargs)

    def lookahead(self) -> int:
        """Tokens it would propose now: the path's length (0 without a match)."""
        return len(self._proposal()[0])

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        ids, ratios = self._proposal()
        return draft_tokens(min(k, len(ids)), keep_drafting, lambda j: self._token(ids[j], ratios[j]))

    def update(self, accepted: int, emitted: list[int]) -> None:
        # `emitted` holds the accepted drafted tokens and the target's: only context, whoever drafted.
        for t in emitted:
            self._append(t)

    def _proposal(self) -> tuple[list[int], list[float]]:
        if self._path is None:
            own, hist = self._own, self.history.trie
            drafts = [trie.path(v, min(K_MAX, trie.level[v]), self.min_prob)
                      for trie, v in ((own, own.start(self._end)), (hist, hist.start(self._seen)))]
            ids, ratios, _ = max(drafts, key=lambda d: d[2])  # the first (this request's) on a tie
            # A prompt token past the target's vocabulary can never be accepted, nor given a law [V].
            cut = next((j for j, x in enumerate(ids) if x >= self.vocab_size), len(ids))
            self._path = (ids[:cut], ratios[:cut])
        return self._path

    def _token(self, x: int, r: float) -> DraftToken:
        # The law is one-hot (a deterministic proposal), so rejection sampling accepts x with
        # probability q(x) and resamples from q without x: exact. The count ratio r is the
        # confidence; the entropy is that of (r, 1 − r), a lower bound of the counts' own.
        p = None
        if not self.sampler.greedy:  # greedy acceptance never reads p
            import torch

            p = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.sampler.gen.device)  # [V]
            p[x] = 1.0
        entropy = 0.0 if r >= 1.0 else -(r * math.log2(r) + (1 - r) * math.log2(1 - r))
        return DraftToken(x, entropy, r, p=p)

    def _append(self, t: int) -> None:
        self._end = self._own.push(self._end, t)
        self._seen = self.history.trie.follow(self._seen, t)
        self.tokens.append(t)
        self._path = None
