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
    assert res["best_fixed_vs_ar"] == pytest.approx(max(res["fixed_vs_ar"].values()))
