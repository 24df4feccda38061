"""The Policy protocol every γ controller implements, and BasePolicy's defaults for its optional hooks
(docs/architecture.md, "Policies and controllers"). When drafting, a probe or a reuse pays is in
payoff.py."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.decode.records import Action, DecodeState, DraftToken, StepRecord


@runtime_checkable
class Policy(Protocol):
    name: str

    def choose(self, state: DecodeState) -> Action:
        """Before drafting: the draft length (0 = plain decoding) and prefix reuse."""
        ...

    def keep_drafting(self, state: DecodeState, j: int, token: DraftToken) -> bool:
        """After drafting token j (0-based): draft another one? Lets a policy stop early."""
        ...

    def observe(self, record: StepRecord) -> None:
        """After verifying: the step's outcome, for adaptive policies."""
        ...

    def reset(self) -> None:
        """Forget per-run state before a new generation."""
        ...

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        """Before the prefill: how many of the `offered` prompt positions a prefix cache holds
        to take (0 recomputes the whole prompt)."""
        ...


class BasePolicy:
    """Defaults for the optional hooks: draft the full γ, learn nothing."""

    name = "base"
    why = ""  # the last choice's reason in one line, for the workbench (a policy may leave it empty)
    # The proposers the run builds for it (None: every one the pair has), which the spec's
    # `@proposer` sets (engine/decode/policies/__init__.py), and their options from the spec
    # (name → {option: text}; never mutated). A policy that does not choose among proposers
    # (all but policies.CHOOSERS) has one: the draft model unless the spec names another.
    proposers: tuple[str, ...] | None = None
    proposer_options: dict[str, dict[str, str]] = {}

    @property
    def drafter(self) -> str:
        """Who a one-proposer policy drafts with."""
        return self.proposers[0] if self.proposers else "draft"

    def choose(self, state: DecodeState) -> Action:
        raise NotImplementedError

    def keep_drafting(self, state: DecodeState, j: int, token: DraftToken) -> bool:
        return True

    def observe(self, record: StepRecord) -> None:
        pass

    def reset(self) -> None:
        pass

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        return offered
