"""Trace-backed oracles for exact what-if replay (docs/architecture.md, "Traces and replay").

Under greedy decoding the emitted tokens do not depend on γ nor on who drafted, so a trace (the
target's output and, at every position p, each proposer's 8-token proposal from there) says what
any step would have done: a proposer returns its recorded proposal, the verifier accepts the
common prefix of the drafted ids and the output's next tokens and emits those. Torch-free."""
from __future__ import annotations

import math
from typing import Callable

from engine.decode.costs import CostTable
from engine.decode.records import K_MAX, UNBOUNDED, DraftToken
from engine.decode.step import ModelledClock, draft_tokens
from engine.decode.tree import DraftTree, depths, greedy_path, stored_tree, tree_levels

# How the live proposers' `unread` moves, which replay follows. Both read lazily: the prompt at
# their first draft, then what was emitted since they last read. "draft": the draft model read
# d_1 … d_{k-1} while drafting and keeps those that stood (the newest token, which every draft
# reads, is not counted); "rows": the EAGLE head drops every drafted row and reads one row per
# emitted token. Any other proposer (n-gram lookup) reads nothing with a model: (0, 0).
READING = {"draft": "draft", "eagle": "rows"}


class TraceProposer:
    """One proposer's recorded proposals. A lazy reader keeps the live reading schedule (the
    prompt at its first draft, then what was emitted since it last drafted) so that policies
    weighing the catch-up see what they would live; with a cost table it prices each catch-up
    and each drafted token on `clock`, as the live proposer spends them."""

    def __init__(self, positions: dict[int, dict], n_prompt: int = 0, costs: CostTable | None = None,
                 clock: ModelledClock | None = None, name: str = "draft", tree_width: int | None = None) -> None:
        self.at = positions  # position → this proposer's trace_positions row
        self.name = name
        self.tree_width = tree_width  # the width of the trees the trace holds (None: none; a policy reads 0)
        self.pos = 0  # emitted tokens so far
        self.costs, self.clock, self.n_prompt = costs, clock, n_prompt
        self.reading = READING.get(name)
        self.lazy = self.reading is not None
        self._prompt_unread = n_prompt if self.lazy else 0  # until the first draft reads it
        self._pending = 0  # context tokens emitted since the last draft, the newest included
        self._drafted = 0

    @property
    def unread(self) -> tuple[int, int]:
        return (self._prompt_unread, self._pending - 1) if self.lazy else (0, 0)

    def lookahead(self) -> int:
        """As recorded at this position (NULL, or a trace from before proposers: a model's)."""
        value = self.at[self.pos].get("lookahead") if self.pos in self.at else None
        return UNBOUNDED if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        self._drafted = 0
        if k == 0:
            return []
        ctx = self.n_prompt + self.pos
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.catchup_cost(*self.unread, ctx, self.name) or 0.0
        self._prompt_unread = 0
        row = self.at[self.pos]
        ids = list(row["draft_ids"])  # a live propose(k) drafts the first min(k, len) of them
        drafted = draft_tokens(min(k, len(ids)), keep_drafting, lambda j: DraftToken(
            int(ids[j]), float(row["entropies"][j]), float(row["confidences"][j])))
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.draft_part(len(drafted), ctx, self.name)
        self._drafted = len(drafted)
        return drafted

    def propose_tree(self, nodes: int, width: int) -> DraftTree:
        """The first `nodes` rows of the tree recorded here (the draft's best-first rows at the
        trace's width: a smaller budget's tree is their prefix, oracles/tree_growth.py). Priced as
        the live draft spends it: its catch-up, then one read per level it grew."""
        row = self.at[self.pos]
        parents = row.get("tree_parents")
        if not stored_tree(parents) or self.tree_width is None:
            raise ValueError("this trace holds no token trees (made before them, or with a draft that grows none): "
                             "trace the prompts again (`python -m engine trace`)")
        if width != self.tree_width:
            raise ValueError(f"the trace's trees are {self.tree_width} wide; a tree policy of width {width} "
                             f"cannot replay on them: use tree:N×{self.tree_width}")
        tree = DraftTree()
        for token, parent in list(zip(row["tree_ids"], parents))[:nodes]:
            tree.add(int(parent), DraftToken(int(token), 0.0, 1.0), self.name)
        ctx = self.n_prompt + self.pos
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.catchup_cost(*self.unread, ctx, self.name) or 0.0
            self.clock.now += self.costs.tree_draft_part(tree_levels(tree.parents, nodes, K_MAX), ctx)
        self._prompt_unread, self._pending, self._drafted = 0, 1, 0  # the context read, the root pending
        return tree

    def update(self, accepted: int, emitted: list[int]) -> None:
        self.pos += len(emitted)
        if not self._drafted:
            self._pending += len(emitted)
        elif self.reading == "draft":  # it read d_1 … d_{k-1}; those accepted stay, the rest is re-read
            self._pending = len(emitted) - min(accepted, self._drafted - 1)
        else:  # a row per emitted token, the newest's included
            self._pending = len(emitted) + 1
        self._drafted = 0


class TraceVerifier:
    """Emits the traced output: the drafted ids it agrees with, then its next token. With a cost
    table, advances `clock` by each verify's price (the proposer charges its drafting)."""

    def __init__(self, output: list[int], n_prompt: int, costs: CostTable | None = None,
                 clock: ModelledClock | None = None) -> None:
        self.out, self.n_prompt = output, n_prompt
        self.costs, self.clock = costs, clock
        self.pos = 0
        self.ended = False
        self.reused = 0  # a trace holds no KV to reuse

    def prefill(self, take: Callable[[int], int] = lambda offered: offered) -> int:
        return self._emit(self.out[:1])[0]

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        n = 0
        while n < len(drafted) and self.pos + n < len(self.out) and drafted[n].token_id == self.out[self.pos + n]:
            n += 1
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.verify_part(len(drafted), self.n_prompt + self.pos)
        # The output ends at EOS or at the budget: slicing cuts there, as a live verify does.
        return n, self._emit(self.out[self.pos : self.pos + n + 1])

    def verify_tree(self, tree: DraftTree) -> tuple[list[int], list[int]]:
        """The root path whose tokens the output holds next (greedy acceptance: the output's token
        at a row's depth is the target's choice after it, past the output's end none), and its
        emitted tokens."""
        ahead = [self.pos + d for d in [0] + depths(tree.parents)]
        path, _ = greedy_path(tree, [self.out[p] if p < len(self.out) else -1 for p in ahead])
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.tree_verify_part(tree.size, self.n_prompt + self.pos)
        return path, self._emit(self.out[self.pos : self.pos + len(path) + 1])

    def _emit(self, new: list[int]) -> list[int]:
        self.pos += len(new)
        self.ended = self.pos >= len(self.out)
        return new
