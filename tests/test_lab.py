"""Profiling, traces, exact what-if replay, controllers and retraining, on tiny random models."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.base.names import DATA_DIR
from engine.decode.costs import CostTable
from engine.decode.policies import PolicyContext, make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.lab.profiling import measure_costs, trace
from engine.lab.whatif import replay, summarize
from engine.training.retrain import fit_forest, fit_mlp, from_traces

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [("code", "def add(a, b):"), ("chat", "Hello there, how"), ("math", "2 + 2 = 4. 3 + 3 ="),
           ("chat", "The weather today")]
MAX_NEW = 40


@pytest.fixture(scope="module")
def traced(tiny_pair):
    import pandas as pd

    traces = [trace(tiny_pair, p, task, MAX_NEW) for task, p in PROMPTS]
    rows = pd.DataFrame([dict(t.row, trace_id=f"t{i}") for i, t in enumerate(traces)])
    pos = pd.DataFrame([dict(r, trace_id=f"t{i}") for i, t in enumerate(traces) for r in t.positions])
    mlp = fit_mlp(*_xy(from_traces(rows, pos)))
    costs = measure_costs(tiny_pair, buckets=(8, 32), reps=2)
    return traces, PolicyContext(costs=costs, controller=lambda name, version: mlp)


def _xy(ex):
    return ex.x, ex.y


def _live(pair, prompt, spec, ctx):
    ids = encode_prompt(pair.tokenizer, prompt, chat=True)
    return Generation(pair, ids, make_policy(spec, ctx), GenConfig(max_new_tokens=MAX_NEW)).run()


def test_trace_records_the_target_output_and_draft_agreement(tiny_pair, traced):
    traces, _ = traced
    for t in traces:
        out = t.row["token_ids"]
        draft = [r for r in t.positions if r["proposer"] == "draft"]  # every proposer has its rows (test_proposers.py)
        assert len(draft) == len(out) - 1 and [r["position"] for r in draft] == list(range(1, len(out)))
        for r in draft:
            n = r["accept_len"]
            # L(p) counts exactly the leading draft tokens equal to the target's output.
            assert r["draft_ids"][:n] == out[r["position"]: r["position"] + n]
            assert n == 8 or r["position"] + n == len(out) or r["draft_ids"][n] != out[r["position"] + n]
            assert len(r["entropies"]) == len(r["confidences"]) == 8
    assert any(r["accept_len"] > 0 for t in traces for r in t.positions if r["proposer"] == "draft")  # the noisy draft agrees sometimes


def _live_and_replayed(pair, t, spec: str, ctx):
    """`spec` run live on a traced prompt and replayed over its trace: the same output, and step
    for step the same (γ chosen, drafted, accepted, emitted)."""
    live = _live(pair, t.row["prompt"], spec, ctx)
    rep = replay(make_policy(spec, ctx), t.row, t.positions, ctx.costs)
    assert live.token_ids == t.row["token_ids"]
    assert rep.outcome() == [(r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in live.records[1:]]
    return live, rep


@pytest.mark.parametrize("spec", ["fixed:1", "fixed:3", "fixed:8", "heuristic", "threshold:0.5", "speckv", "rakv"])
def test_replay_matches_the_live_run_step_for_step(tiny_pair, traced, spec):
    traces, ctx = traced
    for t in traces[:3]:
        live, rep = _live_and_replayed(tiny_pair, t, spec, ctx)
        # Same features in, same decisions out: the signals of each drafted step agree exactly.
        assert [r.entropies for r in rep.steps] == [r.entropies for r in live.records]


@pytest.mark.parametrize("spec", ["tree:6x3", "tree:16x3", "tree:1x3"])
def test_replay_of_a_tree_policy_matches_the_live_run_step_for_step(tiny_pair, traced, spec):
    """Each position of a trace holds the draft's tree of 16 nodes at width 3; a tree policy of N
    nodes replays its first N rows, and the outcome is the live run's, step for step, tree for tree.
    Replay prices the tree's draft levels and its verify from the chain table."""
    traces, ctx = traced
    for t in traces[:3]:
        live, rep = _live_and_replayed(tiny_pair, t, spec, ctx)
        assert [(r.tree_parents, r.draft_ids) for r in rep.steps] == [(r.tree_parents, r.draft_ids) for r in live.records]
        assert rep.decode_ms > 0
    drafts = [r for t in traces for r in t.positions if r["proposer"] == "draft"]
    assert all(len(r["tree_ids"]) == len(r["tree_parents"]) == 16 for r in drafts)
    assert t.row["config"]["tree_width"] == 3


def test_a_cost_table_prices_token_trees_and_keeps_them_in_the_store(traced):
    """measure_costs times one level of the draft's tree growth and a 16-node tree's verify per
    bucket; the figures survive the store, and a tree's verify between 9 and 17 rows lies on
    the line from the chain's longest verify to the measured tree's."""
    from engine.decode.costs import CostTable

    _, ctx = traced
    costs = ctx.costs
    assert costs.prices_trees and len(costs.tree_level_ms) == len(costs.tree_verify_ms) == len(costs.buckets)
    assert all(x > 0 for x in costs.tree_level_ms + costs.tree_verify_ms)
    back = CostTable.from_rows([dict(r, cost_id="c") for r in costs.to_rows(2)])
    assert back.tree_level_ms == costs.tree_level_ms and back.tree_verify_ms == costs.tree_verify_ms
    c = costs.buckets[0]
    nine, sixteen = costs.tree_verify_part(8, c), costs.tree_verify_part(16, c)
    assert nine <= costs.tree_verify_part(12, c) <= sixteen and sixteen >= costs.verify_part(8, c)
    assert costs.tree_step_ms(8, 3, c) == costs.tree_draft_part(3, c) + costs.tree_verify_part(8, c)


def test_rakv_that_drafts_trees_replays_as_it_ran(tiny_pair, traced):
    """Where the table makes a wide verify cheap, rakv drafts trees; what-if replay over traces
    that hold them makes the same choices, tree for tree, as the live run."""
    import dataclasses

    traces, ctx = traced
    cheap = dataclasses.replace(ctx.costs, tree_level_ms=[x / 4 for x in ctx.costs.draft_ms],
                                tree_verify_ms=[row[1] for row in ctx.costs.verify_ms])
    tctx = dataclasses.replace(ctx, costs=cheap)
    chose = 0
    for t in traces[:3]:
        live, rep = _live_and_replayed(tiny_pair, t, "rakv", tctx)
        assert [r.tree_parents for r in rep.steps] == [r.tree_parents for r in live.records]
        chose += sum(1 for r in live.records if r.tree_parents)
    assert chose > 0


def test_a_tree_policy_on_a_trace_without_trees_or_of_another_width_is_one_line(traced):
    traces, ctx = traced
    t = traces[0]
    old = dict(t.row, config={"temperature": None, "proposers": ["draft"]})  # a trace from before trees
    bare = [{k: v for k, v in r.items() if k not in ("tree_ids", "tree_parents")} for r in t.positions]
    with pytest.raises(ValueError, match="holds none \\(made before them\\): trace the prompts again") as e:
        replay(make_policy("tree:8x3", ctx), old, bare, ctx.costs)
    with pytest.raises(ValueError, match="the trace's trees are 3 wide") as f:
        replay(make_policy("tree:8x2", ctx), t.row, t.positions, ctx.costs)
    assert "\n" not in str(e.value) + str(f.value)
    assert replay(make_policy("fixed:4", ctx), old, bare, ctx.costs).steps  # chains replay as before


class _Unread:
    """Wraps a policy, noting what each decision was told the draft had left to read."""

    def __init__(self, policy):
        self.policy, self.name, self.seen = policy, policy.name, []

    def choose(self, state):
        self.seen.append(state.draft_unread)
        return self.policy.choose(state)

    def __getattr__(self, name):
        return getattr(self.policy, name)


def test_replay_tells_policies_the_draft_catch_up_a_live_run_has(tiny_pair, traced):
    traces, ctx = traced
    t = traces[0]
    ids = encode_prompt(tiny_pair.tokenizer, t.row["prompt"], chat=True)
    for spec in ("heuristic", "fixed:2", "ar"):
        live, rep = _Unread(make_policy(spec, ctx)), _Unread(make_policy(spec, ctx))
        Generation(tiny_pair, ids, live, GenConfig(max_new_tokens=MAX_NEW)).run()
        replay(rep, t.row, t.positions, ctx.costs)
        assert live.seen == rep.seen and live.seen[0] == (len(ids), 0)  # the whole prompt before the first draft
        if spec == "ar":
            assert live.seen == [(len(ids), i) for i in range(len(live.seen))]  # it never reads
        if spec == "fixed:2":
            assert all(cold == 0 and warm <= 2 for cold, warm in live.seen[1:])  # what it emitted, less the newest


def test_replay_costs_and_summary(traced):
    traces, ctx = traced
    reps = [replay(make_policy(s, ctx), t.row, t.positions, ctx.costs) for t in traces for s in ("ar", "fixed:4")]
    rows = {(r["policy"], r["task"]): r for r in summarize(reps)}
    ar, f4 = rows[("ar", "all")], rows[("fixed:4", "all")]
    assert ar["tokens_per_step"] == 1.0 and ar["steps"] == ar["tokens"]
    assert f4["tokens_per_step"] >= 1.0 and f4["tokens"] == ar["tokens"]  # same output, fewer steps
    # With every step priced alike, plain decoding replays at exactly 1000 / (its step's ms).
    flat = CostTable([1], [2.0], [[10.0 + k for k in range(9)]])
    ar_flat = summarize([replay(make_policy("ar", ctx), t.row, t.positions, flat) for t in traces])
    assert [r["tokens_per_s"] for r in ar_flat if r["task"] == "all"] == [pytest.approx(100.0)]


def test_cost_table_lookup_uses_the_bucket_at_or_below_and_grows_past_the_last():
    from engine.decode.costs import EXTRAPOLATE_STRIDE as S

    t = CostTable([64, 256], [1.0, 2.0], [[10.0 + k for k in range(9)], [10.5 + 2 * k for k in range(9)]],
                  warm_read_ms=[0.5, 0.5], cold_read_ms=[8.0, 20.0])
    assert t.step_ms(0, 10) == 10.0 and t.step_ms(4, 100) == 4 * 1.0 + 14.0 and t.step_ms(2, 256 + S - 1) == 2 * 2.0 + 14.5
    # Past the last bucket: along the last two buckets' slope, read at whole strides beyond it.
    beyond = 3 * S
    assert t.band(256 + beyond + S - 1) == t.band(256 + beyond) == 256 + beyond
    # The draft along its slope (2-1)/192; a verify of 3 rows by 3 × the median growth per row
    # over k (k = 4's: (14.5 + 4 - 14) / 5 / 192), the pooled slope a noisy median per k needs.
    draft, verify = 2.0 + beyond * 1.0 / 192, 14.5 + 3 * beyond * 0.9 / 192
    assert t.row_slope() == pytest.approx(0.9 / 192)
    assert t.step_ms(2, 256 + beyond + 5) == pytest.approx(2 * draft + verify)
    # A verify of several rows grows faster than a plain step: so does its price against one.
    assert t.verify_part(2, 256 + beyond) / t.verify_part(0, 256 + beyond) > t.verify_part(2, 256) / t.verify_part(0, 256)
    # A falling pair of medians (noise) stays flat instead, and so does a flat cost.
    assert CostTable([64, 256], [2.0, 1.0], [[10.0] * 9, [9.0] * 9]).step_ms(1, 5000) == 1.0 + 9.0
    assert t.catchup_cost(0, 4, 5000) == 4 * 0.5


def test_a_table_holds_the_buckets_its_runs_reach():
    from engine.decode.costs import CONTEXT_BUCKETS, buckets_for

    assert CONTEXT_BUCKETS == (64, 256, 512, 1024)
    assert buckets_for(None, 8192) == CONTEXT_BUCKETS  # any run: every bucket
    assert buckets_for(40, 8192) == buckets_for(256, 8192) == (64, 256)  # two at least: a slope past the last
    assert buckets_for(257, 8192) == (64, 256, 512) and buckets_for(5000, 8192) == CONTEXT_BUCKETS
    assert buckets_for(5000, 300) == (64, 256) and buckets_for(10, 40) == (64,)  # what the model's context holds
    assert buckets_for(40, 8192, at_least=1) == (64,)  # extending a table: what the run reaches alone


def test_a_longer_run_extends_the_stored_table_and_keeps_what_was_measured(tiny_pair, monkeypatch):
    """A first short run measures the buckets it reaches; the same reach reads the stored table;
    a longer one measures only the buckets it lacks and stores the table extended by them, its
    first buckets, fill cost and calibration as they were."""
    from dataclasses import replace

    from engine.lab import profiling
    from engine.service import cost_key, cost_table, reach, stored_costs
    from store import Store

    asked = []

    def spy(pair, buckets, **kw):  # the real measurement (one timed round), its buckets noted
        asked.append(buckets)
        return measure_costs(pair, buckets, 1, **kw)

    monkeypatch.setattr(profiling, "measure_costs", spy)
    with Store(":memory:") as st:
        short = cost_table(st, tiny_pair, context=reach(20, 40))
        assert short.buckets == [64, 256] and asked == [(64, 256)]
        calibrated = replace(short, step_factor=[1.5] * 9)
        st.add_costs(calibrated.to_rows(1))  # as `costs --calibrate` leaves it
        assert cost_table(st, tiny_pair, context=200).step_factor == [1.5] * 9 and len(asked) == 1
        long = cost_table(st, tiny_pair, context=reach(500, 128))
        assert asked == [(64, 256), (512, 1024)] and long.buckets == [64, 256, 512, 1024]
        for k, ctx in ((0, 10), (4, 100), (8, 300)):
            assert long.step_ms(k, ctx, "ngram") == calibrated.step_ms(k, ctx, "ngram")
        assert long.fill_ms == short.fill_ms and long.prefill_ms[:2] == short.prefill_ms
        assert stored_costs(st, cost_key(tiny_pair)).buckets == long.buckets
        assert cost_table(st, tiny_pair).buckets == long.buckets and len(asked) == 2  # a run of any length reads it
        st.add_costs(measure_costs(tiny_pair, (8, 32), 1).to_rows(1))  # `costs --buckets 8,32`, then a 50-token run
        assert cost_table(st, tiny_pair, context=50).buckets == [8, 32, 64] and asked[2:] == [(64,)]


def test_a_table_measured_in_turns_takes_the_slot_per_bucket(tiny_pair, monkeypatch):
    """service.measure_in_turns (a sweep's and a comparison's cost measurement): each hold of the
    decode slot measures one bucket (a new table's first two), so a decode pressed meanwhile
    waits for a bucket; afterwards the table covers the reach and nothing is measured again."""
    import contextlib

    from engine.lab import profiling
    from engine.service import cost_table, measure_in_turns, reach
    from store import Store

    asked, held = [], []

    def spy(pair, buckets, **kw):
        asked.append((len(held), buckets))
        return measure_costs(pair, buckets, 1, **kw)

    @contextlib.contextmanager
    def hold():
        held.append(True)
        yield

    monkeypatch.setattr(profiling, "measure_costs", spy)
    with Store(":memory:") as st:
        measure_in_turns(st, tiny_pair, "native", reach(500, 128), hold)
        assert asked == [(1, (64, 256)), (2, (512,)), (3, (1024,))] and len(held) == 3
        assert cost_table(st, tiny_pair, context=reach(500, 128)).buckets == [64, 256, 512, 1024]
        measure_in_turns(st, tiny_pair, "native", reach(500, 128), hold)
        assert len(asked) == 3 and len(held) == 3  # nothing lacking: the slot is not even taken


def test_a_live_run_opens_outside_the_slot_unless_a_probe_runs_the_models(tiny_pair, tmp_path):
    """service.costs.tables.would_probe: a policy that weighs no costs, or one whose table is
    stored, opens without the decode slot (its first turn is its prefill); one that would probe
    a missing table opens inside it."""
    from engine.service.costs.tables import cost_table, would_probe
    from store import Store

    db = str(tmp_path / "x.duckdb")
    assert not would_probe(db, tiny_pair, "fixed:2") and would_probe(db, tiny_pair, "rakv")
    with Store(db) as st:
        st.add_costs(measure_costs(tiny_pair, (64, 256), 1).to_rows(1))
        assert cost_table(st, tiny_pair, measure=False).buckets == [64, 256]
    assert not would_probe(db, tiny_pair, "rakv") and would_probe(db, tiny_pair, "rakv", "int8")


def test_long_contexts_are_measured_with_fewer_rounds():
    from engine.decode.costs import CONTEXT_BUCKETS, LONG_CONTEXT, REPS, reps_at

    assert max(CONTEXT_BUCKETS) > LONG_CONTEXT  # the long prompts' costs are measured, not extrapolated
    assert [reps_at(b, REPS) for b in (64, LONG_CONTEXT)] == [REPS, REPS]
    assert reps_at(2 * LONG_CONTEXT, REPS) == REPS // 2 and reps_at(100 * LONG_CONTEXT, REPS) == 3
    assert reps_at(2 * LONG_CONTEXT, 1) == 1  # never more than asked


def test_whole_bucket_reads_run_in_a_few_rounds_spread_over_the_block():
    from engine.lab.profiling import LONG_REPS, long_rounds
    from engine.lab.timing import timed_medians

    assert long_rounds(9, 2) == {0, 2, 6, 10}  # a warm-up, then the first, middle and last timed rounds
    assert long_rounds(4, 2) == {0, 2, 3, 5} and long_rounds(1, 2) == {0, 2} and long_rounds(2, 0) == {0, 1}
    calls = {"short": 0, "long": 0, "then": 0}

    def bump(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    few = long_rounds(9, 2)
    t = timed_medians([(bump("short"), bump("then")), (bump("long"), None)], 9, 2, lambda: None,
                      rounds_of=lambda i: few if i == 1 else None, spread_limit=float("inf"))
    assert len(t.medians) == 2 and calls == {"short": 11, "long": 1 + min(LONG_REPS, 9), "then": 11}


def _busy_for(seconds: float):
    """A function that works the CPU for `seconds` (what a timed forward does)."""
    def work() -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    return work


def test_a_noisy_round_is_refused_and_timed_again():
    """A busy neighbour, simulated by a sleep in one round: that call's CPU share falls, so it is
    timed again instead of entering the median (and the figure is the quiet one)."""
    from engine.lab.timing import timed_medians

    work, calls = _busy_for(0.004), [0]

    def sometimes_stalled() -> None:
        calls[0] += 1
        if calls[0] == 5:  # one call of the timed rounds waits as if the CPU were taken away
            time.sleep(0.2)
        work()

    t = timed_medians([(sometimes_stalled, None), (work, None)], 7, 1)
    assert t.disturbed >= 1 and max(t.samples[0]) < 100, t.samples  # the 200 ms call did not enter them
    assert len(t.samples[0]) >= 7 and t.medians[0] < 10


def test_points_whose_rounds_disagree_get_more_rounds():
    from engine.lab.timing import timed_medians

    pace = iter([0.002, 0.008] * 50)
    t = timed_medians([(lambda: _busy_for(next(pace))(), None)], 6, 0)
    assert t.added_rounds >= 1 and len(t.samples[0]) > 6  # 2 vs 8 ms alternating: wide, so more rounds
    assert len(t.samples[0]) <= 12  # at most twice the rounds asked


def test_a_stored_cost_table_is_monotone_and_carries_its_spread(tiny_pair):
    from engine.decode.costs import is_monotone, monotone

    t = CostTable([64, 256], [1.0, 0.9], [[10.0, 12.0, 30.0, 14.0] + [15.0] * 5, [9.0] + [20.0] * 8],
                  key=dict(device="cpu", target="t", draft="d", target_tier="fp32", draft_tier="fp32"))
    m = monotone(t)
    assert m.verify_ms[0][:4] == [10.0, 12.0, 30.0, 30.0] and m.verify_ms[1][0] == 10.0  # in k, then in context
    assert m.draft_ms == [1.0, 1.0] and is_monotone(m) and not is_monotone(t)
    measured = measure_costs(tiny_pair, buckets=(8, 32), reps=3)
    assert is_monotone(measured) and measured.spread is not None and measured.source == "measured"
    from store import Store

    with Store(":memory:") as st:
        st.add_costs(measured.to_rows(3))
        back = CostTable.from_rows(st.costs().to_dict("records"))
    assert back.spread == pytest.approx(measured.spread) and back.describe().startswith("measured table, ±")


def test_a_busy_machine_is_measured_again_and_then_refused(tiny_pair, monkeypatch):
    """Other processes' CPU time during the measurement (/proc/stat less this process): a table
    measured beside another job is not kept."""
    from engine.lab import profiling, timing

    monkeypatch.setenv("SPECLAB_BUSY_CORES", "0.25")
    readings = iter([0.0, 50.0, 100.0, 150.0])  # every span: 50 CPU-seconds of others' work
    monkeypatch.setattr(timing, "_busy_cpu_s", lambda: next(readings))
    said = []
    with pytest.raises(timing.MachineBusy, match="other processes used .* of a core") as e:
        profiling.measure_costs(tiny_pair, buckets=(8,), reps=1, progress=said.append)
    assert "\n" not in str(e.value) and any("measuring again" in m for m in said)
    quiet = iter([0.0, 0.0])
    monkeypatch.setattr(timing, "_busy_cpu_s", lambda: next(quiet))
    assert profiling.measure_costs(tiny_pair, buckets=(8,), reps=1).busy == 0.0


def test_a_probe_prices_every_proposer_in_seconds_and_is_never_stored(tiny_pair):
    from engine.lab.profiling import probe_costs
    from engine.oracles import available

    t0 = time.perf_counter()
    p = probe_costs(tiny_pair)
    assert time.perf_counter() - t0 < 30 and p.source == "probe" and len(p.buckets) == 1
    assert set(p.proposers) == set(available(tiny_pair)) and len(p.verify_ms[0]) == 9
    assert p.describe() == "probed costs (no measured table yet)"
    with pytest.raises(AssertionError, match="never stored"):
        p.to_rows(3)


def test_a_cost_table_names_its_kernels_and_one_measured_under_others_is_not_read(tiny_dirs, tiny_pair, monkeypatch):
    from engine.runtime.models import load_pair
    from engine.service.costs.tables import cost_key, cost_table, stored_costs
    from store import Store

    table = measure_costs(tiny_pair, buckets=(8,), reps=2)
    assert tiny_pair.kernel_set and table.key["device"] == f"cpu [kernels {tiny_pair.kernel_set}]"
    monkeypatch.setenv("SPECLAB_KERNELS", "mm")  # the same pair, its verifies read through other kernels
    other = load_pair(*map(str, tiny_dirs), target_tier="fp32", device="cpu")
    assert other.kernel_set == "mm" and cost_key(other) != cost_key(tiny_pair)
    with Store(":memory:") as st:
        st.add_costs(table.to_rows(2))
        assert stored_costs(st, cost_key(tiny_pair)) is not None and stored_costs(st, cost_key(other)) is None
        assert cost_table(st, other, context=8, measure=False).source == "probe"  # never the other kernels
        assert len(st.costs()) == len(table.to_rows(2))  # and nothing stored changed


def test_calibration_scales_each_draft_length_to_its_live_steps():
    from engine.decode.costs import CALIBRATE_MIN, calibrate
    from store import Store

    t = CostTable([64, 256], [1.0, 2.0], [[10.0 + k for k in range(9)], [20.0 + k for k in range(9)]],
                  key=dict(device="cpu", target="t", draft="d", target_tier="fp32", draft_tier="fp32"),
                  prefill_ms=[30.0, 90.0], fill_ms=0.02, cold_read_ms=[8.0, 20.0], warm_read_ms=[0.5, 0.75])
    live = [(0, 100, 1.1 * t.step_ms(0, 100))] * CALIBRATE_MIN + [(1, 300, 1.2 * t.step_ms(1, 300))] * CALIBRATE_MIN
    live += [(4, 70, 1.5 * t.step_ms(4, 70))] * CALIBRATE_MIN + [(6, 70, 9.0 * t.step_ms(6, 70))] * (CALIBRATE_MIN - 1)
    cal = calibrate(t, live)
    # k = 2 is nearest to 1, k = 3 to 4; k = 6 has too few steps of its own, so it follows k = 4.
    assert cal.step_factor == pytest.approx([1.1, 1.2, 1.2, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5])
    assert cal.step_ms(1, 300) == pytest.approx(1.2 * t.step_ms(1, 300)) and t.step_factor is None
    assert calibrate(cal, live).step_factor == cal.step_factor  # from the bare forwards, not compounded
    with Store(":memory:") as st:
        st.add_costs(cal.to_rows(3))
        back = CostTable.from_rows(st.costs().to_dict("records"))
    assert back.step_factor == pytest.approx(cal.step_factor) and back.step_ms(4, 64) == pytest.approx(cal.step_ms(4, 64))
    assert back.prefill_cost(160, 100) == pytest.approx(60.0 + 100 * 0.02)  # calibration keeps the prefill
    assert back.catchup_cost(160, 0, 160) == pytest.approx(14.0) and back.catchup_cost(448, 0, 448) == pytest.approx(32.0)
    assert back.catchup_cost(0, 8, 300) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="too few live steps.*python -m engine profile"):
        calibrate(t, live[:CALIBRATE_MIN])  # plain steps only: nothing says what drafting costs


def test_sweep_table_counts_each_prompt_once_at_its_median_wall_time():
    import pandas as pd

    from engine.service import sweep_table

    rows = [("ar", "a", 100, [1000, 1010, 5000]), ("ar", "b", 50, [400, 420, 410]),
            ("fixed:2", "a", 100, [900, 905, 910]), ("fixed:2", "b", 50, [450, 455, 9000]),
            ("rakv", "a", 100, [950, 940, 960]), ("rakv", "b", 50, [380, 390, 385])]
    runs = pd.DataFrame([dict(target_tier="bf16", policy=pol, prompt=p, n_tokens=n, wall_ms=w)
                         for pol, p, n, walls in rows for w in walls])
    t = sweep_table(runs)["bf16"]
    # The 5,000 ms and 9,000 ms runs (a stalled machine) do not count: medians 1,010 + 410 ms etc.
    assert t["tokens_per_s"]["ar"] == pytest.approx(150 / 1.420)
    assert t["tokens_per_s"]["fixed:2"] == pytest.approx(150 / 1.360)
    assert t["best_fixed"] == "fixed:2" and t["peer"] == pytest.approx(150 / 1.360)
    assert t["vs_peer"]["rakv"] == pytest.approx((150 / 1.335) / (150 / 1.360))
    assert t["prompts"] == 2
    assert t["peer_policy"] == "fixed:2" and t["vs_ar"]["fixed:2"] == pytest.approx(1.420 / 1.360)
    # Two prompts: the bootstrap draws (a, a), (b, b) or a mix; its ends are the ratio on a alone
    # and on b alone, which bracket the ratio over both.
    lo, hi = t["vs_peer_ci95"]["rakv"]
    assert lo == pytest.approx(905 / 950) and hi == pytest.approx(455 / 385)
    assert lo < t["vs_peer"]["rakv"] < hi
    assert t["vs_peer_prompts_for_3pct"]["rakv"] > 2  # two prompts this far apart are nowhere near ±3%


def test_ratio_interval_narrows_with_prompts_and_pairs_them():
    import numpy as np

    from engine.base.stats import geomean, ratio_ci95, speed_ratio

    rng = np.random.default_rng(1)
    def interval(n: int) -> tuple[float, float]:
        ms_b = rng.uniform(500, 5000, n)  # prompts of very different lengths: a pairing cancels them
        ms_a = ms_b / 1.2 * rng.normal(1.0, 0.05, n)  # A is 1.2× faster, 5% noise per prompt
        tokens = np.full(n, 100.0)
        return ratio_ci95(tokens, ms_a, tokens, ms_b)
    lo8, hi8 = interval(8)
    lo64, hi64 = interval(64)
    assert lo64 < 1.2 < hi64 and hi64 - lo64 < hi8 - lo8 and hi64 - lo64 < 0.04
    assert speed_ratio(np.array([10.0]), np.array([1.0]), np.array([10.0]), np.array([2.0])) == 2.0
    # Two tasks, 1.1× and 1.5×, 20 prompts each: a draw task by task keeps that mix, so the spread
    # between the tasks stays out of the interval, which then holds only the noise within each.
    task = np.arange(40) % 2
    ms_b, tokens = np.full(40, 1000.0), np.full(40, 100.0)
    ms_a = ms_b / np.where(task == 1, 1.5, 1.1) * rng.normal(1.0, 0.02, 40)
    plain, strat = ratio_ci95(tokens, ms_a, tokens, ms_b), ratio_ci95(tokens, ms_a, tokens, ms_b, strata=task)
    assert strat[0] < speed_ratio(tokens, ms_a, tokens, ms_b) < strat[1]
    assert strat[1] - strat[0] < (plain[1] - plain[0]) / 3
    # The prompts an interval would need to be within ±3% (its width ∝ 1/√n).
    from engine.base.stats import prompts_for

    assert prompts_for((1.14, 1.26), 1.2, 8) == 23  # ±5%: 8 × (5 / 3)² = 22.2
    assert prompts_for((1.17, 1.32), 1.2, 8) == 89  # its wider side counts: +10% → 8 × (10 / 3)² = 88.9
    assert prompts_for((1.19, 1.21), 1.2, 8) == 8  # already within ±3%: what it has
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)


def test_trace_examples_label_every_gamma_after_every_walked_step():
    """Live, a one-token probe's signals feed a γ = 8 decision: training must hold such rows."""
    import pandas as pd

    ents, confs = [0.1 * i for i in range(1, 9)], [1 - 0.1 * i for i in range(1, 9)]
    traces = pd.DataFrame([dict(trace_id="t", token_ids=list(range(12)), prompt_ids=[0, 1], max_new_tokens=12,
                                target_tier="fp32", task="code", prompt="p")])
    # L(p) = 2 everywhere: the first two drafted ids are the output's next two (replay accepts what agrees).
    positions = pd.DataFrame([dict(trace_id="t", position=p, accept_len=2, draft_ids=[p, p + 1] + [99] * 6,
                                   entropies=ents, confidences=confs) for p in range(1, 12)])
    ex = from_traces(traces, positions)
    one = np.isclose(ex.x[:, 0], 0.1) & np.isclose(ex.x[:, 2], 0.1)  # rows after a 1-token step
    after_one = ex.x[one]
    labels = dict(zip(after_one[:, 5].astype(int).tolist(), ex.y[one].tolist()))
    assert set(after_one[:, 5]) == {1, 2, 4, 6, 8}
    assert labels == {1: 1.0, 2: 1.0, 4: 0.5, 6: pytest.approx(1 / 3), 8: 0.25}  # min(L = 2, γ) / γ
    assert after_one[0].tolist()[:5] == pytest.approx([0.1, 0.9, 0.1, 0.9, 0])


def test_prompt_split_keeps_a_prompt_on_one_side_at_every_tier():
    """Groups are prompt texts: a prompt traced at fp32 and bf16 is trained or tested on at both,
    and the split does not depend on ids or on the order of the examples."""
    from engine.training.retrain import Examples, split

    rows = [(f"p{i}", tier, ("code", "chat")[i % 2]) for i in range(10) for tier in ("fp32", "bf16") for _ in range(3)]
    group, stratum = np.array([r[0] for r in rows]), np.array([f"{r[1]}/{r[2]}" for r in rows])
    ex = Examples(np.zeros((len(rows), 6)), np.zeros(len(rows)), group, stratum)
    train, test = split(ex, "prompt")
    assert not set(group[train]) & set(group[test])
    assert len(set(group[test])) == 2 and set(stratum[test]) == set(stratum)  # 1 of 5 per task, every tier × task
    perm = np.random.default_rng(0).permutation(len(rows))
    _, test2 = split(Examples(ex.x[perm], ex.y[perm], group[perm], stratum[perm]), "prompt")
    assert set(group[perm][test2]) == set(group[test])


def test_stored_arrays_predict_as_sklearn_does():
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.neural_network import MLPRegressor

    rng = np.random.default_rng(1)
    x = rng.uniform(0, 4, (300, 6))
    y = np.clip(0.2 * x[:, 0] - 0.1 * x[:, 5] + 0.3, 0, 1)
    ref_mlp = MLPRegressor(hidden_layer_sizes=(16,), max_iter=500, random_state=42).fit(x, y)
    ref_rf = RandomForestRegressor(n_estimators=100, random_state=42, n_jobs=1).fit(x, y)
    probe = rng.uniform(0, 4, (50, 6))
    assert np.allclose(fit_mlp(x, y).predict(probe), np.clip(ref_mlp.predict(probe), 0, 1))
    assert np.allclose(fit_forest(x, y).predict(probe), np.clip(ref_rf.predict(probe), 0, 1))


def _cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.slow
def test_cli_measure_trace_retrain_replay_profile(tiny_dirs, tmp_path):
    target, draft = tiny_dirs
    db = str(tmp_path / "lab.duckdb")
    model = ["--target", str(target), "--draft", str(draft)]
    steps = [
        ["costs", *model, "--buckets", "8,32", "--reps", "2", "--db", db],
        ["trace", *model, "--prompts", "bench", "--per-task", "2", "--max-new-tokens", "24", "--db", db],
        ["trace", *model, "--prompts", "bench", "--per-task", "2", "--max-new-tokens", "24", "--db", db],  # resumes: nothing to do
        # Activated whatever it scored: on tiny random models its gain over fixed γ is a coin toss of
        # the measured costs, and the rule that holds a worse version back has its own tests.
        ["retrain", "--source", "traces", "--activate", "--db", db, "--json"],
        ["whatif", "--db", db, "--policies", "ar,fixed:2,speckv,rakv", "--json"],
        ["profile", *model, "--prompts", "bench", "--per-task", "1", "--policies", "ar,fixed:2,speckv,rakv",
         "--max-new-tokens", "16", "--sweep", "s1", "--db", db, "--json"],
    ]
    outs = []
    for args in steps:
        proc = _cli(*args)
        assert proc.returncode == 0, (args[0], proc.stderr[-2000:])
        outs.append(proc)
    assert "0 traces stored" in outs[2].stderr
    report = json.loads(outs[3].stdout)
    assert report["whatif_kind"] == "exact replay" and report["version"] == 1 and -1 <= report["test_corr"] <= 1
    assert report["n_test"] > 0 and report["decision_ms_median"] > 0
    whatif = {(r["policy"], r["task"]): r for r in json.loads(outs[4].stdout)}
    assert whatif[("ar", "all")]["prompts"] == 8 and whatif[("speckv", "all")]["tokens_per_s"] > 0
    table = json.loads(outs[5].stdout)["fp32"]
    assert set(table["tokens_per_s"]) == {"ar", "fixed:2", "speckv", "rakv"} and table["prompts"] == 4
    assert set(table["vs_peer"]) == {"speckv", "rakv"}
    per_prompt = _cli("whatif", "--db", db, "--policies", "fixed:2", "--by", "prompt", "--json")
    assert per_prompt.returncode == 0, per_prompt.stderr[-2000:]
    rows = json.loads(per_prompt.stdout)
    assert len([r for r in rows if r["prompt"] != "all"]) == 8 and all(r["prompts"] == 1 for r in rows if r["prompt"] != "all")
    from store import Store

    with Store(db, read_only=True) as st:
        runs = st.runs(sweep="s1")
        assert len(runs) == 16 and set(runs["source"]) == {"speclab"}
        assert len(st.steps()) == sum(runs["n_steps"]) + 16  # every step (and each prefill) stored
    assert _cli(*steps[5]).returncode == 0  # a finished sweep reruns nothing
    with Store(db, read_only=True) as st:
        assert len(st.runs(sweep="s1")) == 16
    calibrated = _cli("costs", *model, "--calibrate", "--db", db, "--json")
    assert calibrated.returncode == 0, calibrated.stderr[-2000:]
    factor = json.loads(calibrated.stdout)[0]["step_factor"]
    assert len(factor) == 9 and all(f > 0 for f in factor)
    with Store(db, read_only=True) as st:  # the newest table, the one policies and replay use now
        assert st.costs()["step_factor"].iloc[0].tolist() == pytest.approx(factor)
    retrain_runs = _cli("retrain", "--source", "runs", "--db", db, "--json")
    assert retrain_runs.returncode == 0, retrain_runs.stderr[-2000:]
    assert json.loads(retrain_runs.stdout)["version"] == 2


def test_sampling_traces_store_the_acceptance_probability(tiny_pair, tiny_dirs):
    from engine.runtime.models import load_pair

    t = trace(tiny_pair, "Hello there, how", "chat", 16, temperature=1.0)
    probs = [r["accept_prob"] for r in t.positions if r["proposer"] == "draft"]
    assert all(0.0 <= a <= 1.0 + 1e-6 for a in probs) and min(probs) < 0.999  # a noisy draft loses some mass
    itself = load_pair(str(tiny_dirs[0]), str(tiny_dirs[0]), target_tier="fp32", draft_tier="fp32", device="cpu")
    same = trace(itself, "Hello there, how", "chat", 16, temperature=1.0)
    drafts = [r for r in same.positions if r["proposer"] == "draft"]
    assert all(abs(r["accept_prob"] - 1.0) < 1e-4 for r in drafts)  # p == q: always accepted
    assert all(r["accept_len"] == 8 or r["position"] + r["accept_len"] == len(same.row["token_ids"]) for r in drafts)
    # An n-gram proposal is one-hot: accepted with q(x) where it proposes, no figure where it cannot.
    ngram = [r for r in same.positions if r["proposer"] == "ngram"]
    assert all((r["accept_prob"] is None) == (not r["draft_ids"]) for r in ngram)
    assert all(0.0 <= r["accept_prob"] <= 1.0 for r in ngram if r["draft_ids"])


@pytest.mark.slow
def test_retrain_on_the_speckv_file_reproduces_the_paper(tmp_path):
    csv = DATA_DIR / "speckv-phase2" / "phase2_step_results.csv"
    db = str(tmp_path / "sk.duckdb")
    assert _cli("import-speckv", str(csv), "--db", db).returncode == 0
    proc = _cli("retrain", "--db", db, "--source", "speckv", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    # The paper's protocol (row split 80/20 stratified by compression × task, MLP(16) on its six
    # features): test correlation 0.685, MSE 0.090; its forest 0.835.
    assert (r["protocol"], r["n_train"], r["n_test"]) == ("paper", 4089, 1023)
    assert abs(r["test_corr"] - 0.685) <= 0.03 and abs(r["test_mse"] - 0.090) <= 0.01
    assert abs(r["rf_test_corr"] - 0.835) <= 0.03
    assert r["whatif_kind"] == "predictor-scored" and r["whatif_gain_vs_fixed4"] > 0


# -- KV tiers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced_fp8(tiny_pair):
    return [trace(tiny_pair, p, task, MAX_NEW, kv_tier="fp8") for task, p in PROMPTS[:3]]


@pytest.mark.parametrize("spec", ["fixed:3", "heuristic", "threshold:0.5", "speckv", "rakv"])
def test_a_trace_at_a_kv_tier_replays_the_live_run_at_that_tier(tiny_pair, traced, traced_fp8, spec):
    _, ctx = traced
    for t in traced_fp8:
        assert t.row["kv_tier"] == "fp8"
        ids = encode_prompt(tiny_pair.tokenizer, t.row["prompt"], chat=True)
        live = Generation(tiny_pair, ids, make_policy(spec, ctx), GenConfig(max_new_tokens=MAX_NEW, kv_tier="fp8")).run()
        rep = replay(make_policy(spec, ctx), t.row, t.positions, ctx.costs)
        assert live.token_ids == t.row["token_ids"]
        assert rep.kv_tier == "fp8" and {r.kv_tier for r in rep.steps} == {r.kv_tier for r in live.records} == {"fp8"}
        assert rep.outcome() == [(r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in live.records[1:]]
        assert [r.entropies for r in rep.steps] == [r.entropies for r in live.records]


def test_traces_at_two_kv_tiers_differ_and_group_apart(traced, traced_fp8):
    traces, ctx = traced
    # The KV tier changes what the target emits (and so what the draft is scored against).
    assert any(a.row["token_ids"] != b.row["token_ids"] for a, b in zip(traces, traced_fp8))
    reps = [replay(make_policy("fixed:2", ctx), t.row, t.positions, ctx.costs) for t in traces[:3] + traced_fp8]
    rows = {(r["tier"], r["kv_tier"], r["task"]): r for r in summarize(reps)}
    assert rows[("fp32", "native", "all")]["prompts"] == rows[("fp32/fp8", "fp8", "all")]["prompts"] == 3
    old = dict(traces[0].row)
    del old["kv_tier"]  # a trace stored before KV tiers: made at native
    assert replay(make_policy("ar", ctx), old, traces[0].positions).kv_tier == "native"


def test_sweep_jobs_and_their_resume_key_carry_the_kv_tier():
    from engine.service.sweeps.serial import Job, pending, sweep_jobs

    jobs = sweep_jobs([("chat", "a"), ("code", "b")], ["fp32", "bf16"], ["ar", "fixed:2"], ["native", "fp8"])
    assert len(jobs) == 16 and jobs[0] == Job("fp32", "chat", "a", "ar", "native")
    assert [j.kv_tier for j in jobs[:8]] == ["native"] * 4 + ["fp8"] * 4 and {j.tier for j in jobs[:8]} == {"fp32"}
    done = {("fp32", "native", "a", "ar"), ("fp32", "fp8", "b", "fixed:2")}
    left = pending(jobs, done)
    assert len(left) == 14 and Job("fp32", "chat", "a", "ar", "fp8") in left  # same prompt, other KV tier: still to run
    assert sweep_jobs([("chat", "a")], ["fp32"], ["ar"]) == [Job("fp32", "chat", "a", "ar")]  # native by default


def test_sweep_table_keeps_kv_tiers_apart():
    import pandas as pd

    from engine.service import sweep_table

    runs = pd.DataFrame([dict(target_tier="fp32", kv_tier=kv, policy=pol, prompt="a", n_tokens=100, wall_ms=ms)
                         for kv, pol, ms in [("native", "ar", 1000), ("native", "fixed:2", 800),
                                             ("fp8", "ar", 1100), ("fp8", "fixed:2", 1200), (None, "fixed:4", 700)]])
    t = sweep_table(runs)
    assert set(t) == {"fp32", "fp32/fp8"}  # a run stored without a KV tier was native
    assert t["fp32"]["best_fixed"] == "fixed:4" and t["fp32/fp8"]["best_fixed"] == "fixed:2"
    assert t["fp32/fp8"]["peer"] == pytest.approx(100 / 1.1)


def test_controllers_read_the_kv_tier_and_old_ones_keep_predicting(traced, traced_fp8):
    """New predictors fitted on our traces read the KV tier's code as a seventh input; one stored
    with the paper's six (meta lists its features) loads and predicts as before at any KV tier."""
    import pandas as pd

    from engine.base.names import KV_TIER_CODES as KV_CODES
    from engine.decode.acceptance import FEATURES, FEATURES_KV, Predictor, feature_rows
    from engine.decode.policies.learned import SpeckvPolicy
    from engine.decode.records import DecodeState
    from engine.runtime.kv.tiers import KV_TIERS
    from engine.service import controller_loader
    from store import Store

    assert tuple(KV_CODES) == KV_TIERS and list(KV_CODES.values()) == [0, 1, 2]
    traces, ctx = traced
    both = traces[:3] + traced_fp8
    rows = pd.DataFrame([dict(t.row, trace_id=f"t{i}") for i, t in enumerate(both)])
    pos = pd.DataFrame([dict(r, trace_id=f"t{i}") for i, t in enumerate(both) for r in t.positions])
    ex = from_traces(rows, pos)
    assert ex.features == FEATURES_KV and ex.x.shape[1] == 7 and set(ex.x[:, 6]) == {0.0, 1.0}
    assert {s.split("/")[0] for s in ex.stratum} == {"fp32", "fp32+fp8"}
    new = fit_mlp(ex.x, ex.y)
    assert new.features == FEATURES_KV and new.meta["features"] == list(FEATURES_KV)
    x = feature_rows(np.array([1.0, 0.5, 2.0, 0.3]), "fp32", (2, 4), "int8", new.features)
    assert x.tolist() == [[1.0, 0.5, 2.0, 0.3, 0, 2, 2], [1.0, 0.5, 2.0, 0.3, 0, 4, 2]]
    flipped = ex.x.copy()
    flipped[:, 6] = 1 - flipped[:, 6]  # each row at the other KV tier
    assert not np.allclose(new.predict(ex.x), new.predict(flipped))  # the tier is an input it uses

    from tiny import synthetic_context

    old = synthetic_context().controller("speckv", None)  # a six-feature MLP, as stored before KV tiers
    assert old.features == FEATURES and old.arrays["w0"].shape[0] == 6
    with Store(":memory:") as st:
        st.add_controller("speckv", old.arrays, dict(features=list(FEATURES), signal_defaults=old.meta["signal_defaults"],
                                                     kind="mlp"), "traces")
        st.add_controller("speckv-rf", fit_forest(np.c_[ex.x[:, :6]], ex.y).arrays,
                          dict(signal_defaults=[1, 0.5, 1, 0.5], kind="rf"), "traces")  # no features listed: the six
        load = controller_loader(st)
        loaded, rf = load("speckv", None), load("speckv-rf", None)
    assert isinstance(loaded, Predictor) and loaded.features == FEATURES == rf.features
    for kv in KV_TIERS:  # it ignores the KV tier it cannot read
        state = DecodeState(step=1, position=1, context_len=64, remaining=100, target_tier="fp32", kv_tier=kv)
        assert SpeckvPolicy(loaded, ctx.costs).choose(state).k == SpeckvPolicy(old, ctx.costs).choose(state).k
        assert 0 <= rf.predict(feature_rows(rf.defaults, "fp32", (4,), kv, rf.features))[0] <= 1
    with pytest.raises(ValueError, match="feature.*attention_sinks"):
        feature_rows(rf.defaults, "fp32", (4,), "native", FEATURES + ("attention_sinks",))


@pytest.mark.slow
def test_cli_kv_tier_axis_measure_trace_replay_profile(tiny_dirs, tmp_path):
    """The KV tier through the commands: cost tables and traces per KV tier (a rerun resumes per
    tier), replay rows per KV tier, a profile sweep over it that resumes, calibration per KV tier."""
    target, draft = tiny_dirs
    db = str(tmp_path / "kv.duckdb")
    model = ["--target", str(target), "--draft", str(draft)]
    kv = ["--kv-tiers", "native,fp8"]
    trace_args = ["trace", *model, *kv, "--prompts", "bench", "--per-task", "1", "--max-new-tokens", "20", "--db", db]
    profile_args = ["profile", *model, *kv, "--prompts", "bench", "--per-task", "1", "--policies", "ar,fixed:2,rakv",
                    "--max-new-tokens", "12", "--sweep", "kv", "--db", db, "--json"]
    for args in (["costs", *model, *kv, "--buckets", "8,32", "--reps", "2", "--db", db], trace_args, trace_args,
                 profile_args):
        proc = _cli(*args)
        assert proc.returncode == 0, (args[0], proc.stderr[-2000:])
    table = json.loads(proc.stdout)
    assert set(table) == {"fp32", "fp32/fp8"} and all(t["prompts"] == 4 for t in table.values())
    from store import Store

    with Store(db, read_only=True) as st:
        assert sorted(st.costs()["kv_tier"].unique()) == ["fp8", "native"]
        traces = st.traces()
        assert len(traces) == 8 and traces.groupby("kv_tier").size().to_dict() == {"fp8": 4, "native": 4}
        runs = st.runs(sweep="kv")
        assert len(runs) == 24 and runs.groupby("kv_tier").size().to_dict() == {"fp8": 12, "native": 12}
        assert (st.steps().merge(runs[["run_id", "kv_tier"]], on="run_id").eval("kv_tier_x == kv_tier_y")).all()
    again = _cli(*trace_args)
    assert again.returncode == 0 and "0 traces stored" in again.stderr  # both KV tiers resume
    assert _cli(*profile_args).returncode == 0
    with Store(db, read_only=True) as st:
        assert len(st.runs(sweep="kv")) == 24  # a finished sweep reruns nothing
    whatif = _cli("whatif", "--db", db, "--policies", "ar,fixed:2", "--kv-tiers", "fp8", "--json")
    assert whatif.returncode == 0, whatif.stderr[-2000:]
    rows = json.loads(whatif.stdout)
    assert {r["kv_tier"] for r in rows} == {"fp8"} and {r["tier"] for r in rows} == {"fp32/fp8"}
    assert all(r["tokens_per_s"] > 0 for r in rows)  # priced by the fp8 cost table
    text = _cli("whatif", "--db", db, "--policies", "fixed:2")
    assert text.returncode == 0 and "fp32  fp8" in text.stdout and "fp32  native" in text.stdout
    cal = _cli("costs", *model, "--kv-tiers", "fp8", "--calibrate", "--db", db, "--json")
    assert cal.returncode == 0, cal.stderr[-2000:]
    assert json.loads(cal.stdout)[0]["kv_tier"] == "fp8" and len(json.loads(cal.stdout)[0]["step_factor"]) == 9
