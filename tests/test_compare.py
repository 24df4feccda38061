"""engine/lab/side_by_side.py (policies side by side) and views/runs_data.py (the Runs page's shaping)."""
from __future__ import annotations

import datetime as dt
import io
import threading

import pandas as pd
import pyarrow.parquet as pq
import pytest

from engine.lab import side_by_side as C
from engine.service.generation import Request, run_policies
from views import runs_data as V


# -- compare: inputs and differences ---------------------------------------------------------------
def test_first_difference():
    assert C.first_difference([[1, 2, 3], [1, 2, 3]]) == dict(identical=True, position=None, tokens=[], lengths=[3, 3])
    d = C.first_difference([[1, 2, 3], [1, 5, 3], [1, 2, 3]])
    assert d["identical"] is False and d["position"] == 1 and d["tokens"] == [2, 5, 2]
    d = C.first_difference([[1, 2], [1, 2, 3]])  # one ends while the other goes on
    assert d["position"] == 2 and d["tokens"] == [None, 3] and d["lengths"] == [2, 3]
    assert C.first_difference([[4]])["identical"] and C.first_difference([[], []])["identical"]


def test_differences_from_first():
    out = C.differences_from_first([[1, 2, 3, 4], [1, 2, 3, 4], [1, 9, 3, 8, 7]])
    assert out[0] == dict(first_difference=None, differing=0, length=4) == out[1]
    assert out[2] == dict(first_difference=1, differing=3, length=5)


def test_inputs_are_checked_in_one_line():
    assert C.check_policies(["ar", " fixed:2 "]) == ["ar", "fixed:2"]
    for bad, words in ((["ar"], "2 to 4"), (["ar", "fixed:1", "fixed:2", "fixed:3", "fixed:4"], "2 to 4"),
                       (["ar", "ar"], "once"), (["ar", "fixed:99"], "99")):
        with pytest.raises(ValueError, match=words) as e:
            C.check_policies(bad)
        assert "\n" not in str(e.value)
    assert C.parse_prompts("a\n\n  b  \n") == ["a", "b"]
    with pytest.raises(ValueError, match="at least one prompt"):
        C.parse_prompts(" \n ")
    assert C.compare_label(dt.datetime(2024, 5, 6, 7, 8, 9)).startswith("compare-20240506-070809-")


def test_shared_seed():
    assert C.shared_seed(Request("", temperature=0.0)).seed is None  # greedy needs none
    assert C.shared_seed(Request("", temperature=0.7)).seed is not None
    assert C.shared_seed(Request("", temperature=0.7, seed=5)).seed == 5


def _result(policy, i, tokens, steps, wall=100.0, ttft=10.0, temperature=0.0):
    row = dict(n_tokens=len(tokens), wall_ms=wall, ttft_ms=ttft, token_ids=tokens, output="x", temperature=temperature)
    return C.Result(policy, f"p{i}", i, row, steps)


def _step(step, k, drafted, accepted, emitted):
    return dict(step=step, k_chosen=k, k_drafted=drafted, accepted=accepted, emitted=emitted)


def test_summary_and_gamma_series():
    a = _result("fixed:2", 0, [1, 2, 3, 4, 5], [_step(0, 0, 0, 0, 1), _step(1, 2, 2, 2, 3), _step(2, 2, 2, 0, 1)])
    b = _result("ar", 0, [1, 2, 3], [_step(0, 0, 0, 0, 1), _step(1, 0, 0, 0, 1), _step(2, 0, 0, 0, 1)], wall=50.0)
    c = _result("fixed:2", 1, [1, 2], [_step(0, 0, 0, 0, 1), _step(1, 2, 1, 0, 1)], wall=100.0, ttft=30.0)
    rows = {r["policy"]: r for r in C.summary_rows([a, b, c])}
    assert list(rows) == ["fixed:2", "ar"]
    f = rows["fixed:2"]
    assert f["prompts"] == 2 and f["tokens"] == 7 and f["tokens_per_s"] == pytest.approx(7 / 0.2)
    assert f["ttft_ms"] == 20.0 and f["acceptance_rate"] == pytest.approx(2 / 5)
    assert f["mean_accepted"] == pytest.approx(2 / 3) and f["tokens_per_step"] == pytest.approx(5 / 3)
    assert rows["ar"]["acceptance_rate"] is None and rows["ar"]["tokens_per_step"] == 1.0
    # Steps stored before proposers had names were the draft model's.
    assert f["proposers"] == "draft 100%" and rows["ar"]["proposers"] == "—"
    assert C.gamma_series([a, b, c], 0) == {"fixed:2": ([1, 2], [2, 2]), "ar": ([1, 2], [0, 0])}
    assert C.proposer_series([a, b, c], 0) == {"fixed:2": ["draft", "draft"], "ar": ["", ""]}
    diffs = C.output_differences([a, b, c], decode=lambda ids: f"<{ids[0]}>")
    assert diffs[0]["position"] == 3 and diffs[0]["token_text"] == ["<4>", None]
    assert diffs[1]["identical"] and C.greedy([a, b]) and not C.greedy([_result("ar", 0, [1], [], temperature=1.0)])


def test_proposer_mix_is_the_share_of_drafting_steps_per_proposer():
    steps = [dict(_step(1, 2, 2, 1, 2), proposer="ngram"), dict(_step(2, 0, 0, 0, 1), proposer=""),
             dict(_step(3, 4, 4, 4, 5), proposer="draft"), dict(_step(4, 3, 3, 0, 1), proposer="ngram"),
             dict(_step(5, 1, 0, 0, 1), proposer="")]  # chose 1, drafted none (the budget): plain
    assert C.proposer_mix(steps) == {"ngram": pytest.approx(2 / 3), "draft": pytest.approx(1 / 3)}
    assert C.mix_label(C.proposer_mix(steps)) == "ngram 67% · draft 33%" and C.mix_label({}) == "—"
    a = _result("rakv", 0, [1, 2, 3], [_step(0, 0, 0, 0, 1)] + steps)
    assert C.summary_rows([a])[0]["proposers"] == "ngram 67% · draft 33%"
    assert C.proposer_series([a]) == {"rakv": ["ngram", "", "draft", "ngram", ""]}


def test_policy_options_offer_the_proposer_forms():
    base = ["ar", "fixed:4", "rakv"]
    assert C.policy_options(base) == base + ["fixed:4@ngram", "fixed:4@suffix",
                                             "rakv@draft", "rakv@ngram", "rakv@suffix"]
    with_eagle = C.policy_options(base, ("draft", "eagle", "ngram"))
    assert {"fixed:4@eagle", "fixed:4@ngram", "rakv@eagle"} <= set(with_eagle) and with_eagle[:3] == base
    assert C.policy_options(base, ("draft",)) == base  # one proposer: nothing to choose among
    from engine.decode.policies import parse_policy

    for spec in with_eagle:
        parse_policy(spec)  # every form parses


def test_whatif_table_and_best():
    rows = [dict(tier="fp32", task=t, policy=p, tokens_per_s=v, tokens_per_step=1.0)
            for t, p, v in [("all", "ar", 10.0), ("all", "fixed:4", 20.0), ("code", "ar", 12.0), ("code", "fixed:4", 9.0)]]
    table = C.whatif_table(rows)
    assert list(table.columns) == ["ar", "fixed:4"] and list(table.index) == [("fp32", "code"), ("fp32", "all")]
    assert table.loc[("fp32", "all"), "fixed:4"] == 20.0
    assert C.whatif_best(rows) == {("fp32", "all"): "fixed:4", ("fp32", "code"): "ar"}
    assert C.whatif_table([]).empty


# -- compare: live on the tiny pair ----------------------------------------------------------------
def test_greedy_policies_emit_the_same_tokens(tiny_pair):
    seen = []
    results = run_policies(tiny_pair, ["Hello there", "def f(x):"], ["fixed:2", "ar"], Request("", max_new_tokens=12, label="compare-test"),
                          lambda spec: None, on_run=seen.append)
    assert [(r.prompt_index, r.policy) for r in results] == [(0, "fixed:2"), (0, "ar"), (1, "fixed:2"), (1, "ar")]
    assert seen == results
    assert all(r.row["config"]["compare"] == "compare-test" and r.row["policy"] == r.policy for r in results)
    for d in C.output_differences(results):
        assert d["identical"] and d["position"] is None, d
    by = {r["policy"]: r for r in C.summary_rows(results)}
    assert by["ar"]["acceptance_rate"] is None and by["fixed:2"]["acceptance_rate"] is not None
    assert by["ar"]["tokens_per_step"] == 1.0
    series = C.gamma_series(results, 0)
    assert set(series["fixed:2"][1]) <= {1, 2} and set(series["ar"][1]) == {0}


def test_runs_wait_for_the_decode_slot(tiny_pair):
    """Another decode holds the slot: run_policies says who (on_wait) and waits for it."""
    from engine.lab.decode_lock import decode_slot

    held, release, waits = threading.Event(), threading.Event(), []

    def hold():
        with decode_slot("a test decode"):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        def on_wait(busy):
            waits.append(busy)
            release.set()  # the other decode ends; this one then takes the slot

        results = run_policies(tiny_pair, ["Hi"], ["ar", "fixed:1"], Request("", max_new_tokens=4), lambda s: None,
                                 on_wait=on_wait)
    finally:
        release.set()
        t.join()
    assert waits == ["a test decode"] and len(results) == 2


def test_a_bad_policy_fails_before_any_decode(tiny_pair):
    seen = []
    with pytest.raises(ValueError):
        run_policies(tiny_pair, ["Hi"], ["ar", "fixed:99"], Request("", max_new_tokens=4), lambda s: None, on_run=seen.append)
    assert not seen


# -- runs_data ---------------------------------------------------------------------------------------------
def _runs() -> pd.DataFrame:
    day = dt.datetime(2024, 1, 1, 12)
    rows = []
    for i, (pol, tier, kv, task, tokens, wall) in enumerate([
        ("ar", "fp32", "native", "code", 10, 1000.0), ("fixed:2", "fp32", "native", "code", 10, 500.0),
        ("fixed:4", "fp32", "native", "code", 10, 800.0), ("ar", "fp32", "native", "chat", 10, 400.0),
        ("fixed:2", "fp32", "native", "chat", 10, 800.0), ("rakv", "fp32", "native", "chat", 10, 300.0),
        ("fixed:2", "bf16", "fp8", None, 10, 250.0),
    ]):
        rows.append(dict(run_id=f"r{i}", created_at=day + dt.timedelta(days=i), target="t", draft="d",
                         target_tier=tier, kv_tier=kv, policy=pol, task=task, n_tokens=tokens, wall_ms=wall,
                         tokens_per_s=tokens / (wall / 1e3), error=None))
    return pd.DataFrame(rows)


def test_labels_and_filters():
    runs = _runs()
    assert V.gamma_of("ar") == 0 and V.gamma_of("fixed:6") == 6 and V.gamma_of("rakv") is None
    opts = V.options(runs)
    assert opts["pairs"] == ["t ← d"] and opts["tiers"] == ["bf16/fp8", "fp32"] and opts["tasks"] == ["-", "chat", "code"]
    assert opts["dates"] == (dt.date(2024, 1, 1), dt.date(2024, 1, 7))
    assert list(V.filter_runs(runs, V.Filters(tiers=("bf16/fp8",)))["run_id"]) == ["r6"]
    assert list(V.filter_runs(runs, V.Filters(policies=("ar",), tasks=("chat",)))["run_id"]) == ["r3"]
    got = V.filter_runs(runs, V.Filters(since=dt.date(2024, 1, 2), until=dt.date(2024, 1, 3)))
    assert list(got["run_id"]) == ["r1", "r2"]
    assert len(V.filter_runs(runs, V.Filters())) == len(runs)
    assert V.filter_runs(runs.iloc[0:0], V.Filters(policies=("ar",))).empty
    assert V.options(runs.iloc[0:0])["pairs"] == []


def test_best_gamma_and_speeds():
    runs = _runs()
    best = V.best_gamma(runs).set_index(["tier", "task"])
    assert best.loc[("fp32", "code"), "best_gamma"] == 2 and best.loc[("fp32", "code"), "gammas"] == 3
    assert best.loc[("fp32", "chat"), "best_gamma"] == 0  # ar beat fixed:2; rakv is no fixed γ
    assert best.loc[("bf16/fp8", "-"), "tokens_per_s"] == pytest.approx(40.0)
    gamma, tps = V.best_gamma_grid(V.best_gamma(runs))
    assert list(gamma.index) == ["bf16/fp8", "fp32"] and gamma.loc["fp32", "code"] == 2
    assert pd.isna(gamma.loc["bf16/fp8", "code"])
    speeds = V.speed_by_policy(runs).set_index(["policy", "tier"])
    assert speeds.loc[("fixed:2", "fp32"), "tokens_per_s"] == pytest.approx(20 / 1.3)
    assert speeds.loc[("fixed:2", "fp32"), "runs"] == 2
    assert V.best_gamma(runs.iloc[0:0]).empty and V.speed_by_policy(runs.iloc[0:0]).empty


def test_acceptance_points_and_bins():
    runs = _runs()
    steps = pd.DataFrame([dict(run_id=f"r{i % 7}", step=i, k_drafted=i % 3, accepted=(i % 3) // 2,
                               mean_entropy=(i % 10) / 10, mean_confidence=1 - (i % 10) / 10) for i in range(200)])
    picked = V.steps_of(steps, V.filter_runs(runs, V.Filters(policies=("fixed:2",))))
    assert set(picked["run_id"]) == {"r1", "r4", "r6"} and set(picked["policy"]) == {"fixed:2"}
    pts = V.acceptance_points(picked)
    assert len(pts) == int((picked["k_drafted"] > 0).sum()) and pts["acceptance"].between(0, 1).all()
    capped = V.acceptance_points(V.steps_of(steps, runs), cap=20)
    assert len(capped) == 20 and capped.equals(V.acceptance_points(V.steps_of(steps, runs), cap=20))  # seeded
    bins = V.acceptance_bins(V.acceptance_points(V.steps_of(steps, runs)), "mean_entropy", bins=5)
    assert bins["steps"].sum() == int((steps["k_drafted"] > 0).sum()) and len(bins) == 5
    assert bins["mean_entropy"].is_monotonic_increasing
    with pytest.raises(ValueError):
        V.acceptance_bins(pts, "k_drafted")
    assert V.acceptance_bins(V.acceptance_points(steps.iloc[0:0]), "mean_entropy").empty


def test_downloads_round_trip():
    runs = _runs().assign(token_ids=[[1, 2]] * 7)
    back = pq.read_table(io.BytesIO(V.to_parquet_bytes(runs))).to_pandas()
    assert list(back["run_id"]) == list(runs["run_id"]) and list(back["token_ids"][0]) == [1, 2]
    csv = pd.read_csv(io.BytesIO(V.to_csv_bytes(runs)))
    assert list(csv["policy"]) == list(runs["policy"])


def test_one_seed_reproduces_a_sampling_comparison(tiny_pair):
    cfg = Request("", max_new_tokens=10, temperature=1.0)
    first = run_policies(tiny_pair, ["Hi"], ["ar", "fixed:3"], cfg, lambda s: None)
    seed = first[0].row["seed"]
    assert seed is not None and first[1].row["seed"] == seed  # one seed drawn for every policy
    again = run_policies(tiny_pair, ["Hi"], ["ar", "fixed:3"], Request("", max_new_tokens=10, temperature=1.0, seed=seed),
                           lambda s: None)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
