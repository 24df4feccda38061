"""What the stored runs and traces say about one pair's speed and acceptance on one device, tier
and KV tier: the live steps' times (cost calibration) and the first drafted token's acceptance
(a policy's prior), read-only queries the Store gets from this mixin."""

from __future__ import annotations

from contextlib import AbstractContextManager

import duckdb
import pandas as pd

_PAIR_LIVE_STEPS = (" FROM steps s JOIN runs r ON r.run_id = s.run_id WHERE r.device = ? AND r.target = ?"
                    " AND r.draft = ? AND r.target_tier = ? AND (CAST(? AS VARCHAR) IS NULL OR coalesce(r.kv_tier, 'native') = ?)"
                    " AND r.source = 'speclab' AND r.error IS NULL")


# Chain steps only: a token tree's step (its shape stored) neither times a chain of as many tokens
# nor says whether a first drafted token stood.
_CHAINS = " AND (s.tree_parents IS NULL OR len(s.tree_parents) = 0)"


class PairMeasures:
    """Queries over one pair's stored live steps and traces; the Store supplies `_reader`."""

    def _reader(self) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        raise NotImplementedError

    def step_times(self, device: str, target: str, draft: str, target_tier: str,
                   kv_tier: str | None = None) -> pd.DataFrame:
        """(k_drafted, context_len, ms, proposer) of every decode step after the prefill of the
        finished runs of one pair on one device, tier and KV tier (None: any); ms = draft_ms +
        verify_ms; proposer: who drafted it ('draft' for plain steps, whose price is no proposer's)."""
        sql = ("SELECT s.k_drafted, s.context_len, s.draft_ms + s.verify_ms AS ms,"
               " coalesce(nullif(s.proposer, ''), 'draft') AS proposer" + _PAIR_LIVE_STEPS +
               " AND s.step > 0" + _CHAINS + " ORDER BY r.created_at, s.run_id, s.step")
        with self._reader() as con:
            return con.execute(sql, [device, target, draft, target_tier, kv_tier, kv_tier]).df()

    def first_token_acceptance(self, device: str, target: str, draft: str, target_tier: str,
                               kv_tier: str | None = None, proposer: str | None = None) -> tuple[int, int]:
        """(drafting steps whose first drafted token was accepted, drafting steps) over the
        finished live runs of one pair on one device, tier and KV tier (None: any), of the steps
        one proposer drafted (None: any): the per-token acceptance α of the pair, whatever draft
        lengths the runs chose."""
        sql = ("SELECT count(*) FILTER (WHERE s.accepted > 0), count(*)" + _PAIR_LIVE_STEPS + " AND s.k_drafted > 0"
               " AND (CAST(? AS VARCHAR) IS NULL OR s.proposer = ?)" + _CHAINS)
        with self._reader() as con:
            hits, n = con.execute(sql, [device, target, draft, target_tier, kv_tier, kv_tier, proposer,
                                        proposer]).fetchone()
        return int(hits), int(n)

    def traced_first_token_acceptance(self, device: str, target: str, draft: str, target_tier: str,
                                      kv_tier: str | None = None, proposer: str = "draft") -> tuple[int, int]:
        """(positions whose first proposed token the target kept, positions) over the stored
        traces of one pair on one device, tier and KV tier (None: any), for one proposer, where
        it had something to propose (a lookup without a match proposes nothing): what a drafting
        step there would have kept, at every position rather than at those a policy chose."""
        sql = ("SELECT count(*) FILTER (WHERE p.accept_len > 0), count(*) FROM trace_positions p"
               " JOIN traces t ON t.trace_id = p.trace_id WHERE t.device = ? AND t.target = ? AND t.draft = ?"
               " AND t.target_tier = ? AND (CAST(? AS VARCHAR) IS NULL OR coalesce(t.kv_tier, 'native') = ?)"
               " AND p.proposer = ? AND (p.lookahead IS NULL OR p.lookahead > 0)")
        with self._reader() as con:
            hits, n = con.execute(sql, [device, target, draft, target_tier, kv_tier, kv_tier, proposer]).fetchone()
        return int(hits), int(n)
