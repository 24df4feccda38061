"""Retraining the SpecKV controller from the store (docs/architecture.md, "Policies and controllers").

Examples come from one of three sources, each row [mean H, mean c, H_max, c_min, compression, γ]
(and, from our own data, the KV tier's code: predictor.FEATURES_KV) → acceptance rate (accepted / γ):
- `speckv`: imported SpecKV step CSVs. The features are the step's own, as the paper used them
  (they describe the very tokens whose acceptance is predicted: leakage, kept for comparison);
  the paper's six, its runs all at the native KV tier.
- `runs`: our live runs. The features are the previous drafting step's, known before drafting.
- `traces`: our acceptance traces, walked as `fixed:γ` for every γ in the grid, features from the
  previous step of that walk: many γ per prompt from one trace.

Splits: `paper` (80/20 over rows, stratified by tier × task, sklearn's seed 42: the paper's
protocol) or `prompt` (80/20 over prompts, stratified the same way: no prompt on both sides); a
KV tier off native counts as a tier of its own (`fp32+fp8`).
The MLP is sklearn's MLPRegressor(16), stored as its weight arrays; the 100-tree forest is kept
as the reference."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from engine.base.helpers import median_ms
from engine.decode.acceptance import (
    FEATURES,
    FEATURES_KV,
    PAPER_CANDIDATES,
    Predictor,
    compression_code,
    kv_code,
    tokens_from_rate,
)
from engine.decode.policies.fixed import FixedPolicy
from engine.decode.records import DecodeState
from engine.decode.tree import stored_tree
from engine.lab.whatif import proposals, replay

TRACE_GAMMAS = (1, 2, 4, 6, 8)


@dataclass
class Examples:
    x: np.ndarray  # [N, F] in `features` order
    y: np.ndarray  # [N] acceptance rate
    group: np.ndarray  # [N] the prompt's text: never on both sides under `prompt`, at any tier
    stratum: np.ndarray  # [N] "tier/task" (tier "fp32+fp8" off the native KV tier)
    features: tuple[str, ...] = FEATURES


def _setting(target_tier: str, kv_tier) -> str:
    """A stratum's tier part: the weight tier, and the KV tier when it is not native."""
    code = kv_code(kv_tier)
    return target_tier if code == 0 else f"{target_tier}+{kv_tier}"


def from_speckv_steps(steps: pd.DataFrame, runs: pd.DataFrame) -> Examples:
    # As the paper: γ is the chosen length, the rate is over the tokens actually drafted (the
    # last step of a run may draft fewer).
    df = steps.merge(runs[["run_id", "task", "prompt"]], on="run_id")
    # Chains only: the controllers learn acceptance per drafted token, which a tree's nodes do not measure.
    df = df[(df["k_drafted"] > 0) & ~df.get("tree_parents", pd.Series(None, index=df.index)).map(stored_tree)]
    x = np.column_stack([df["mean_entropy"], df["mean_confidence"], df["max_entropy"], df["min_confidence"],
                         df["target_tier"].map(compression_code), df["k_chosen"]]).astype(np.float64)
    y = (df["accepted"] / df["k_drafted"]).to_numpy(np.float64)
    return Examples(x, y, df["prompt"].to_numpy(), (df["target_tier"] + "/" + df["task"].fillna("-")).to_numpy())


def from_live_steps(steps: pd.DataFrame, runs: pd.DataFrame) -> Examples:
    rows, ys, groups, strata = [], [], [], []
    tasks = dict(zip(runs["run_id"], runs["task"].fillna("-")))
    prompts = dict(zip(runs["run_id"], runs["prompt"]))
    for run_id, st in steps[steps["run_id"].isin(tasks)].groupby("run_id", sort=False):
        prev = None
        for r in st.sort_values("step").itertuples():
            # The draft model's steps only: the predictor reads its signals (an n-gram's are constant).
            if r.k_drafted > 0 and getattr(r, "proposer", "draft") in ("draft", "") and not stored_tree(
                    getattr(r, "tree_parents", None)):
                if prev is not None:
                    kv = getattr(r, "kv_tier", None)
                    rows.append([*prev, compression_code(r.target_tier), r.k_drafted, kv_code(kv)])
                    ys.append(r.accepted / r.k_drafted)
                    groups.append(prompts[run_id]), strata.append(f"{_setting(r.target_tier, kv)}/{tasks[run_id]}")
                prev = (r.mean_entropy, r.mean_confidence, r.max_entropy, r.min_confidence)
    return _examples(rows, ys, groups, strata, FEATURES_KV)


def from_traces(traces: pd.DataFrame, positions: pd.DataFrame, gammas: tuple[int, ...] = TRACE_GAMMAS) -> Examples:
    """Each trace replayed as fixed:g for every g in `gammas`; after every drafting step of a
    walk, the next drafting step's position is labelled for every γ from the trace's L(p), with
    the step's signals as features. Every γ, not only the walk's own: live, the signals of a
    one-token probe are what a γ = 8 decision reads, and a model that had only seen 8-token
    signals beside γ = 8 takes a lone confident token for a confident run of eight."""
    rows, ys, groups, strata = [], [], [], []
    by_trace = {tid: df.to_dict("records") for tid, df in positions.groupby("trace_id", sort=False)}
    for t in traces.to_dict("records"):
        # The predictor reads the draft model's signals: its proposals, not another proposer's.
        trace_rows = list(proposals(by_trace.get(t["trace_id"], [])).get("draft", {}).values())
        at = {int(r["position"]): int(r["accept_len"]) for r in trace_rows}
        comp, kv = compression_code(t["target_tier"]), kv_code(t.get("kv_tier"))
        stratum = f"{_setting(t['target_tier'], t.get('kv_tier'))}/{t['task'] or '-'}"
        for g in gammas:
            prev = None
            for r in replay(FixedPolicy(g), t, trace_rows).steps[1:]:
                if not r.k_drafted:  # the last position, where only the target's token fits
                    continue
                if prev is not None:
                    left = t["max_new_tokens"] - r.position - 1
                    for c in sorted({min(c, left) for c in gammas}):
                        rows.append([*prev, comp, c, kv]), ys.append(min(at[r.position], c) / c)
                        groups.append(t["prompt"]), strata.append(stratum)
                prev = (r.mean_entropy, r.mean_confidence, r.max_entropy, r.min_confidence)
    return _examples(rows, ys, groups, strata, FEATURES_KV)


def _examples(rows, ys, groups, strata, features: tuple[str, ...]) -> Examples:
    if not rows:
        raise ValueError("no training examples: the selected runs/traces hold no drafting steps")
    return Examples(np.asarray(rows, np.float64), np.asarray(ys, np.float64), np.asarray(groups), np.asarray(strata),
                    features)


# -- splits ----------------------------------------------------------------------------------------
def split(ex: Examples, protocol: str, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows)."""
    if protocol == "paper":
        from sklearn.model_selection import train_test_split

        return train_test_split(np.arange(len(ex.y)), test_size=0.2, random_state=seed, stratify=ex.stratum)
    if protocol == "prompt":
        # Groups are prompt texts, not trace or run ids: a prompt traced at two tiers, or run by
        # several policies, must not train on one side and test on the other (the draft's signals
        # on it barely change), and random ids made the split differ between equal databases.
        # A prompt's stratum is the set of tier/task strata it appears in.
        pairs = pd.DataFrame({"group": ex.group, "stratum": ex.stratum}).drop_duplicates()
        of = pairs.groupby("group")["stratum"].agg(lambda s: "+".join(sorted(s))).to_dict()  # sorted by group
        rng = random.Random(seed)
        test_groups: set = set()
        pool: list = []  # prompts alone in their stratum are split together
        for s in sorted(set(of.values())):
            gs = [g for g in of if of[g] == s]
            if len(gs) == 1:
                pool += gs
                continue
            rng.shuffle(gs)
            test_groups.update(gs[: max(1, round(0.2 * len(gs)))])
        rng.shuffle(pool)
        test_groups.update(pool[: max(1, round(0.2 * len(pool)))] if len(pool) > 1 else [])
        is_test = np.isin(ex.group, list(test_groups))
        return np.flatnonzero(~is_test), np.flatnonzero(is_test)
    raise ValueError(f"unknown split protocol {protocol!r}; use paper or prompt")


# -- models ----------------------------------------------------------------------------------------
def fit_mlp(x: np.ndarray, y: np.ndarray, seed: int = 42, features: tuple[str, ...] | None = None) -> Predictor:
    """`features`: the columns of x (default by its width: the paper's six, or those and the KV tier)."""
    from sklearn.neural_network import MLPRegressor

    # The paper's model: one hidden layer of 16, sklearn defaults otherwise, raw features.
    m = MLPRegressor(hidden_layer_sizes=(16,), max_iter=500, random_state=seed).fit(x, y)
    arrays = {f"w{i}": w for i, w in enumerate(m.coefs_)} | {f"b{i}": b for i, b in enumerate(m.intercepts_)}
    return Predictor("mlp", arrays, _meta(x, features))


def fit_forest(x: np.ndarray, y: np.ndarray, seed: int = 42, trees: int = 100,
               features: tuple[str, ...] | None = None) -> Predictor:
    from sklearn.ensemble import RandomForestRegressor

    f = RandomForestRegressor(n_estimators=trees, random_state=seed, n_jobs=1).fit(x, y)
    width = max(e.tree_.node_count for e in f.estimators_)

    def padded(get, fill, dtype) -> np.ndarray:
        out = np.full((trees, width), fill, dtype=dtype)
        for i, e in enumerate(f.estimators_):
            v = get(e.tree_)
            out[i, : len(v)] = v
        return out

    arrays = dict(
        left=padded(lambda t: t.children_left, 0, np.int32), right=padded(lambda t: t.children_right, 0, np.int32),
        feature=padded(lambda t: t.feature, -1, np.int32), threshold=padded(lambda t: t.threshold, 0.0, np.float64),
        value=padded(lambda t: t.value[:, 0, 0], 0.0, np.float64),
        depth=np.array(max(e.tree_.max_depth for e in f.estimators_)),
    )
    return Predictor("rf", arrays, _meta(x, features))


def _meta(x: np.ndarray, features: tuple[str, ...] | None) -> dict:
    if features is None:
        features = {len(FEATURES): FEATURES, len(FEATURES_KV): FEATURES_KV}.get(x.shape[1])
    if features is None or len(features) != x.shape[1]:
        raise ValueError(f"{x.shape[1]} feature columns, but features {features} name {len(features or ())}")
    return dict(features=list(features), signal_defaults=np.median(x[:, :4], axis=0).tolist())


def scores(pred: Predictor, x: np.ndarray, y: np.ndarray) -> dict:
    p = pred.predict(x)
    return dict(corr=float(np.corrcoef(y, p)[0, 1]), mse=float(np.mean((y - p) ** 2)))


# -- what the controller would gain ----------------------------------------------------------------
def predictor_scored(pred: Predictor, x: np.ndarray, tiers: np.ndarray) -> dict:
    """SpecKV's own evaluation: on each test row, expected tokens â·γ + 1 by the predictor, for
    its γ choice vs γ = 4 and vs the best fixed γ per tier (also judged by the predictor).
    Self-scored: it says what the predictor believes, not what a run would do."""
    gamma = pred.features.index("gamma")

    def at(g: int) -> np.ndarray:  # the test rows with γ = g
        xg = np.array(x, dtype=np.float64)
        xg[:, gamma] = g
        return xg

    est = {g: tokens_from_rate(g, pred.predict(at(g))) for g in PAPER_CANDIDATES}
    table = np.column_stack([est[g] for g in PAPER_CANDIDATES])  # [N, 4]
    chosen = table.max(axis=1)
    best_fixed = np.zeros(len(x))
    best_gamma: dict[str, str] = {}  # named, so that a verdict can say which fixed γ beat the controller
    for tier in sorted(set(tiers)):
        rows = tiers == tier
        col = int(np.argmax(table[rows].mean(axis=0)))
        best_fixed[rows], best_gamma[str(tier)] = table[rows][:, col], f"fixed:{PAPER_CANDIDATES[col]}"
    return dict(speckv=float(chosen.mean()), fixed4=float(est[4].mean()), best_fixed=float(best_fixed.mean()),
                best_fixed_policy=best_gamma,
                gain_vs_fixed4=float(chosen.mean() / est[4].mean() - 1), gain_vs_best_fixed=float(chosen.mean() / best_fixed.mean() - 1))


def decision_ms(pred: Predictor, costs=None, n: int = 2000) -> float:
    """Median wall time of one `speckv` decision (feature rows, one predict over the candidates,
    the objective), as the policy makes it."""
    from engine.decode.policies.learned import SpeckvPolicy

    policy = SpeckvPolicy(pred, costs, objective="tps" if costs else "paper")
    state = DecodeState(step=1, position=1, context_len=64, remaining=100, target_tier="fp32", kv_tier="native")
    return median_ms(lambda: policy.choose(state), n - n // 10, warmup=n // 10)


@dataclass
class Report:
    source: str
    protocol: str
    n_train: int
    n_test: int
    test_corr: float
    test_mse: float
    rf_test_corr: float
    rf_test_mse: float
    decision_ms_median: float
    rf_decision_ms_median: float
    whatif_kind: str  # "predictor-scored" (SpecKV's way) or "exact replay"
    whatif_gain_vs_fixed4: float
    whatif_gain_vs_best_fixed: float
    whatif: dict
    version: int | None = None
    rf_version: int | None = None
    # The version `speckv` ran before this one was stored, and the new one's gain over it on the
    # same held-out data (None: no active version, or none that could be scored on this data).
    active_version: int | None = None
    whatif_gain_vs_active: float | None = None
    activated: bool = False
    shortfalls: list[str] = field(default_factory=list)  # why it would make `speckv` worse; [] if it would not

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(x: float) -> str:
    """A loss as a percentage a reader can act on: whole percents, a decimal below 10 %."""
    return f"{abs(x):.0%}" if abs(x) >= 0.095 else f"{abs(x):.1%}"


def _best_fixed_name(whatif: dict) -> str:
    """The best fixed γ the gain was measured against, per tier when there are several."""
    best = whatif.get("best_fixed") if isinstance(whatif.get("best_fixed"), dict) else whatif.get("best_fixed_policy")
    if not isinstance(best, dict) or not best:
        return ""
    if len(set(best.values())) == 1:
        return f" ({next(iter(best.values()))})"
    return " (" + ", ".join(f"{p} at {t}" for t, p in sorted(best.items())) + ")"


def shortfalls(r: Report) -> list[str]:
    """Why making this version active would make `speckv` worse, one clause each (empty: it
    would not): its held-out gain is below the best fixed γ or below the active version's on the
    same data, or its test correlation is ≤ 0 (undefined counts: a constant prediction ranks
    nothing). A controller that loses to a fixed γ is worth less than `fixed:k` itself."""
    what = "held-out replay" if r.whatif_kind == "exact replay" else "predictor-scored held-out gain"
    out = []
    if r.whatif_gain_vs_best_fixed < 0:
        out.append(f"its {what} is {_pct(r.whatif_gain_vs_best_fixed)} below the best fixed γ{_best_fixed_name(r.whatif)}")
    if r.whatif_gain_vs_active is not None and r.whatif_gain_vs_active < 0:
        out.append(f"its {what} is {_pct(r.whatif_gain_vs_active)} below the active v{r.active_version}'s on the "
                   "same prompts")
    if not np.isfinite(r.test_corr):
        out.append("its test correlation is undefined (one predicted rate for every test row)")
    elif r.test_corr <= 0:
        out.append(f"its test correlation is {r.test_corr:.2f}")
    return out


def joined(clauses: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`: the clauses of one sentence."""
    return clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + " and " + clauses[-1]


def train(ex: Examples, protocol: str, seed: int = 42) -> tuple[Predictor, Predictor, dict]:
    """Fit both models on the train rows; test metrics on the rest."""
    tr, te = split(ex, protocol, seed)
    if len(te) == 0 or len(tr) == 0:
        raise ValueError(f"the {protocol} split left an empty side ({len(tr)} train, {len(te)} test rows): add data")
    mlp, rf = fit_mlp(ex.x[tr], ex.y[tr], seed, ex.features), fit_forest(ex.x[tr], ex.y[tr], seed, features=ex.features)
    m, r = scores(mlp, ex.x[te], ex.y[te]), scores(rf, ex.x[te], ex.y[te])
    metrics = dict(n_train=int(len(tr)), n_test=int(len(te)), test_corr=m["corr"], test_mse=m["mse"],
                   rf_test_corr=r["corr"], rf_test_mse=r["mse"], test_rows=te)
    return mlp, rf, metrics

