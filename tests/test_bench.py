"""The benchmarks stay runnable: their measuring code on a tiny pair (figures are not asserted,
only that each ratio is a ratio of the peers measured in the same run)."""
import pytest

from bench import decode as bench_decode
from bench import draft as bench_draft


def test_decode_bench_compares_against_hf_in_one_run(tiny_pair):
    res = bench_decode.measure(tiny_pair, ["Hello", "2+2="], max_new=6, reps=1)
    assert res["ar_vs_hf_generate"] == pytest.approx(res["ar_tok_s"] / res["hf_generate_tok_s"])
    assert res["fixed4_vs_hf_assisted"] == pytest.approx(res["fixed4_tok_s"] / res["hf_assisted_tok_s"])
    assert res["ar_identical_to_hf"] and res["fixed4_identical_to_hf"]
    assert res["tokens"]["ar"] == res["tokens"]["hf_generate"]


def test_draft_bench_reports_what_the_issue_asks(tiny_pair):
    res = bench_draft.measure(tiny_pair, per_task=1, max_new=6, ks=[1, 2])
    assert 0 <= res["agreement"] <= 1 and res["agreement_positions"] > 0
    assert res["draft_cost_ratio"] == pytest.approx(res["draft_ms"] / res["target_ms"])
    assert res["best_fixed_k"] in (1, 2)
    # τ counts the target's own token too; at the end of a response a step may emit fewer.
    assert res["mean_accepted_at_4"] <= res["tokens_per_step_at_4"] <= res["mean_accepted_at_4"] + 1
    assert res["best_fixed_vs_ar"] == pytest.approx(max(res["fixed_vs_ar"].values()))


def test_controllers_bench_decision_against_sklearn_in_one_run():
    from bench import controllers

    res = controllers.decision(controllers.SPECKV_CSV, n=300)
    assert res["speedup_vs_sklearn"] == pytest.approx(res["sklearn_decision_ms_median"] / res["decision_ms_median"])
    assert res["vs_paper"] == pytest.approx(res["decision_ms_median"] / controllers.PAPER_DECISION_MS)


def test_catchup_bench_times_every_way_on_the_same_reads(tiny_pair):
    from bench import catchup

    res = catchup.measure(tiny_pair, reps=1)
    assert set(res["ms"]) == {"rowinv", "rows", "hf"}
    for n in catchup.SIZES:
        assert all(res["ms"][way][n] > 0 for way in res["ms"])
        assert res["rows_vs_rowinv"][n] == pytest.approx(res["ms"]["rows"][n] / res["ms"]["rowinv"][n])
    from engine import invariance

    assert tiny_pair.draft.config._attn_implementation == invariance.ROW_INVARIANT  # the pair's own draft untouched


def test_controllers_bench_live_reports_every_policy_per_tier(tiny_dirs, tmp_path):
    import argparse

    from bench import controllers

    target, draft = tiny_dirs
    a = argparse.Namespace(target=str(target), draft=str(draft), draft_tier=None, device="cpu", tiers="fp32",
                           ks="1,2", per_task=1, train_per_task=1, max_new_tokens=12, db=str(tmp_path / "c.duckdb"),
                           repeats=2)
    res = controllers.live(a)
    t = res["tiers"]["fp32"]
    from store import Store

    with Store(str(tmp_path / "c.duckdb"), read_only=True) as st:
        runs = st.runs(sweep=res["sweep"])
    assert len(runs) == 4 * 5 * 2  # every (prompt, policy) twice
    assert set(t["tokens_per_s"]) == {"ar", "fixed:1", "fixed:2", "speckv", "rakv"} and t["prompts"] == 4
    assert t["peer"] == pytest.approx(max(t["tokens_per_s"]["ar"], t["tokens_per_s"][t["best_fixed"]]))
    assert t["vs_peer"]["rakv"] == pytest.approx(t["tokens_per_s"]["rakv"] / t["peer"])
    assert res["controller"]["whatif_kind"] == "exact replay"
    assert len(res["step_factor"]["fp32"]) == 9  # costs calibrated on the training prompts' live steps
