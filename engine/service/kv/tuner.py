"""The joint KV tuner (issue 12): from a stored `bench kv` measurement, which KV tier to hold, whether
to code it, the restore window W and the range of draft lengths γ, for one context length, link
bandwidth and goal; beside the seed notes' preset, and where the measurement contradicts it.

Plain Python on purpose (no torch, no numpy): the CLI's `tune`, the KV & prefetch page and the tests
read a measurement's JSON (`kv_measurements.result`, written by service/kv/measure.py) and model
restores with runtime/kv/pipeline.py's `pipelined_seconds` (plain Python too), so that nothing here
needs a model. Every key of a measurement may be missing: a choice that lacks its figure falls back to the
seed's rule and says so (in `why` and `notes`), never a KeyError.

The rules (`recommend`):

- **memory**: the tier × coding with the fewest bits per scalar whose draft acceptance stays within
  `ACCEPTANCE_SLACK` (0.03) of native's at the target tier; a cheaper option that loses more is
  skipped (and named). Native is always allowed; a lossy tier whose acceptance was not measured is not
  (it cannot be vouched for).
- **latency**: the KV tier whose best measured tokens/s (over `ar` and `fixed:k`) at the target tier
  is highest; native on a tie or when no tok/s was stored. Coding only if the modelled restore of the
  whole context at this link is faster coded than raw.
- **W**: among the measured `by_window` widths that fit the context (W ≤ context), the one whose
  modelled coded restore at this link is shortest (ties: the larger W, fewer windows). A raw restore
  at latency 0 does not depend on W, so uncoded, W is the measured width nearest the seed's range.
- **γ**: every γ (`ar` = 0, `fixed:k` = k) whose tokens/s at the chosen KV tier is within
  `GAMMA_SLACK` (3 %) of the best; the range is their min..max.

The restore model (`restore_seconds`): N context tokens in windows of W; the link moves windows one
after another at `link_gbit_s` (latency 0); per window the caller computes μ (the predictor) and
decodes, `mu_s_per_token·w` and `decode_s_per_token·w`; coded makespan = `pipelined_seconds`, raw =
the sum of the transfers. A window's coded size and decode time scale from the tier's headline figures
by the `by_window` row of that W (its bits and decode MB/s against the headline ones), and by the
predictor's figures when another predictor than the measured best is chosen."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from engine.base.names import EMBEDDED_LABEL, KV_TIERS
from engine.service.kv.figures import (
    ACCEPTANCE_SLACK,
    GAMMA_SLACK,
    SLOW_LINK_GBIT_S,
    acceptance_at,
    bits,
    fmt,
    gamma_tps,
    measured_breakeven,
    measured_windows,
    modelled_breakeven,
    num,
    policy_of,
    ratio_of,
    restore_seconds,
    tier_cost,
)
from engine.service.kv.preset import Recommendation, check_inputs, contradictions, seed_band, seed_preset


# -- the recommendation --------------------------------------------------------------------------
@dataclass
class _Ctx:
    """One `recommend` call's inputs and what it has learnt so far."""

    m: Mapping
    context: int
    link: float
    goal: str
    target_tier: str
    acc: dict[str, Mapping]
    why: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def label(self, tier: str) -> str:
        return f"{self.target_tier}/{tier}"


def _option(tier: str, coded: bool) -> str:
    return f"{tier}{'+coding' if coded else ' raw'}"


def _memory_tier(c: _Ctx) -> tuple[str, bool]:
    """Fewest bits per scalar among tier × coding within the acceptance slack of native."""
    native_raw = bits(c.m, "native", False)
    native_acc = num(c.acc.get("native"), "acceptance")

    def refusal(tier: str) -> str | None:  # why a lossy tier may not be chosen; None: it may
        acc = num(c.acc.get(tier), "acceptance")
        if tier == "native":
            return None
        if acc is None or native_acc is None:
            return f"acceptance at {c.label(tier if acc is None else 'native')} not measured"
        return None if acc >= native_acc - ACCEPTANCE_SLACK else f"acceptance {acc:.2f}, {native_acc - acc:.2f} below native"

    options = sorted(((b, t, coded) for t in KV_TIERS for coded in (True, False)
                      if (b := bits(c.m, t, coded)) is not None), key=lambda o: (o[0], KV_TIERS.index(o[1])))
    chosen = next((o for o in options if refusal(o[1]) is None), None)
    if chosen is None:
        c.notes.append("no admissible KV tier with measured bits per scalar: native raw by default")
        c.why["kv_tier"] = "no admissible tier with measured bits per scalar: native (the model's dtype)"
        c.why["coded"] = "no coded size measured for native"
        return "native", False
    b, t, coded = chosen
    skipped = [f"{_option(t_, k)} {fmt(b_)} skipped: {refusal(t_)}" for b_, t_, k in options[:options.index(chosen)]
               if refusal(t_) is not None]
    ratio, acc = ratio_of(native_raw, b), num(c.acc.get(t), "acceptance")
    acc_text = (f"; acceptance at {t} {fmt(acc, '.2f')} vs native {fmt(native_acc, '.2f')}" if t != "native"
                else f"; acceptance at native {fmt(native_acc, '.2f')}")
    c.why["kv_tier"] = (f"{_option(t, coded)} {fmt(b)} bits/scalar vs native {fmt(native_raw)}"
                        + (f" ({ratio:.1f}× smaller)" if ratio else "") + acc_text
                        + ("; " + "; ".join(skipped) if skipped else ""))
    c.why["coded"] = (f"coded {fmt(bits(c.m, t, True))} vs raw {fmt(bits(c.m, t, False))} bits/scalar at {t}: "
                      + ("fewer bits at rest" if coded else "coding does not shrink it"))
    return t, coded


def _latency_tier(c: _Ctx) -> str:
    """The KV tier with the best measured tok/s at the target tier (native on a tie)."""
    best = {t: max(gamma_tps(e).items(), key=lambda kv: kv[1], default=None) for t, e in c.acc.items()}
    best = {t: b for t, b in best.items() if b is not None}
    c.figures["best_tokens_per_s"] = {t: {"policy": policy_of(g), "tokens_per_s": v} for t, (g, v) in best.items()}
    if not best:
        c.notes.append(f"no tok/s per γ stored at {c.target_tier}: native (the seed's) for latency")
        c.why["kv_tier"] = f"no tok/s measured at {c.target_tier}: native, as the seed says"
        return "native"
    tier = max(best, key=lambda t: (best[t][1], -KV_TIERS.index(t)))
    others = ", ".join(f"{t} {v:.3g} ({policy_of(g)})" for t, (g, v) in best.items() if t != tier)
    g, v = best[tier]
    c.why["kv_tier"] = f"{tier} fastest at {c.target_tier}: {v:.3g} tok/s ({policy_of(g)})" + (f" vs {others}" if others else "")
    return tier


def _restore_by_window(c: _Ctx, tier: str) -> list[dict[str, Any]]:
    """Modelled restore of the context at each measured W that fits it (W ≤ context)."""
    ws = [w for w in measured_windows(c.m) if w <= c.context] or [c.context]
    out = []
    for w in ws:
        cost, notes = tier_cost(c.m, tier, window=w)
        c.notes.extend(n for n in notes if n not in c.notes)
        out.append(dict(window=w, coded_s=restore_seconds(cost, c.context, w, c.link, True),
                        raw_s=restore_seconds(cost, c.context, w, c.link, False)))
    return out


def _nearest_to(ws: Sequence[int], lo: int, hi: int) -> int:
    return min(ws, key=lambda w: (0 if lo <= w <= hi else min(abs(w - lo), abs(w - hi)), -w))


def _window_and_coding(c: _Ctx, tier: str, want_coded: bool | None) -> tuple[int, bool]:
    """W (and, for latency, coding): the measured W with the shortest modelled coded restore; coded
    for latency only when that restore beats the raw transfer at this link. `want_coded` is the
    memory goal's fixed decision (None: decide here)."""
    rows = _restore_by_window(c, tier)
    c.figures["restore_by_window"] = rows
    timed = [r for r in rows if r["coded_s"] is not None]
    band = seed_band(c.context)
    if not measured_windows(c.m):
        c.notes.append("no W sweep (by_window) stored")
    best = min(timed, key=lambda r: (r["coded_s"], -r["window"])) if timed else None
    cost, _ = tier_cost(c.m, tier, window=best["window"] if best else None)
    be_meas, be_model = measured_breakeven(c.m, tier), None
    if best is not None:
        be_model = modelled_breakeven(cost, c.context, best["window"])
    c.figures["breakeven_gbit_s"] = {"measured": be_meas, "modelled": be_model}
    be = f"break-even {fmt(be_meas if be_meas is not None else be_model)} Gbit/s"
    coded = want_coded
    if coded is None:  # latency: coded only if faster here
        if best is not None and best["raw_s"] is not None:
            coded = best["coded_s"] < best["raw_s"]
            c.why["coded"] = (f"{tier} restore of {c.context} tokens at {c.link:g} Gbit/s: coded {fmt(best['coded_s'])} s "
                              f"vs raw {fmt(best['raw_s'])} s at W {best['window']} ({be})")
        elif be_meas is not None:
            coded = c.link < be_meas
            c.why["coded"] = f"no restore model for {tier}: {be} measured, link {c.link:g} Gbit/s"
        else:
            coded = c.link < SLOW_LINK_GBIT_S
            c.why["coded"] = f"no restore figures for {tier}: the seed's rule (coding below {SLOW_LINK_GBIT_S:g} Gbit/s)"
            c.notes.append(f"no restore figures for {tier}")
    elif best is not None and best["raw_s"] is not None:
        c.why["coded"] += f"; restore at {c.link:g} Gbit/s coded {fmt(best['coded_s'])} s vs raw {fmt(best['raw_s'])} s"
    c.figures["restore"] = dict(best or {}, tier=tier)
    if coded and best is not None:
        c.figures["window_decided"] = True
        runner = sorted(timed, key=lambda r: (r["coded_s"], -r["window"]))[1:2]
        c.why["window"] = (f"W {best['window']}: coded restore {fmt(best['coded_s'])} s at {c.link:g} Gbit/s for "
                           f"{c.context} tokens" + (f" (next W {runner[0]['window']}: {fmt(runner[0]['coded_s'])} s)"
                                                   if runner else ""))
        return best["window"], True
    c.figures["window_decided"] = False
    ws = [r["window"] for r in rows]
    w = _nearest_to(ws, *band.window)
    c.why["window"] = (f"W {w}: a raw restore at latency 0 does not depend on W; the measured W nearest the "
                       f"seed's {band.window[0]}–{band.window[1]}" + (" (≤ the context)" if w < band.window[0] else ""))
    return w, bool(coded)


def _gamma_range(c: _Ctx, tier: str) -> tuple[int, int]:
    """γ values within GAMMA_SLACK of the best tok/s at the chosen KV tier: their min..max."""
    entry = c.acc.get(tier, {})
    tps = gamma_tps(entry)
    band = seed_band(c.context)
    c.figures["tokens_per_s"] = {policy_of(g): v for g, v in sorted(tps.items())}
    c.figures["gamma_measured"] = bool(tps)
    if not tps:
        g = num(entry, "best_gamma")
        if g is not None:
            c.why["gamma"] = (f"best γ {int(g)} at {c.label(tier)} (best vs ar {fmt(num(entry, 'best_vs_ar'))}); "
                              "no tok/s per γ stored")
            c.figures["gamma_measured"] = True
            return int(g), int(g)
        c.notes.append(f"no tok/s per γ at {c.label(tier)}: the seed's γ range")
        c.why["gamma"] = f"not measured at {c.label(tier)}: the seed's γ {band.gamma[0]}–{band.gamma[1]}"
        return band.gamma
    top = max(tps.values())
    good = sorted(g for g, v in tps.items() if v >= (1 - GAMMA_SLACK) * top)
    best = max(tps, key=lambda g: (tps[g], -g))
    listing = ", ".join(f"{policy_of(g)} {v:.3g}" for g, v in sorted(tps.items()))
    c.why["gamma"] = (f"γ {'–'.join(map(str, sorted({good[0], good[-1]})))} within {GAMMA_SLACK:.0%} of the best "
                      f"({policy_of(best)} {top:.3g} tok/s) at {c.label(tier)}; tok/s: {listing}")
    return good[0], good[-1]


def recommend(measurement: Mapping, context: int, link_gbit_s: float, goal: str,
              target_tier: str | None = None) -> Recommendation:
    """Our recommendation from one stored measurement (its `result` JSON); the rules are in the
    module docstring. `target_tier` picks the acceptance entries (default the measurement's own)."""
    check_inputs(context, link_gbit_s, goal)
    if not isinstance(measurement, Mapping):
        raise ValueError(f"a KV measurement is a JSON object, got {type(measurement).__name__}")
    m = measurement
    own = m.get("target_tier") if isinstance(m.get("target_tier"), str) else None
    tier_of_acc = target_tier or own or "an unnamed target tier"
    acc = acceptance_at(m, tier_of_acc)
    c = _Ctx(m, int(context), float(link_gbit_s), goal, tier_of_acc, acc)
    if not acc and own and own != tier_of_acc and acceptance_at(m, own):
        c.notes.append(f"no acceptance measured at {tier_of_acc}: using {own}'s")
        c.target_tier, c.acc = own, acceptance_at(m, own)
    elif not acc:
        c.notes.append(f"no acceptance measured at {tier_of_acc}")
    c.figures["bits"] = {t: {"raw": bits(m, t, False), "coded": bits(m, t, True)} for t in KV_TIERS}
    c.figures["acceptance"] = {t: num(c.acc.get(t), "acceptance") for t in KV_TIERS}
    decide: dict[str, Callable[[_Ctx], tuple[str, bool | None]]] = {
        "memory": _memory_tier, "latency": lambda c_: (_latency_tier(c_), None)}
    tier, want_coded = decide[goal](c)
    window, coded = _window_and_coding(c, tier, want_coded)
    lo, hi = _gamma_range(c, tier)
    c.figures["target_tier"] = c.target_tier
    return Recommendation(kv_tier=tier, coded=coded, window=window, gamma_lo=lo, gamma_hi=hi, why=c.why,
                          source="measured", context=c.context, link_gbit_s=c.link, goal=goal,
                          figures=c.figures, notes=tuple(c.notes))


# -- from the store ------------------------------------------------------------------------------
def result_of(row: Mapping) -> dict:
    """A stored row's `result` as a dict (DuckDB hands JSON back as text)."""
    r = row.get("result")
    if isinstance(r, str):
        try:
            r = json.loads(r)
        except ValueError as e:
            raise ValueError(f"KV measurement {row.get('measurement_id')} has unreadable JSON ({e})") from None
    if not isinstance(r, Mapping):
        raise ValueError(f"KV measurement {row.get('measurement_id')} holds no result object")
    return dict(r)


def target_name(target: str | None) -> str:
    """What measurements are stored under: the embedded target's label for None/''/embedded."""
    return EMBEDDED_LABEL if target in (None, "", "embedded") else str(target)


def no_measurement(target: str | None) -> str:
    return (f"no KV measurements for {target_name(target)} yet: run `python -m engine bench kv` "
            "(or press Measure on the KV & prefetch page)")


def newest_measurement(store: Any, target: str | None, target_tier: str | None = None) -> tuple[dict, list[str]]:
    """The newest `kind='bench'` row for the target at `target_tier` (any tier when None; another
    tier, with a note, when that one has none), with its result parsed; ValueError when none."""
    rows = store.kv_measurements(target=target_name(target), kind="bench")
    if not len(rows):
        raise ValueError(no_measurement(target))
    records = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
    notes = []
    mine = [r for r in records if target_tier is None or r.get("target_tier") == target_tier]
    if not mine:
        mine = records
        notes.append(f"no KV measurement of {target_name(target)} at {target_tier}: using the newest at "
                     f"{records[-1].get('target_tier')}")
    row = dict(mine[-1])
    row["result"] = result_of(row)
    return row, notes


def tune_row(row: Mapping, context: int, link_gbit_s: float, goal: str, target_tier: str | None = None
             ) -> tuple[Recommendation, Recommendation, list[str]]:
    """(ours, seed, contradictions) for one stored row."""
    seed = seed_preset(context, link_gbit_s, goal)
    ours = recommend(result_of(row), context, link_gbit_s, goal, target_tier or row.get("target_tier"))
    return ours, seed, contradictions(ours, seed)


def tune(store: Any, target: str | None, target_tier: str | None, context: int, link_gbit_s: float, goal: str
         ) -> tuple[Recommendation, Recommendation, list[str]]:
    """(ours, seed, contradictions) from the newest stored bench measurement of the target (at the
    tier, else any tier, noted in ours.notes). Inputs are checked before the store is read."""
    check_inputs(context, link_gbit_s, goal)
    row, notes = newest_measurement(store, target, target_tier)
    ours, seed, contra = tune_row(row, context, link_gbit_s, goal, target_tier)
    figures = dict(ours.figures, measurement_id=row.get("measurement_id"), created_at=str(row.get("created_at")),
                   device=row.get("device"), measured_target_tier=row.get("target_tier"))
    ours = replace(ours, figures=figures, notes=tuple(notes) + ours.notes)
    return ours, seed, contra


