"""Learned γ controllers as plain arrays: the SpecKV acceptance predictor (a 16-unit MLP, or the
100-tree forest kept as the accurate-but-slow reference), its features, and the objectives that
turn a prediction into a draft length (docs/architecture.md, "Policies and controllers").

Numpy only: a decision is a handful of tiny matmuls, and a controller is stored as named arrays
(an .npz in DuckDB), never as a pickled estimator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from engine.base.names import COMPRESSION_CODES, GGUF_KV_CODES, KV_TIER_CODES, check_kv_tier
from engine.decode.records import DecodeState, StepRecord

# The paper's six inputs, in its order. The first four describe the draft's uncertainty over
# the drafted tokens of a step; online they come from the *previous* drafting step, the only one
# whose draft is known before this step drafts (no leakage of the answer).
FEATURES = ("mean_entropy", "mean_confidence", "max_entropy", "min_confidence", "compression", "gamma")
SIGNALS = FEATURES[:4]
# What predictors trained on our own traces and runs read: the paper's six and the KV tier's
# code (a lossy KV cache changes what the target accepts). A predictor's meta lists the features
# it was fitted on, and its rows are built by name, so the six-feature ones (the paper's protocol
# on the imported SpecKV file, controllers stored before KV tiers) keep loading and predicting.
FEATURES_KV = FEATURES + ("kv_tier",)
CANDIDATES = (0, 1, 2, 4, 6, 8)  # the draft lengths a controller weighs; 0 = plain decoding
PAPER_CANDIDATES = (2, 4, 6, 8)  # SpecKV's γ grid


def compression_code(tier: str) -> int:
    if tier not in COMPRESSION_CODES:
        raise ValueError(f"unknown target tier {tier!r}; known: {', '.join(COMPRESSION_CODES)}")
    return COMPRESSION_CODES[tier]


def kv_code(kv_tier: str | None) -> int:
    """The KV tier's feature value (None, a row stored before KV tiers: native)."""
    kv_tier = kv_tier if isinstance(kv_tier, str) else "native"
    codes = KV_TIER_CODES | GGUF_KV_CODES
    if kv_tier not in codes:
        check_kv_tier(kv_tier, None)  # unknown to every engine: a ValueError in one line
    return codes[kv_tier]


@dataclass
class Predictor:
    """Predicted acceptance rate (accepted / γ) from rows of its `features`: [N, F] → [N] in [0, 1]."""

    kind: str  # "mlp" | "rf"
    arrays: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)  # features, defaults, metrics, training config

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.clip(_PREDICT[self.kind](self.arrays, np.asarray(x, dtype=np.float64)), 0.0, 1.0)

    @property
    def features(self) -> tuple[str, ...]:
        """The inputs it was fitted on, in order (meta "features"; the paper's six if unlisted)."""
        return tuple(self.meta.get("features") or FEATURES)

    @property
    def defaults(self) -> np.ndarray:
        """Signals assumed before any step has drafted: the training set's medians."""
        return np.asarray(self.meta["signal_defaults"], dtype=np.float64)


def _mlp(a: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    # sklearn's MLPRegressor: relu hidden layers, identity output; inputs standardized if the
    # trainer stored a scaler (the paper's protocol feeds raw features: no scaler stored).
    if "x_mean" in a:
        x = (x - a["x_mean"]) / a["x_scale"]
    n = sum(1 for k in a if k.startswith("w"))
    for i in range(n):
        x = x @ a[f"w{i}"] + a[f"b{i}"]
        if i < n - 1:
            x = np.maximum(x, 0.0)
    return x[:, 0]


def _forest(a: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """All trees at once: nodes are padded to [T, M]; each round moves every (tree, row) pair one
    level down, so the loop runs max-depth times, not trees × depth."""
    left, right, feat, thr, value = a["left"], a["right"], a["feature"], a["threshold"], a["value"]
    trees = np.arange(left.shape[0])[:, None]  # [T, 1]
    node = np.zeros((left.shape[0], x.shape[0]), dtype=np.int64)  # [T, N]
    rows = np.arange(x.shape[0])[None, :]
    for _ in range(int(a["depth"])):
        f = feat[trees, node]
        leaf = f < 0
        go_left = x[rows, np.where(leaf, 0, f)] <= thr[trees, node]
        node = np.where(leaf, node, np.where(go_left, left[trees, node], right[trees, node]))
    return value[trees, node].mean(axis=0)


_PREDICT: dict[str, Callable[[dict, np.ndarray], np.ndarray]] = {"mlp": _mlp, "rf": _forest}


def last_drafting(state: DecodeState) -> StepRecord | None:
    """The newest step that drafted (and so has signals), or None."""
    return next((r for r in reversed(state.history) if r.k_drafted > 0 and r.mean_entropy is not None), None)


def signals_before(state: DecodeState, defaults: np.ndarray, rec: StepRecord | None = None) -> np.ndarray:
    """[mean H, mean c, H_max, c_min] of the last step that drafted (`rec`, found when not
    given); `defaults` before any."""
    rec = rec or last_drafting(state)
    if rec is None:
        return defaults
    return np.array([rec.mean_entropy, rec.mean_confidence, rec.max_entropy, rec.min_confidence])


def feature_rows(signals: np.ndarray, tier: str, gammas: tuple[int, ...], kv_tier: str = "native",
                 features: tuple[str, ...] = FEATURES) -> np.ndarray:
    """One row per candidate γ, with the columns `features` names (a predictor's own):
    [len(gammas), len(features)]."""
    columns = dict(zip(SIGNALS, np.asarray(signals, dtype=np.float64)), compression=compression_code(tier),
                   gamma=np.asarray(gammas, dtype=np.float64), kv_tier=kv_code(kv_tier))
    unknown = [f for f in features if f not in columns]
    if unknown:
        raise ValueError(f"the controller reads feature(s) {', '.join(unknown)} this SpecLab does not know; "
                         f"known: {', '.join(columns)}")
    x = np.empty((len(gammas), len(features)))
    for i, f in enumerate(features):
        x[:, i] = columns[f]
    return x


def expected_tokens(alpha: np.ndarray | float, k: np.ndarray) -> np.ndarray:
    """E[tokens] of a step drafting k with per-token acceptance α (a truncated geometric: the
    i-th drafted token survives with α^i; one target token always comes on top):
    1 + α + … + α^k = (1 − α^(k+1)) / (1 − α)."""
    alpha = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0 - 1e-9)
    return (1.0 - alpha ** (np.asarray(k) + 1)) / (1.0 - alpha)


def tokens_from_rate(k: np.ndarray | float, rate: np.ndarray | float) -> np.ndarray | float:
    """E[tokens] of a step drafting k whose drafts are accepted at `rate` (accepted / k): one
    target token always, plus k·rate drafted ones. That is 1 + α + … + α^k for the per-token α
    whose drafts keep that rate on average (α + … + α^k = k·rate); putting the rate itself in
    for α undercounts long drafts (α = 0.7 at k = 4: rate 0.44, 1.76 tokens instead of 2.77)."""
    return 1.0 + np.asarray(k) * rate


def candidates(state: DecodeState, grid: tuple[int, ...] = CANDIDATES) -> tuple[int, ...]:
    """The grid's lengths that fit what is left: a step emits at most k + 1 tokens."""
    fit = tuple(k for k in grid if k <= state.remaining - 1)
    return fit or grid[:1]
