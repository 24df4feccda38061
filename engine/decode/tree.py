"""A draft token tree: the candidates one target verify scores at once (SpecInfer, Medusa, EAGLE-2).

Row 0 is the root, the newest emitted token (the verify's first input, as in a chain); rows 1…N
are the drafted nodes in the order they were added, each after its parent, so a node's ancestors
always come before it. A chain of γ tokens is the tree whose node i has parent i − 1.

One target read covers every node when each row attends to the cached context, its ancestors and
itself, never to a sibling's branch (`mask`), at the position its depth gives (`positions`); the
target's choice after row r then scores every child of r at once, and acceptance walks down from
the root (`greedy_path`; the sampling walk is oracles/sampling.py's `tree_sample`).

Torch-free: the verifier turns the mask into whatever its attention reads."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.decode.records import DraftToken

ROOT = 0  # row 0: the newest emitted token, every top-level node's parent
TREE_WIDTH = 3  # children a node at most in the trees rakv weighs and traces record


@dataclass
class DraftTree:
    """Nodes 1…N of a verify read; `parents[i]` is node i's parent row (ROOT for a top-level one)."""

    tokens: list[int] = field(default_factory=list)  # token id per node, rows 1…N (index i ↔ row i + 1)
    parents: list[int] = field(default_factory=list)  # parent row per node, always < its own row
    drafts: list[DraftToken] = field(default_factory=list)  # signals (and the law p) per node
    proposers: list[str] = field(default_factory=list)  # who proposed each node (a tree may mix them)

    @classmethod
    def chain(cls, drafted: list[DraftToken], proposer: str = "draft") -> "DraftTree":
        """γ tokens in a row: node i's parent is row i (the node before it, the root for the first)."""
        return cls([d.token_id for d in drafted], list(range(len(drafted))), list(drafted), [proposer] * len(drafted))

    @classmethod
    def bushy(cls, tokens: list[int], proposer: str = "draft") -> "DraftTree":
        """Two children a node, breadth first: the tree a read of len(tokens) + 1 rows is timed or
        tested on (siblings must differ)."""
        tree = cls()
        for i, t in enumerate(tokens):
            tree.add(ROOT if i < 2 else (i - 2) // 2 + 1, DraftToken(t, 0.0, 1.0), proposer)
        return tree

    def add(self, parent: int, token: DraftToken, proposer: str) -> int:
        """Appends a child of row `parent`; returns its row."""
        assert 0 <= parent <= len(self.tokens), (parent, len(self.tokens))
        self.tokens.append(token.token_id)
        self.parents.append(parent)
        self.drafts.append(token)
        self.proposers.append(proposer)
        return len(self.tokens)

    @property
    def size(self) -> int:
        """Drafted nodes (the root not counted): what a verify reads beyond a plain step."""
        return len(self.tokens)

    def parent(self, row: int) -> int:
        return self.parents[row - 1]

    def children(self, row: int) -> list[int]:
        """Rows whose parent is `row`, in the order they were added (the order acceptance tries them)."""
        return [i + 1 for i, p in enumerate(self.parents) if p == row]

    def depth(self, row: int) -> int:
        """0 for the root, 1 for a top-level node, …"""
        d = 0
        while row != ROOT:
            row, d = self.parent(row), d + 1
        return d

    @property
    def max_depth(self) -> int:
        return max((self.depth(r) for r in range(1, self.size + 1)), default=0)

    def is_chain(self) -> bool:
        return self.parents == list(range(self.size))

    def path(self, row: int) -> list[int]:
        """The rows from the first node below the root down to `row` (empty for the root)."""
        out = []
        while row != ROOT:
            out.append(row)
            row = self.parent(row)
        return out[::-1]

    def positions(self, start: int) -> list[int]:
        """Position id per row, the root at `start` (its place in the sequence): start + depth."""
        return [start + self.depth(r) for r in range(self.size + 1)]

    def mask(self) -> list[list[bool]]:
        """mask[r][c]: row r attends to row c of the read (its ancestors and itself). Every row also
        attends to the whole cached context, which the verifier prepends."""
        rows = self.size + 1
        out = [[False] * rows for _ in range(rows)]
        for r in range(rows):
            out[r][r] = True
            a = r
            while a != ROOT:
                a = self.parent(a)
                out[r][a] = True
        return out

    def check(self, context_left: int, vocab: int) -> "DraftTree":
        """A tree a verify can read: one clear ValueError otherwise."""
        if self.max_depth + 1 > context_left:
            raise ValueError(f"a tree {self.max_depth} deep needs {self.max_depth + 1} positions; "
                             f"the context leaves {context_left}")
        bad = next((t for t in self.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token {bad} in the tree is outside the vocabulary (0…{vocab - 1})")
        for row in range(self.size + 1):
            kids = [self.tokens[c - 1] for c in self.children(row)]
            if len(kids) != len(set(kids)):
                raise ValueError(f"row {row} of the tree has the same token twice among its children")
        return self


def greedy_path(tree: DraftTree, target_next: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance over a tree: from the root, go to the child whose token is the target's
    choice after the current row, while there is one.

    target_next[r]: the target's argmax after the context and row r's path (len = tree.size + 1).
    Returns (accepted rows, root first below it; the target's token after the last of them): the
    tokens emitted are the accepted rows' tokens and that one, exactly what plain greedy decoding
    emits, since each accepted token is the target's own choice at its position."""
    assert len(target_next) == tree.size + 1, (len(target_next), tree.size)
    row, path = ROOT, []
    while True:
        nxt = next((c for c in tree.children(row) if tree.tokens[c - 1] == target_next[row]), None)
        if nxt is None:
            return path, target_next[row]
        path.append(nxt)
        row = nxt


def budget_tree_shape(nodes: int, width: int, vocab: int) -> None:
    """Checks a tree's requested shape before drafting: a positive node budget, a width (children
    per node) from 1 to the vocabulary."""
    if nodes <= 0:
        raise ValueError(f"a tree's node budget must be at least 1, got {nodes}")
    if not 1 <= width <= vocab:
        raise ValueError(f"a tree's width must be from 1 to the vocabulary ({vocab}), got {width}")


def rank_acceptance(steps: list[tuple[list[int], list[int], list[int]]], width: int) -> tuple[list[float], int]:
    """Per sibling rank r < width: how often the target took the rank-r child of a node the walk
    reached, among the reached nodes that had one ([q_0, …], and how many nodes were reached).
    steps: (tree_parents, draft_ids, accepted tokens) of tree steps."""
    took, had, reached = rank_counts(steps, width)
    return [t / h if h else 0.0 for t, h in zip(took, had)], reached


def rank_counts(steps: list[tuple[list[int], list[int], list[int]]], width: int
                ) -> tuple[list[int], list[int], int]:
    """rank_acceptance's counts: per rank, the reached nodes that took that child and those that
    had one, and the reached nodes (those with children, where the walk chose or stopped)."""
    took, had, reached = [0] * width, [0] * width, 0
    for parents, drafted, accepted in steps:
        kids: dict[int, list[int]] = {}
        for row, parent in enumerate(parents, start=1):
            kids.setdefault(parent, []).append(row)
        row = ROOT
        for token in list(accepted) + [None]:  # after the last accepted token the walk stops: no child taken
            children = kids.get(row, [])
            if not children:
                break
            reached += 1
            for r in range(min(len(children), width)):
                had[r] += 1
            nxt = next((i for i, c in enumerate(children) if drafted[c - 1] == token), None)
            if nxt is None:
                break
            if nxt < width:
                took[nxt] += 1
            row = children[nxt]
    return took, had, reached


def geometric_ranks(alpha: float, width: int) -> list[float]:
    """Per-rank acceptance where nothing measured it: rank r's child taken with α(1 − α)^r (rank 0
    is a chain's next token, taken with α; each lower rank's miss leaves the rest)."""
    return [alpha * (1 - alpha) ** r for r in range(width)]


def static_choices(q: list[float], nodes: int, width: int, depth: int) -> list[tuple[int, ...]]:
    """The static tree of `nodes` rank paths that a draft's trees are best read as where an engine
    takes a fixed tree: best first by Π q[rank] along the path (q[r]: the chance the target takes a
    reached node's rank-r child), each path after its parent and its lower-ranked sibling, at most
    `width` children a node and `depth` deep."""
    import heapq

    out: list[tuple[int, ...]] = []
    frontier = [(-q[0], (0,))] if q and width and depth else []
    value = {(): 1.0}
    while frontier and len(out) < nodes:
        v, path = heapq.heappop(frontier)
        out.append(path)
        value[path] = -v
        if path[-1] + 1 < min(width, len(q)):  # the next sibling
            sib = path[:-1] + (path[-1] + 1,)
            heapq.heappush(frontier, (-value[path[:-1]] * q[sib[-1]], sib))
        if len(path) < depth:  # the first child
            heapq.heappush(frontier, (-value[path] * q[0], path + (0,)))
    return out


def stored_tree(parents) -> bool:
    """Whether a stored step's or trace position's `tree_parents` holds a tree: a non-empty list or
    array; NULL as the store hands it back (None, NaN, pandas' NA) or empty is a chain."""
    return hasattr(parents, "__len__") and len(parents) > 0


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the root), parents before children as DraftTree keeps them."""
    out: list[int] = []
    for parent in parents:
        out.append(1 + (out[parent - 1] if parent != ROOT else 0))
    return out


def tree_levels(parents: list[int], nodes: int, cap: int) -> int:
    """Draft reads a grown tree of `nodes` cost (oracles/tree_growth.py): one a level, a level past
    the deepest it used, at most `nodes` and `cap` (K_MAX) levels."""
    return min(max(depths(parents), default=0) + 1, nodes, cap)


def root_rank_hits(parents: list[int], drafted: list[int], accepted: list[int]) -> tuple[int, int]:
    """(nodes the walk reached that took their first child, nodes the walk reached that had one):
    a tree step's evidence on the draft's per-token acceptance α (a chain's next token is its
    first child)."""
    took, had, _ = rank_counts([(parents, drafted, accepted)], 1)
    return took[0], had[0]
