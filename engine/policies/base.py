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


# Plain (k = 0) steps teach an adaptive policy nothing about acceptance, so after PROBE_AFTER of
# them in a row `speckv` and `rakv` draft one token to refresh what they know. A probe costs a
# little when speculation does not pay (a tier where the target is cheap, a text the draft gets
# wrong), so each probe that led straight back to plain decoding doubles the wait, up to PROBE_MAX.
PROBE_AFTER = 8
PROBE_MAX = 64


def _plain(rec: StepRecord) -> bool:
    return rec.step > 0 and rec.k_chosen == 0


def probe_due(state: DecodeState) -> bool:
    """Whether this step should draft one token to probe acceptance (see PROBE_AFTER)."""
    hist, i = state.history, len(state.history) - 1
    streak = 0
    while i >= 0 and _plain(hist[i]):
        streak, i = streak + 1, i - 1
    wait = PROBE_AFTER
    # Walking back: … plain, drafting step, plain × streak. A drafting step between plain ones
    # is a probe that did not pay (or a lone draft: the same lesson).
    while wait < PROBE_MAX and i >= 1 and hist[i].k_chosen > 0 and _plain(hist[i - 1]):
        wait, i = wait * 2, i - 1
        while i >= 0 and _plain(hist[i]):
            i -= 1
    return streak >= min(wait, PROBE_MAX)
