"""The KV & prefetch actions: the newest `bench kv` measurement of a target, the tuner's
recommendation over it (service/kv/tuner.py), the page's view of one choice, and measuring."""
from __future__ import annotations

from typing import Any

from engine.base.helpers import one_line
from engine.base.names import KV_TIERS, check_kv_tier
from engine.service.generation import file_missing
from engine.service.sweeps.serial import parse_tiers
from store import Store

# -- KV tuning (engine/service/kv/tuner.py) and measurement (bench/kv.py) ------------------------------------
# Rough wall time of `bench kv` on this project's 2-core CPU, for the page's button (quick / full).
MEASURE_KV_MINUTES = {True: 5, False: 30}
# What each run measures, for the page's spinner: it must not promise what the result will not hold
# (the quick run, KVOptions.quick, skips acceptance and codes the KV at bench kv's bf16).
MEASURE_KV_WHAT = {True: "the KV codec (q8_0 predictor) and restores, the target at bf16; no acceptance "
                         "(the quick run)",
                   False: "the KV codec, restores, and acceptance at fp32 and bf16"}
# The page's controls before anything is measured: `bench kv`'s own defaults (KVOptions:
# 2048 tokens, W 512 within its W sweep, its predictors), the model's own KV dtype (native), the
# weight tier every other page starts at (fp32) and a 1 Gbit/s link.
KV_DEFAULTS: dict[str, Any] = dict(kv_tier="native", coded=True, predictors=("q8_0", "int8", "nf4"), window=512,
                                   windows=(256, 512, 1024, 2048), context=2048, link_gbit_s=1.0, target_tier="fp32")


def latest_kv_measurement(db: str, target: str | None, target_tier: str | None = None
                          ) -> tuple[dict, list[str]] | None:
    """The newest stored `bench kv` row of the target (at `target_tier`, else any tier, noted), its
    result parsed, with the notes; None when the file or such a row does not exist yet (not an error:
    nothing has been measured). Opened read-only, so a running benchmark keeps the file."""
    from engine.service.kv import tuner

    if file_missing(db):
        return None
    with Store(db, read_only=True, wait_s=3.0) as st:
        if not len(st.kv_measurements(target=tuner.target_name(target), kind="bench")):
            return None
        return tuner.newest_measurement(st, target, target_tier)


def tune_kv(db: str, target: str | None, target_tier: str | None, context: int, link_gbit_s: float,
            goal: str) -> dict[str, Any]:
    """`tune`: our KV recommendation from the newest stored measurement beside the seed preset and
    the contradictions, as one JSON-ready dict (ours, seed, contradictions, table, notes,
    measurement). Inputs are checked before the file is opened."""
    from engine.service.kv import preset as kv_preset
    from engine.service.kv import tuner

    kv_preset.check_inputs(context, link_gbit_s, goal)
    if target_tier is not None:
        parse_tiers(target_tier)
    if file_missing(db):
        raise ValueError(tuner.no_measurement(target))
    with Store(db, read_only=True, wait_s=3.0) as st:
        ours, seed, contra = tuner.tune(st, target, target_tier, context, link_gbit_s, goal)
    f = ours.figures
    return dict(ours=ours.as_dict(), seed=seed.as_dict(), contradictions=contra,
                table=kv_preset.comparison_rows(ours, seed), notes=list(ours.notes),
                measurement=dict(measurement_id=f.get("measurement_id"), created_at=f.get("created_at"),
                                 device=f.get("device"), target=tuner.target_name(target),
                                 target_tier=f.get("measured_target_tier"), acceptance_tier=f.get("target_tier")))


def format_tune(out: dict[str, Any]) -> str:
    """`tune`'s text: the measurement it read, choice | measured | seed | why, the contradictions."""
    m, o = out["measurement"], out["ours"]
    acc = f" (acceptance and γ at {m['acceptance_tier']})" if m["acceptance_tier"] != m["target_tier"] else ""
    head = (f"{m['target']} at {m['target_tier']}{acc} on {m['device']}: measurement {m['measurement_id']} "
            f"({m['created_at']}) · {o['context']} tokens over {o['link_gbit_s']:g} Gbit/s · goal {o['goal']}")
    rows = [dict(choice="choice", measured="measured", seed="seed", why="why")] + out["table"]
    width = {k: max(len(r[k]) for r in rows) for k in ("choice", "measured", "seed")}
    lines = [head] + [f"{r['choice']:{width['choice']}}  {r['measured']:{width['measured']}}  "
                      f"{r['seed']:{width['seed']}}  {r['why']}" for r in rows]
    lines += ["contradictions with the seed:"] + [f"  - {c}" for c in out["contradictions"] or ["none"]]
    if out["notes"]:
        lines += ["notes:"] + [f"  - {n}" for n in out["notes"]]
    return "\n".join(lines)


def seed_view(context: int, link_gbit_s: float, goal: str) -> dict[str, Any]:
    """What the KV & prefetch page shows before any measurement: the seed notes' preset for these
    inputs (choice | seed | why). ValueError for bad inputs, in one line."""
    from engine.service.kv import preset as kv_preset

    seed = kv_preset.seed_preset(context, link_gbit_s, goal)
    return dict(seed=seed.as_dict(), table=kv_preset.seed_rows(seed))


def kv_view(row: dict, kv_tier: str, coded: bool, predictor: str | None, window: int, context: int,
            link_gbit_s: float, goal: str, target_tier: str | None = None) -> dict[str, Any]:
    """What the KV & prefetch page draws for one stored row and its inputs: bits per tier × coding,
    speeds, the restore curve of the chosen tier (measured and modelled at this context and W), the
    W and context sweeps, acceptance, the chosen setting's modelled restore, the recommendation
    beside the seed and the contradictions. ValueError for bad inputs, in one line."""
    from engine.service.kv import figures as kv_figures
    from engine.service.kv import preset as kv_preset
    from engine.service.kv import tuner

    kv_preset.check_inputs(context, link_gbit_s, goal)
    check_kv_tier(kv_tier)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"W must be a whole number of tokens ≥ 1, got {window!r}")
    m, notes = row["result"], []
    if window > context:
        notes.append(f"W {window} exceeds the context ({context} tokens): one window of {context}")
    w = min(window, context)
    ours, seed, contra = tuner.tune_row(row, context, link_gbit_s, goal, target_tier)
    cost, cost_notes = kv_figures.tier_cost(m, kv_tier, predictor, window)
    restore = {k: kv_figures.restore_seconds(cost, context, w, link_gbit_s, k) for k in (True, False)}
    by_window, by_context = kv_figures.window_rows(m, kv_tier, context, link_gbit_s), kv_figures.context_rows(m)
    ratios = [f"{t} coded ×" for t in KV_TIERS]
    return dict(
        bits=kv_figures.bits_rows(m, predictor), speeds=kv_figures.speeds(m, predictor),
        restore=kv_figures.restore_rows(m, kv_tier, predictor, w, context),
        breakeven=dict(measured=kv_figures.measured_breakeven(m, kv_tier), modelled=kv_figures.modelled_breakeven(cost, context, w)),
        by_window=by_window, by_context=by_context,
        acceptance=kv_figures.acceptance_rows(m),
        chosen=dict(kv_tier=kv_tier, coded=coded, window=w, bits=kv_figures.bits(m, kv_tier, coded, predictor),
                    restore_s=restore[coded], other_s=restore[not coded]),
        ours=ours.as_dict(), seed=seed.as_dict(), table=kv_preset.comparison_rows(ours, seed), contradictions=contra,
        missing=kv_figures.missing(m),
        notes=notes + cost_notes + kv_figures.speed_notes(m, predictor) + list(ours.notes),
        acceptance_note=kv_figures.acceptance_note(m, target_tier), acceptance_tiers=kv_figures.acceptance_tiers(m),
        flat=dict(by_window=kv_figures.flat_series(by_window, ratios),
                  by_context=kv_figures.flat_series(by_context, ratios)),
    )


def measure_kv(db_path: str, quick: bool = True, target: str | None = None) -> object:
    """Runs the KV measurement (`python -m engine bench kv`) into `db_path`: kv/measure.py's
    `run` with the quick or the default options, which stores its result with
    `Store.add_kv_measurement`; returns what `run` returns. Imported only now: it loads models. A
    measurement that cannot be imported is a ValueError in one line."""
    try:
        from engine.service.kv.measure import KVOptions, run
    except Exception as e:  # noqa: BLE001 - whatever broke the import, the user gets one line
        raise ValueError(f"cannot load the KV benchmark (engine/service/kv/measure.py): {one_line(e)}") from None
    return run((KVOptions.quick if quick else KVOptions)(db=db_path, target=target))
