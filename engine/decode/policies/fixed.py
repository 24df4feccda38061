"""`fixed:k` (constant γ) and `ar` (γ = 0: plain autoregressive decoding)."""
from __future__ import annotations

from engine.decode.policies.base import BasePolicy
from engine.decode.records import K_MAX, TREE_MAX_NODES, Action, DecodeState


class FixedPolicy(BasePolicy):
    proposers = ("draft",)  # `fixed:k@p` drafts with p instead

    def __init__(self, k: int, name: str | None = None) -> None:
        if not 0 <= k <= K_MAX:
            raise ValueError(f"fixed:k needs 0 ≤ k ≤ {K_MAX}, got {k}")
        self.k = k
        self.name = name or ("ar" if k == 0 else f"fixed:{k}")

    def choose(self, state: DecodeState) -> Action:
        return Action(k=self.k, proposer=self.drafter)


class FixedTreePolicy(BasePolicy):
    """`tree:NxW`: every step drafts a token tree of at most N nodes, at most W children a node
    (EAGLE-2's dynamic tree: oracles/tree_growth.py), verified in one target read."""

    proposers = ("draft",)  # the draft model grows trees; n-gram, suffix and EAGLE trees are not built yet
    tree_proposers = ("draft",)

    def __init__(self, nodes: int, width: int) -> None:
        if not 1 <= nodes <= TREE_MAX_NODES:
            raise ValueError(f"tree:NxW needs a node budget N from 1 to {TREE_MAX_NODES}, got {nodes}")
        if width < 2:
            raise ValueError(f"tree:NxW needs a width W of at least 2 (W = 1 is the chain fixed:{nodes}), got {width}")
        self.nodes, self.width = nodes, width
        self.name = f"tree:{nodes}x{width}"

    def choose(self, state: DecodeState) -> Action:
        return Action(k=self.nodes, proposer=self.drafter, width=self.width)


def parse_tree(arg: str | None) -> FixedTreePolicy:
    """`tree:NxW` (N nodes at most, W children a node at most); `tree` alone is tree:8x3."""
    text = arg or "8x3"
    nodes, sep, width = text.partition("x")
    try:
        return FixedTreePolicy(int(nodes), int(width) if sep else 3)
    except ValueError as e:
        if "tree:NxW" in str(e):
            raise
        raise ValueError(f"tree:NxW takes two integers, the node budget and the width (tree:8x3), got {text!r}") from None
