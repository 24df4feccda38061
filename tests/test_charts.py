"""The pages' figures (views/charts.py): what each draws from its rows, and every spec valid
Vega-Lite (the schema Altair ships), checked here rather than in a browser."""
from __future__ import annotations

import json
import math
from importlib import resources

import jsonschema
import pandas as pd
import pytest

from views import charts as K


def _step(i: int, proposer: str = "draft", drafted: int = 3) -> dict:
    return dict(step=i, emitted=2, draft_ms=10.0, verify_ms=30.0, decide_ms=0.5, k_drafted=drafted, accepted=1,
                k_chosen=drafted, proposer=proposer if drafted else "",
                mean_entropy=0.5 if drafted else None, max_entropy=1.5 if drafted else None,
                mean_confidence=0.8 if drafted else None, min_confidence=0.4 if drafted else None)


STEPS = [dict(_step(0, drafted=0), emitted=1, verify_ms=100.0)] + [_step(1), _step(2, "suffix"), _step(3, drafted=0)]


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((resources.files("altair") / "vegalite/v6/schema/vega-lite-schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def _valid(validator, chart: K.Chart) -> None:
    """The spec with its table inline, as the browser gets it, against the Vega-Lite schema."""
    rows = json.loads(chart.data.to_json(orient="records"))
    errors = [e.message[:200] for e in validator.iter_errors({"data": {"values": rows}, **chart.spec})]
    assert not errors, errors


def test_the_step_frame_leaves_the_prefill_out_but_counts_its_time():
    df = K.step_frame(STEPS)
    assert sorted(set(df["step"])) == [1, 2, 3]  # the prefill drafts nothing: its latency is the TTFT
    assert len(df) == 3 * len(K.STEP_SERIES)
    tps = df[df["series"] == "tok/s so far"].set_index("step")["value"]
    assert tps[1] == pytest.approx(3 / 0.151)  # 1 + 2 tokens over the prefill's 110.5 ms and the step's 40.5
    plain = df[(df["step"] == 3) & (df["panel"] == "entropy")]["value"]
    assert plain.isna().all()  # a plain step has no draft signals: the line breaks there


def test_the_step_chart_draws_six_panels_and_names_the_proposers_that_drafted(validator):
    chart = K.step_chart(STEPS)
    _valid(validator, chart)
    views = [v for row in chart.spec["vconcat"] for v in row["hconcat"]]
    assert [v["title"] for v in views] == ["Draft entropy (bits)", "Draft confidence", "Accepted vs drafted",
                                          "Chosen γ", "Step latency split (ms)", "Running tokens/s"]
    panels = {p for p, _, _ in K.STEP_SERIES}
    assert all(v["transform"][0]["filter"].split("'")[1] in panels for v in views)  # each panel reads its rows
    shape = views[3]["layer"][1]["encoding"]["shape"]["scale"]
    assert shape == {"domain": ["draft", "suffix"], "range": ["circle", "triangle-up"]}
    assert views[0]["layer"][0]["mark"]["invalid"] == "break-paths-filter-domains"
    _valid(validator, K.step_chart([]))  # drawn empty while a run starts


def test_compare_and_runs_charts_are_valid_and_keep_the_rows_order(validator):
    gamma = K.gamma_chart({"ar": ([1, 2], [0, 0]), "fixed:2": ([1, 2], [2, 2])}, {"fixed:2": ["draft", "ngram"]})
    _valid(validator, gamma)
    assert gamma.spec["encoding"]["color"]["sort"] == ["ar", "fixed:2"]
    assert gamma.spec["layer"][1]["encoding"]["shape"]["scale"]["domain"] == ["draft", "ngram"]
    speeds = pd.DataFrame({"policy": ["rakv", "ar", "rakv"], "tier": ["fp32", "fp32", "bf16"],
                           "tokens_per_s": [40.0, 30.0, 25.0], "runs": [2, 1, 1]})
    bars = K.grouped_bars(speeds, "policy", "tier", "tokens_per_s", "tok/s", more=("runs",))
    _valid(validator, bars)
    assert bars.spec["encoding"]["x"]["sort"] == ["rakv", "ar"] and list(bars.data.columns) == list(speeds.columns)
    points = pd.DataFrame({"mean_entropy": [0.1, 2.0], "mean_confidence": [0.9, 0.3], "acceptance": [1.0, 0.0]})
    bins = {s: pd.DataFrame({s: [0.5], "acceptance": [0.5], "steps": [2]}) for s in K.SIGNALS}
    acc = K.acceptance_chart(points, bins)
    _valid(validator, acc)
    assert len(acc.data) == 2 * len(points) + 2
    best = pd.DataFrame({"tier": ["fp32", "bf16"], "task": ["chat", "chat"], "best_gamma": [4.0, math.nan],
                         "tokens_per_s": [51.5, math.nan], "gammas": [3, 1]})
    heat = K.best_gamma_chart(best)
    _valid(validator, heat)
    assert list(heat.data["label"]) == ["γ 4 · 51.5 tok/s"]  # a tier with nothing measured has no cell


def test_a_tree_step_is_drawn_with_its_accepted_path_and_the_targets_token():
    from views.charts import accepted_rows, tree_dot

    parents, drafted = [0, 0, 1, 1, 2], [5, 6, 7, 8, 7]  # root ─ 5 ─ {7, 8};  root ─ 6 ─ 7
    assert accepted_rows(parents, drafted, [6, 7]) == [2, 5]
    assert accepted_rows(parents, drafted, [5, 9]) == [1] and accepted_rows(parents, drafted, []) == []
    dot = tree_dot("x", ["a", "b", 'say "hi"', "\\n", " "], parents, [2, 5], "z")
    assert dot.startswith("digraph tree {") and dot.endswith("}")
    assert 'n5 [label="say \\"hi\\"", fillcolor="white"]' not in dot  # on the path: filled
    assert 'fillcolor="#9be39b"' in dot and "n2 -> n5 [penwidth=2.5" in dot and "n0 -> n1;" in dot
    assert 'n5 -> b [style=dashed, label="target"]' in dot
