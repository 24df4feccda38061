"""Trace-backed oracles for exact what-if replay (docs/architecture.md, "Traces and replay").

Under greedy decoding the emitted tokens do not depend on γ, so a trace (the target's output and,
at every position p, the draft's 8-token proposal and L(p), how many of its tokens match the
output) says what any step would have done: the proposer returns the recorded proposal, the
verifier accepts min(L(p), k) of it and emits the output's next tokens. Torch-free."""
from __future__ import annotations

from typing import Callable

from engine.costs import CostTable
from engine.records import DraftToken
from engine.step import ModelledClock, draft_tokens


class TraceProposer:
    """The recorded proposals. It keeps the live draft's reading schedule (the prompt at its
    first draft, then what was emitted since it last drafted) so that policies weighing the
    draft's catch-up see what they would live; with a cost table it prices each catch-up on
    `clock`, as the live draft spends it."""

    def __init__(self, positions: dict[int, dict], n_prompt: int = 0, costs: CostTable | None = None,
                 clock: ModelledClock | None = None) -> None:
        self.at = positions  # position → its trace_positions row
        self.pos = 0  # emitted tokens so far
        self.costs, self.clock, self.n_prompt = costs, clock, n_prompt
        self._prompt_unread = n_prompt  # until the first draft reads it
        self._pending = 0  # context tokens emitted since the last draft, the newest included
        self._drafted = 0

    @property
    def unread(self) -> tuple[int, int]:
        return self._prompt_unread, self._pending - 1

    def propose(self, k: int, keep_drafting: Callable[[int, DraftToken], bool]) -> list[DraftToken]:
        self._drafted = 0
        if k == 0:
            return []
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.catchup_cost(*self.unread, self.n_prompt + self.pos) or 0.0
        self._prompt_unread = 0
        row = self.at[self.pos]
        drafted = draft_tokens(k, keep_drafting, lambda j: DraftToken(
            int(row["draft_ids"][j]), float(row["entropies"][j]), float(row["confidences"][j])))
        self._drafted = len(drafted)
        return drafted

    def update(self, accepted: int, emitted: list[int]) -> None:
        self.pos += len(emitted)
        # As the live draft: it read d_1 … d_{k-1}; those accepted stay, the rest is re-read.
        kept = min(accepted, self._drafted - 1) if self._drafted else 0
        self._pending = (self._pending if not self._drafted else 0) + len(emitted) - kept
        self._drafted = 0


class TraceVerifier:
    """Emits the traced output; with a cost table, advances `clock` by each step's price."""

    def __init__(self, output: list[int], positions: dict[int, dict], n_prompt: int,
                 costs: CostTable | None = None, clock: ModelledClock | None = None) -> None:
        self.out, self.at, self.n_prompt = output, positions, n_prompt
        self.costs, self.clock = costs, clock
        self.pos = 0
        self.ended = False
        self.reused = 0  # a trace holds no KV to reuse

    def prefill(self, take: Callable[[int], int] = lambda offered: offered) -> int:
        return self._emit(self.out[:1])[0]

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        n = min(int(self.at[self.pos]["accept_len"]), len(drafted))
        if self.costs is not None and self.clock is not None:
            self.clock.now += self.costs.step_ms(len(drafted), self.n_prompt + self.pos)
        # The output ends at EOS or at the budget: slicing cuts there, as a live verify does.
        return n, self._emit(self.out[self.pos : self.pos + n + 1])

    def _emit(self, new: list[int]) -> list[int]:
        self.pos += len(new)
        self.ended = self.pos >= len(self.out)
        return new
