"""The figures of the pages a tuner opens every minute (Live, Compare, Runs) as Vega-Lite specs,
drawn by Streamlit's own chart element (`st.vega_lite_chart(data, spec)`) on a canvas.

Why not plotly: a browser compiles a page's chart library before its first figure shows, and
Vega's is a sixth of plotly's; with several sessions on one machine that compile came right
before their next click. Why plain dicts and not Altair: Altair validates every channel against
the schema as a chart is built, on the server, under the GIL every session and the decode share
(the figures: docs/benchmarks.md, bench load); tests/test_charts.py validates the specs instead.
Pure functions: records or DataFrames in, (data, spec) out, no Streamlit calls."""
from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd

# Point shapes of the proposers (Vega-Lite's shape names), the same on every page.
PROPOSER_SYMBOLS = {"draft": "circle", "eagle": "diamond", "ngram": "square", "suffix": "triangle-up"}
# Two panels side by side fill the wide layout's main column on a laptop's screen.
PANEL_W, PANEL_H = 400, 150


class Chart(NamedTuple):
    """What `st.vega_lite_chart(data, spec)` draws: one table, and the views over it."""

    data: pd.DataFrame
    spec: dict[str, Any]


_FIELD = object()  # a channel titled by its field's name (None: no title)


def _q(field: str, title: str | None | object = _FIELD, **more) -> dict:
    return {"field": field, "type": "quantitative", **({} if title is _FIELD else {"title": title}), **more}


def _n(field: str, title: str | None | object = _FIELD, **more) -> dict:
    return {"field": field, "type": "nominal", **({} if title is _FIELD else {"title": title}), **more}


def _where(expr: str) -> list[dict]:
    return [{"filter": expr}]


def _top_legend(field: str, **more) -> dict:
    return _n(field, legend={"orient": "top", "title": None}, **more)


def _proposer_shape(proposers: list[str | None], orient: str) -> dict:
    """Each proposer's own shape; the legend lists the proposers in `proposers` only (those that
    drafted here), in the order of PROPOSER_SYMBOLS."""
    others = sorted({p for p in proposers if p and p not in PROPOSER_SYMBOLS})
    seen = [p for p in PROPOSER_SYMBOLS if p in proposers] + others
    return _n("proposer", scale={"domain": seen, "range": [PROPOSER_SYMBOLS.get(p, "cross") for p in seen]},
              legend={"orient": orient})


# -- Live: one run's steps -------------------------------------------------------------------------
# (panel, series label, record field), in the panels' order; a panel's series share its y axis.
STEP_SERIES = [
    ("entropy", "mean H", "mean_entropy"), ("entropy", "max H", "max_entropy"),
    ("confidence", "mean conf", "mean_confidence"), ("confidence", "min conf", "min_confidence"),
    ("accepted", "drafted", "k_drafted"), ("accepted", "accepted", "accepted"),
    ("gamma", "chosen γ", "k_chosen"),
    ("latency", "draft ms", "draft_ms"), ("latency", "verify ms", "verify_ms"), ("latency", "decide ms", "decide_ms"),
    ("speed", "tok/s so far", "running_tps"),
]


def step_frame(steps: list[dict]) -> pd.DataFrame:
    """The steps in long form (step, panel, series, value, proposer), one row per series value.
    The prefill (step 0) drafts nothing and its latency is the TTFT, so it is left out, but its
    tokens and time count in the running tokens/s."""
    rows, tokens, ms = [], 0, 0.0
    for rec in steps:
        tokens += rec["emitted"]
        ms += rec["draft_ms"] + rec["verify_ms"] + rec["decide_ms"]
        if rec["step"] == 0:
            continue
        rec = dict(rec, running_tps=tokens / (ms / 1e3) if ms else None)
        who = rec.get("proposer") or ""
        rows += [(rec["step"], panel, series, rec[field], who) for panel, series, field in STEP_SERIES]
    return pd.DataFrame(rows, columns=["step", "panel", "series", "value", "proposer"])


def _panel(panel: str, title: str, *layers: dict) -> dict:
    return {"title": title, "width": PANEL_W, "height": PANEL_H, "transform": _where(f"datum.panel === '{panel}'"),
            "encoding": {"x": _q("step", "step")}, "layer": list(layers)}


# Lines break where a step has no value (a plain step has no draft signals to draw).
_LINE = {"type": "line", "point": {"size": 16}, "invalid": "break-paths-filter-domains"}
_TIP = [_q("step"), _n("series"), _q("value", format=".3~f")]


def step_chart(steps: list[dict]) -> Chart:
    """Six panels over the steps: the draft's entropy and confidence, accepted against drafted,
    the chosen γ (each drafted point shaped by its proposer), the latency split (stacked) and the
    running tokens/s."""
    def lines(**y) -> dict:
        return {"mark": _LINE,
                "encoding": {"y": _q("value", None, **y), "color": _top_legend("series"), "tooltip": _TIP}}

    entropy = _panel("entropy", "Draft entropy (bits)", lines())
    confidence = _panel("confidence", "Draft confidence", lines(scale={"domain": [0, 1]}))
    # Accepted drawn over drafted, not stacked: a bar's uncovered part is what the target rejected.
    accepted = _panel("accepted", "Accepted vs drafted", {
        "mark": {"type": "bar", "opacity": 0.8},
        "encoding": {"y": _q("value", None, stack=None), "color": _top_legend("series", sort=["drafted", "accepted"]),
                     "order": {"field": "series", "sort": "descending"}, "tooltip": _TIP}})
    shape = _proposer_shape([r.get("proposer") for r in steps], "top")
    gamma = _panel("gamma", "Chosen γ",
                   {"mark": {"type": "line", "interpolate": "step-after"}, "encoding": {"y": _q("value", None)}},
                   {"transform": _where("datum.proposer !== ''"), "mark": {"type": "point", "size": 50, "filled": True},
                    "encoding": {"y": _q("value", None), "shape": shape,
                                 "tooltip": [_q("step"), _q("value", "γ"), _n("proposer")]}})
    latency = _panel("latency", "Step latency split (ms)", {
        "mark": "bar",
        "encoding": {"y": _q("value", None, stack="zero"), "color": _top_legend("series"), "tooltip": _TIP}})
    speed = _panel("speed", "Running tokens/s", {"mark": _LINE, "encoding": {"y": _q("value", None), "tooltip": _TIP}})
    spec = {"vconcat": [{"hconcat": [entropy, confidence]}, {"hconcat": [accepted, gamma]},
                        {"hconcat": [latency, speed]}],
            "resolve": {"scale": {"color": "independent", "shape": "independent"}}}
    return Chart(step_frame(steps), spec)


# -- Compare: policies side by side ----------------------------------------------------------------
def gamma_chart(series: dict[str, tuple[list[int], list[int]]],
                proposers: dict[str, list[str]] | None = None) -> Chart:
    """γ per step, one line per policy; each drafted point shaped by who drafted it (`proposers`)."""
    rows = [(policy, x, y, p) for policy, (xs, ys) in series.items()
            for x, y, p in zip(xs, ys, (proposers or {}).get(policy) or [""] * len(xs))]
    df = pd.DataFrame(rows, columns=["policy", "step", "gamma", "proposer"])
    color = _n("policy", sort=list(series), legend={"orient": "bottom"})
    spec = {"title": "Chosen γ per step", "height": 260,
            "encoding": {"x": _q("step", "step"), "y": _q("gamma", "γ"), "color": color},
            "layer": [{"mark": {"type": "line", "interpolate": "step-after"}},
                      {"transform": _where("datum.proposer !== ''"),
                       "mark": {"type": "point", "size": 50, "filled": True},
                       "encoding": {"shape": _proposer_shape(list(df["proposer"]), "bottom"),
                                    "tooltip": [_n("policy"), _q("step"), _q("gamma", "γ"), _n("proposer")]}}]}
    return Chart(df, spec)


def grouped_bars(df: pd.DataFrame, x: str, group: str, y: str, y_title: str, more: tuple[str, ...] = ()) -> Chart:
    """Bars of `y` per `x`, one bar per `group` side by side (each in its rows' order); the
    tooltip shows the `more` columns too."""
    groups, xs = list(dict.fromkeys(df[group])), list(dict.fromkeys(df[x]))
    spec = {"height": 300, "mark": "bar", "encoding": {
        "x": _n(x, None, sort=xs, axis={"labelAngle": 0}), "xOffset": _n(group, sort=groups), "y": _q(y, y_title),
        "color": _n(group, sort=groups, legend={"orient": "bottom"}),
        "tooltip": [_n(x), _n(group), _q(y, format=".2f"), *(_q(m) for m in more)]}}
    return Chart(df[[x, group, y, *more]], spec)


# -- Runs: what the store holds --------------------------------------------------------------------
SIGNALS = {"mean_entropy": "mean draft entropy (bits)", "mean_confidence": "mean draft confidence"}


def acceptance_chart(points: pd.DataFrame, bins: dict[str, pd.DataFrame]) -> Chart:
    """Acceptance against mean entropy and mean confidence: the sampled steps (`points`) as dots,
    the mean per bin over the same sample (`bins[signal]`, runs_data.acceptance_bins) as a line."""
    parts = [pd.DataFrame({"signal": s, "kind": "step", "x": points[s], "acceptance": points["acceptance"], "steps": 1})
             for s in SIGNALS]
    parts += [pd.DataFrame({"signal": s, "kind": "bin", "x": bins[s][s], "acceptance": bins[s]["acceptance"],
                            "steps": bins[s]["steps"]}) for s in SIGNALS]
    y = _q("acceptance", "accepted / drafted", scale={"domain": [0, 1]})

    def one(signal: str) -> dict:
        return {"width": PANEL_W, "height": 260, "transform": _where(f"datum.signal === '{signal}'"),
                "encoding": {"x": _q("x", SIGNALS[signal]), "y": y},
                "layer": [{"transform": _where("datum.kind === 'step'"),
                           "mark": {"type": "circle", "size": 12, "opacity": 0.25}},
                          {"transform": _where("datum.kind === 'bin'"),
                           "mark": {"type": "line", "point": True, "strokeWidth": 3, "color": "#d62728"},
                           "encoding": {"tooltip": [_q("acceptance", format=".2f"), _q("steps", "over steps")]}}]}

    return Chart(pd.concat(parts, ignore_index=True), {"hconcat": [one(s) for s in SIGNALS]})


def best_gamma_chart(best: pd.DataFrame) -> Chart:
    """The best γ per tier (rows) × task (columns) of runs_data.best_gamma's rows, each cell
    labelled with its γ and tokens/s."""
    cells = best[["tier", "task", "best_gamma", "tokens_per_s"]].dropna(subset=["best_gamma"])
    labels = [f"γ {int(g)} · {t:.1f} tok/s" for g, t in zip(cells["best_gamma"], cells["tokens_per_s"])]
    cells = cells.assign(label=labels)
    spec = {"height": 60 * max(cells["tier"].nunique(), 2),
            "encoding": {"x": _n("task", "task", axis={"labelAngle": 0}), "y": _n("tier", "tier")},
            "layer": [{"mark": "rect", "encoding": {"color": _q("best_gamma", "best γ", scale={"scheme": "viridis"}),
                                                    "tooltip": [_n("tier"), _n("task"), _n("label")]}},
                      {"mark": {"type": "text", "color": "white", "fontWeight": "bold"},
                       "encoding": {"text": _n("label")}}]}
    return Chart(cells, spec)


# -- a token tree's step ------------------------------------------------------------------------------
def accepted_rows(parents: list[int], drafted: list[int], accepted: list[int]) -> list[int]:
    """The tree rows (1…N) the target accepted, root first: down from the root (row 0), the child
    whose token is the next accepted one. parents[i], drafted[i]: node i + 1's parent row and token."""
    row, path = 0, []
    for token in accepted:
        nxt = next((i + 1 for i, (p, t) in enumerate(zip(parents, drafted)) if p == row and t == token), None)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt
    return path


def _dot_text(text: str) -> str:
    shown = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\\\n")
    return shown if shown.strip() else repr(text)[1:-1] or "∅"


def tree_dot(root: str, texts: list[str], parents: list[int], path: list[int], bonus: str | None) -> str:
    """Graphviz DOT of one step's token tree, left to right: the root (the newest token before the
    step), each drafted node under its parent, the accepted path filled, and the target's own token
    after it (dashed). texts[i]: node i + 1's token as text."""
    on = set(path)
    lines = ["digraph tree {", "rankdir=LR;", 'node [shape=box, style="rounded,filled", fillcolor=white, '
             'fontname="monospace", fontsize=11];', f'n0 [label="{_dot_text(root)}", fillcolor="#e8e8e8"];']
    for i, (text, parent) in enumerate(zip(texts, parents), start=1):
        fill = "#9be39b" if i in on else "white"
        lines.append(f'n{i} [label="{_dot_text(text)}", fillcolor="{fill}"];')
        lines.append(f"n{parent} -> n{i}" + (' [penwidth=2.5, color="#2e8b57"]' if i in on else "") + ";")
    if bonus is not None:
        last = path[-1] if path else 0
        lines.append(f'b [label="{_dot_text(bonus)}", style="rounded,dashed"];')
        lines.append(f'n{last} -> b [style=dashed, label="target"];')
    lines.append("}")
    return "\n".join(lines)
