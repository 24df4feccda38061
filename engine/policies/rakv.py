"""`rakv`: RAKV-ASD's draft-length rule (docs/architecture.md, "Policies and controllers"). An EWMA of per-token
acceptance α (the engine keeps it) and the measured cost table give, for every k in
{0, 1, 2, 4, 6, 8}, the expected cost per token; the cheapest wins, so plain decoding (k = 0)
is chosen whenever speculation would not pay, and whenever its saving over the tokens left would
not repay the draft's catch-up read (the prompt, before a request's first draft). Before the
prefill it takes or declines the prefix cache's offer by the measured prefill costs (`take_reuse`)."""
from __future__ import annotations

import numpy as np

from engine.predictor import candidates, expected_tokens
from engine.costs import CostTable
from engine.policies.base import BasePolicy, catchup_pays, probe_due, probe_pays, reuse_that_pays
from engine.records import Action, DecodeState


# rakv's prior α0 counts as this many trials beside the EWMA's own: one accepted probe alone
# (α = 1/1) would otherwise send it to k = 8, a gamble that costs ~5 plain steps when it fails.
PRIOR_TRIALS = 4.0
# The prior α0 where nothing better is known; `python -m engine` passes the pair's per-token
# acceptance measured by stored runs instead (service.policy_context), `rakv:α0` sets it.
ALPHA0 = 0.6


class RakvPolicy(BasePolicy):
    def __init__(self, costs: CostTable, alpha0: float = ALPHA0, name: str | None = None) -> None:
        if not 0.0 <= alpha0 < 1.0:
            raise ValueError(f"rakv:α0 needs 0 ≤ α0 < 1, got {alpha0}")
        self.costs, self.alpha0 = costs, alpha0
        self.name = name or ("rakv" if alpha0 == ALPHA0 else f"rakv:{alpha0:g}")
        self._last: tuple = ()  # (inputs, k) of the last decision: plain streaks repeat it

    def choose(self, state: DecodeState) -> Action:
        if probe_due(state, self.costs):
            pays = probe_pays(self.costs, state, self.alpha0)
            self.why = ("probe: plain for a while, draft 1 token to re-measure acceptance" if pays
                        else "plain: a probe would not repay the draft's catch-up read")
            return Action(k=1 if pays else 0)
        n = state.alpha_trials if state.alpha_ewma is not None else 0.0
        alpha = ((state.alpha_ewma or 0.0) * n + self.alpha0 * PRIOR_TRIALS) / (n + PRIOR_TRIALS)
        ks = candidates(state)
        key = (alpha, self.costs.bucket_of(state.context_len), ks)
        if not (self._last and self._last[0] == key):
            ks_arr = np.array(ks)
            ms_per_token = np.array([self.costs.step_ms(int(k), state.context_len) for k in ks]) / expected_tokens(alpha, ks_arr)
            best = int(np.argmin(ms_per_token))
            self._last = (key, (int(ks_arr[best]), float(ms_per_token[best])))
        k, ms = self._last[1]
        plain_ms = self.costs.step_ms(0, state.context_len)
        if k and not catchup_pays(self.costs, state, ms):
            self.why = f"plain: γ {k} would save {plain_ms - ms:.1f} ms/token, not enough to repay the draft's catch-up"
            return Action(k=0)
        self.why = (f"α ≈ {alpha:.2f}: γ {k} costs {ms:.1f} ms/token against {plain_ms:.1f} plain" if k
                    else f"α ≈ {alpha:.2f}: no γ beats plain decoding ({plain_ms:.1f} ms/token)")
        return Action(k=k)

    def reset(self) -> None:
        self._last = ()

    def take_reuse(self, offered: int, n_prompt: int) -> int:
        return reuse_that_pays(self.costs, offered, n_prompt)
