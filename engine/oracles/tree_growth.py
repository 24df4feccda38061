"""Growing a token tree from a model's laws: EAGLE-2's dynamic tree, in whole levels (greedy
decoding; sampling fixes the shape first, `grow_static`).

Expansion: the model reads level d's nodes in one tree read (each row after its own path) and
each gets `width` children, the law's most likely tokens (greedy) or draws from it without
replacement (sampling); the `width` children of highest cumulative probability (the product of
the laws along the path) form level d + 1, read next while the selection may still use it.
Selection: the `nodes` candidates of highest cumulative probability, taken best first so that a
node comes after its parent and after its earlier siblings (a node's siblings are tried in the
order they were drawn, which multi-draft sampling's law needs: oracles/sampling.py
`tree_sample`). A level's read costs about one draft step, so a tree `depth` deep costs `depth`
draft reads, as a chain of that length does.

Shapes: a law is [V] (float32); `read(tree, rows)` returns [len(rows), V]: the laws after those
rows' paths (row 0, the root, is the newest emitted token)."""
from __future__ import annotations

import heapq
from typing import Callable

import torch

from engine.decode.records import K_MAX, DraftToken
from engine.decode.tree import ROOT, DraftTree, geometric_ranks, static_choices
from engine.oracles.sampling import Sampler, draft_signals

# The per-token acceptance a sampled tree's fixed shape is laid out for (rank r's child taken with
# α(1 − α)^r): it sets how bushy the tree is, never what it emits.
SHAPE_ALPHA = 0.6


def _children(law: torch.Tensor, width: int, sampler: Sampler) -> list[int]:
    """`width` tokens under `law`: its most likely (greedy), else drawn without replacement (never
    more than the tokens the law gives any mass)."""
    if sampler.greedy:
        return law.topk(width).indices.tolist()
    n = min(width, int((law > 0).sum()))
    return torch.multinomial(law, n, replacement=False, generator=sampler.gen).tolist()


def grow(read: Callable[[DraftTree, list[int]], torch.Tensor], nodes: int, width: int, sampler: Sampler,
         proposer: str) -> DraftTree:
    """A tree of at most `nodes` nodes under the laws `read` gives: EAGLE-2's dynamic tree when
    greedy (`grow_dynamic`), a shape fixed before any draw when sampling (`grow_static`)."""
    if sampler.greedy:
        return grow_dynamic(read, nodes, width, sampler, proposer)
    return grow_static(read, nodes, width, sampler, proposer)


def grow_static(read: Callable[[DraftTree, list[int]], torch.Tensor], nodes: int, width: int, sampler: Sampler,
                proposer: str) -> DraftTree:
    """Sampling: which nodes a tree holds must not depend on the tokens drawn, or a kept child
    would not follow the law multi-draft sampling divides by (a child kept for its high
    probability is not a draw from p: tests/test_tree.py's χ² sees it). So the shape is fixed first,
    the `nodes` best rank paths under the geometric prior (tree.static_choices), and each node's
    children are drawn from its law without replacement, level by level, one draft read a level."""
    shape = static_choices(geometric_ranks(SHAPE_ALPHA, width), nodes, width, K_MAX)
    tree, at = DraftTree(), {(): ROOT}  # rank path → row
    for depth in range(1, max(map(len, shape), default=0) + 1):
        wanted: dict[tuple[int, ...], int] = {}  # parent path → children it takes (ranks 0 … m − 1)
        for path in shape:
            if len(path) == depth and path[:-1] in at:
                wanted[path[:-1]] = wanted.get(path[:-1], 0) + 1
        if not wanted:
            break
        parents = sorted(wanted, key=at.__getitem__)
        for parent, law in zip(parents, read(tree, [at[p] for p in parents])):
            signals = draft_signals(law)
            for rank, token in enumerate(_children(law, wanted[parent], sampler)):
                at[parent + (rank,)] = tree.add(at[parent], DraftToken(token, *signals, p=law), proposer)
    return tree


def grow_dynamic(read: Callable[[DraftTree, list[int]], torch.Tensor], nodes: int, width: int, sampler: Sampler,
                 proposer: str) -> DraftTree:
    """A tree of at most `nodes` nodes grown under the laws `read` gives (see the module's text).
    It reads a level only while the selection may still reach it: once the best `nodes` hold no
    node of the newest level, no deeper one can enter (a node comes after its parent), so the tree
    is the one growing to the full depth would give, and tree(N) is the first N rows of tree(M)
    for N < M at the same width: one grown tree answers every node budget."""
    cand = DraftTree()  # every candidate drawn, in draw order
    cum = {ROOT: 1.0}  # row → cumulative probability of its path
    level, chosen = [ROOT], DraftTree()
    for depth in range(1, min(nodes, K_MAX) + 1):  # the depth of the level being born
        laws = read(cand, level)  # [len(level), V]
        born = []
        for row, law in zip(level, laws):
            signals = draft_signals(law)
            for token in _children(law, width, sampler):
                child = cand.add(row, DraftToken(token, *signals, p=law), proposer)
                cum[child] = cum[row] * float(law[token])
                born.append(child)
        chosen = _select(cand, cum, nodes)
        if chosen.max_depth < depth:  # the newest level is not used: nor would any deeper one be
            break
        level = heapq.nlargest(width, born, key=cum.__getitem__)
    return chosen


def _select(cand: DraftTree, cum: dict[int, float], nodes: int) -> DraftTree:
    """The `nodes` best candidates, best first, each after its parent and its earlier siblings."""
    kids = {row: cand.children(row) for row in range(cand.size + 1)}
    out, new_row = DraftTree(), {ROOT: ROOT}
    frontier = [(-cum[kids[ROOT][0]], kids[ROOT][0])] if kids[ROOT] else []
    while frontier and out.size < nodes:
        _, row = heapq.heappop(frontier)
        parent = cand.parent(row)
        new_row[row] = out.add(new_row[parent], cand.drafts[row - 1], cand.proposers[row - 1])
        siblings = kids[parent]
        after = siblings.index(row) + 1
        if after < len(siblings):  # its next sibling becomes eligible
            heapq.heappush(frontier, (-cum[siblings[after]], siblings[after]))
        if kids[row]:  # and its first child
            heapq.heappush(frontier, (-cum[kids[row][0]], kids[row][0]))
    return out

