"""The Policy protocol every γ controller implements (DESIGN.md, "The decode step")."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.records import Action, DecodeState, DraftToken, StepRecord


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


class BasePolicy:
    """Defaults for the optional hooks: draft the full γ, learn nothing."""

    name = "base"

    def choose(self, state: DecodeState) -> Action:
        raise NotImplementedError

    def keep_drafting(self, state: DecodeState, j: int, token: DraftToken) -> bool:
        return True

    def observe(self, record: StepRecord) -> None:
        pass

    def reset(self) -> None:
        pass


# Plain (k = 0) steps teach an adaptive policy nothing about acceptance, so after this many in a
# row `speckv` and `rakv` draft one token to refresh what they know.
PROBE_AFTER = 8


def ar_streak(state: DecodeState) -> int:
    """Plain (k = 0) decode steps in a row just before this one."""
    n = 0
    for rec in reversed(state.history):
        if rec.step == 0 or rec.k_chosen > 0:
            break
        n += 1
    return n
