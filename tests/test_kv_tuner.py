"""The joint KV tuner (engine/service/kv/tuner.py), `python -m engine tune` and the KV & prefetch page, on a
synthetic `bench kv` measurement: no model, no benchmark, seconds."""
from __future__ import annotations

import copy
import json
import math
import sys
import types
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.base.names import KV_TIERS
from engine.runtime.kv.pipeline import pipelined_seconds
from engine.service.kv import figures as F
from engine.service.kv import preset as S
from engine.service.kv import tuner as T
from engine.service.kv.measure import KVOptions
from store import Store

APP = Path(__file__).resolve().parents[1] / "app.py"
TARGET = "SmolLM2-135M-Instruct"

# -- a synthetic measurement, consistent with the tuner's restore model ----------------------------
SCALARS = 11520  # 30 layers × 3 KV heads × 64 × (K, V): the embedded target's scalars per token
MU, DEC = 2e-5, 1e-5  # s per token: predictor, entropy decode
BITS = {"native": (16.0, 4.6), "fp8": (8.125, 1.4), "int8": (8.25, 2.0)}
BREAKEVEN = {"native": 6.1, "fp8": 3.1, "int8": 4.3}


def _tier(t: str, raw: float, coded: float, mu: float, dec: float) -> dict:
    return dict(bits=raw, bits_coded=coded, bytes_per_token=SCALARS * raw / 8, coded_bytes_per_token=SCALARS * coded / 8,
                mu_s_per_token=mu, decode_s_per_token=dec, breakeven_gbit_s=BREAKEVEN[t])


def _acc(target_tier: str, kv: str, acceptance: float, tps: dict) -> dict:
    best = max(tps, key=tps.get)
    return dict(target_tier=target_tier, kv_tier=kv, acceptance=acceptance,
                best_gamma=0 if best == "ar" else int(best.split(":")[1]), best_vs_ar=tps[best] / tps["ar"],
                tokens_per_s=tps)


def synthetic(mu: float = MU, dec: float = DEC) -> dict:
    """A `bench kv` result as service/kv/measure.py stores it (the shape in issue 12), its figures made up."""
    restore = []
    for b in (0.1, 0.3, 1, 3, 10, 30, 100):
        row = dict(gbit_s=b)
        for t, (raw, coded) in BITS.items():
            row[f"{t}_raw_s"] = 2048 * SCALARS * raw / (b * 1e9)
            row[f"{t}_coded_s"] = max(2048 * SCALARS * coded / (b * 1e9), 2048 * (mu + dec))
        restore.append(row)
    return {
        "target": TARGET, "target_tier": "bf16", "device": "cpu", "context_tokens": 2048, "window": 512,
        "best_predictor": "q8_0", "native_bits": 4.6, "fp8_bits": 8.125, "fp8_bits_coded": 1.4, "int8_bits": 8.25,
        "int8_bits_coded": 2.0, "zstd19_native_bits": 12.3, "zstd19_fp8_bits": 6.6, "zstd19_int8_bits": 7.0,
        "encode_mb_s": 40.0, "decode_mb_s": 24.0, "roundtrip_exact": True, "breakeven_gbit_s": 6.1,
        "predictors": {"q8_0": {"native_bits": 4.6, "fp8_bits_coded": 1.4, "int8_bits_coded": 2.0, "encode_mb_s": 40,
                                "decode_mb_s": 24, "predictor_frac": 1.1},
                       "int8": {"native_bits": 5.0, "fp8_bits_coded": 1.7, "int8_bits_coded": 2.3, "encode_mb_s": 45,
                                "decode_mb_s": 30, "predictor_frac": 0.9}},
        "tiers": {t: _tier(t, *b, mu, dec) for t, b in BITS.items()},
        "restore": restore,
        "by_window": [dict(window=w, native_bits=nb, fp8_bits_coded=fb, decode_mb_s=d, restore_s_1gbit=r)
                      for w, nb, fb, d, r in [(256, 5.2, 1.6, 20, 0.07), (512, 4.6, 1.4, 24, 0.065),
                                              (1024, 4.4, 1.35, 25, 0.066), (2048, 4.3, 1.32, 25.5, 0.07),
                                              (4096, 4.25, 1.3, 26, 0.08)]],
        "by_context": [dict(context=c, native_bits=nb, fp8_bits_coded=fb, decode_mb_s=d)
                       for c, nb, fb, d in [(512, 4.8, 1.5, 23), (2048, 4.6, 1.4, 24), (8192, 4.5, 1.38, 24.5)]],
        "acceptance": [
            _acc("bf16", "native", 0.31, {"ar": 20.1, "fixed:2": 18.3, "fixed:4": 15.2}),
            _acc("bf16", "fp8", 0.30, {"ar": 19.0, "fixed:2": 18.8, "fixed:4": 16.0}),
            _acc("bf16", "int8", 0.25, {"ar": 18.5, "fixed:2": 17.0, "fixed:4": 14.0}),
            _acc("fp32", "native", 0.33, {"ar": 10.0, "fixed:2": 10.5, "fixed:4": 11.0, "fixed:6": 10.8}),
            _acc("fp32", "fp8", 0.32, {"ar": 9.5, "fixed:2": 10.0, "fixed:4": 10.4, "fixed:6": 10.2}),
            _acc("fp32", "int8", 0.28, {"ar": 9.4, "fixed:2": 9.8, "fixed:4": 10.1, "fixed:6": 9.9}),
        ],
    }


def _store(store: Store, result: dict, target_tier: str = "bf16", target: str = TARGET) -> str:
    return store.add_kv_measurement(dict(device="cpu", target=target, target_tier=target_tier, kind="bench",
                                         result=result))


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "kv.duckdb"
    with Store(path) as st:
        _store(st, synthetic())
    return path


# -- the seed preset ---------------------------------------------------------------------------------
@pytest.mark.parametrize("context,window,gamma", [
    (1, (512, 1024), (2, 4)), (8191, (512, 1024), (2, 4)), (8192, (1024, 2048), (4, 6)),
    (65536, (1024, 2048), (4, 6)), (65537, (2048, 4096), (6, 8)), (F.MAX_CONTEXT, (2048, 4096), (6, 8)),
])
def test_seed_bands(context, window, gamma):
    seed = S.seed_preset(context, 30.0, "latency")
    assert seed.window_range == window and (seed.gamma_lo, seed.gamma_hi) == gamma
    assert seed.window == min(window[0], context) and seed.source == "seed"


def test_seed_goals_and_the_cross_datacenter_rule():
    memory = S.seed_preset(4096, 30, "memory")
    assert (memory.kv_tier, memory.coded) == ("fp8", True) and "6–8×" in memory.why["kv_tier"]
    fast = S.seed_preset(4096, 30, "latency")
    assert (fast.kv_tier, fast.coded) == ("native", False)
    slow = S.seed_preset(4096, 2, "latency")
    assert (slow.kv_tier, slow.coded) == ("native", True)
    assert slow.figures["required_ratio"] == pytest.approx(50.0) and "100/2 = 50×" in slow.why["coded"]


@pytest.mark.parametrize("context,link,goal,needle", [
    (0, 1, "memory", "context must be from 1 to 4194304 tokens, got 0"),
    (F.MAX_CONTEXT + 1, 1, "memory", "context must be from 1 to 4194304 tokens"),
    (1.5, 1, "memory", "context must be a whole number of tokens, got 1.5"),
    (True, 1, "memory", "context must be a whole number"),
    (1024, 0, "memory", "link bandwidth must be > 0 and ≤ 10000 Gbit/s, got 0"),
    (1024, -3.0, "latency", "got -3.0"),
    (1024, float("inf"), "latency", "link bandwidth must be > 0"),
    (1024, float("nan"), "latency", "link bandwidth must be > 0"),
    (1024, 1, "speed", "unknown goal 'speed'; use one of latency, memory"),
])
def test_bad_inputs_are_one_precise_line(context, link, goal, needle):
    for fn in (S.seed_preset, lambda *a: T.recommend(synthetic(), *a)):
        with pytest.raises(ValueError) as e:
            fn(context, link, goal)
        assert needle in str(e.value) and "\n" not in str(e.value)


# -- recommend -----------------------------------------------------------------------------------
def _admissible_bits(m: dict, target_tier: str) -> list[tuple[float, str, bool]]:
    acc = {r["kv_tier"]: r["acceptance"] for r in m["acceptance"] if r["target_tier"] == target_tier}
    return sorted((m["tiers"][t]["bits_coded" if coded else "bits"], t, coded) for t in KV_TIERS for coded in (True, False)
                  if t == "native" or acc[t] >= acc["native"] - F.ACCEPTANCE_SLACK)


def test_memory_picks_the_fewest_bits_within_the_acceptance_limit():
    m = synthetic()
    m["tiers"]["int8"]["bits_coded"] = 1.2  # fewer bits than fp8+coding, but acceptance 0.25 vs native 0.31
    ours = T.recommend(m, 4096, 1.0, "memory", "bf16")
    assert (ours.kv_tier, ours.coded) == ("fp8", True)
    assert (1.4, "fp8", True) == _admissible_bits(m, "bf16")[0]
    assert "int8+coding 1.2 skipped: acceptance 0.25, 0.06 below native" in ours.why["kv_tier"]
    assert "fp8+coding 1.4 bits/scalar vs native 16 (11.4× smaller)" in ours.why["kv_tier"]
    # Within the limit (0.29 ≥ 0.31 − 0.03), the fewer bits win.
    next(r for r in m["acceptance"] if (r["target_tier"], r["kv_tier"]) == ("bf16", "int8"))["acceptance"] = 0.29
    ours = T.recommend(m, 4096, 1.0, "memory", "bf16")
    assert (ours.kv_tier, ours.coded) == ("int8", True) and "skipped" not in ours.why["kv_tier"]
    # Every lossy tier out of reach: native, coded (4.6 < 16 bits).
    for r in m["acceptance"]:
        r["acceptance"] = 0.1 if r["kv_tier"] != "native" else r["acceptance"]
    ours = T.recommend(m, 4096, 1.0, "memory", "bf16")
    assert (ours.kv_tier, ours.coded) == ("native", True)


def test_a_lossy_tier_without_measured_acceptance_is_not_chosen_for_memory():
    m = synthetic()
    m["acceptance"] = [r for r in m["acceptance"] if r["kv_tier"] != "fp8"]
    ours = T.recommend(m, 4096, 1.0, "memory", "bf16")
    assert ours.kv_tier == "native" and "acceptance at bf16/fp8 not measured" in ours.why["kv_tier"]


def test_latency_coding_flips_off_above_the_break_even():
    m = synthetic()
    ours = T.recommend(m, 8192, 1.0, "latency", "bf16")
    assert ours.kv_tier == "native"  # 20.1 tok/s (ar) beats fp8's 19.0 and int8's 18.5
    cost, _ = F.tier_cost(m, "native", window=ours.window)
    breakeven = F.modelled_breakeven(cost, 8192, ours.window)
    assert 1 < breakeven < 30
    below = T.recommend(m, 8192, breakeven * 0.8, "latency", "bf16")
    above = T.recommend(m, 8192, breakeven * 1.25, "latency", "bf16")
    assert below.coded and not above.coded
    for r in (below, above):
        f = r.figures["restore"]
        assert (f["coded_s"] < f["raw_s"]) == r.coded
    assert "raw" in above.why["coded"] and "break-even 6.1 Gbit/s" in above.why["coded"]
    assert not T.recommend(m, 8192, 100.0, "latency", "bf16").coded


@pytest.mark.parametrize("goal", F.GOALS)
@pytest.mark.parametrize("link", [0.1, 1.0, 30.0])
@pytest.mark.parametrize("context", [1, 100, 256, 300, 1000, 5000, 100_000])
def test_window_never_exceeds_the_context_and_minimises_the_coded_restore(context, link, goal):
    m = synthetic()
    ours = T.recommend(m, context, link, goal, "bf16")
    assert 1 <= ours.window <= context
    assert ours.window in F.measured_windows(m) or ours.window == context
    rows = ours.figures["restore_by_window"]
    assert all(r["window"] <= context for r in rows)
    if ours.coded:
        assert ours.figures["window_decided"]
        assert ours.window == min(rows, key=lambda r: (r["coded_s"], -r["window"]))["window"]


def test_gamma_range_is_every_gamma_within_three_percent_of_the_best():
    m = synthetic()
    assert (lambda r: (r.gamma_lo, r.gamma_hi))(T.recommend(m, 2048, 30, "latency", "bf16")) == (0, 0)
    memory = T.recommend(m, 2048, 30, "memory", "bf16")  # fp8: ar 19.0, fixed:2 18.8 (within 3 %)
    assert (memory.kv_tier, memory.gamma_lo, memory.gamma_hi) == ("fp8", 0, 2)
    fp32 = T.recommend(m, 2048, 30, "latency", "fp32")  # fixed:4 11.0, fixed:6 10.8 ≥ 10.67
    assert (fp32.gamma_lo, fp32.gamma_hi) == (4, 6) and "fixed:4 11 tok/s" in fp32.why["gamma"]


def test_predictor_and_window_scale_the_restore_model():
    m = synthetic()
    base, _ = F.tier_cost(m, "fp8")
    other, _ = F.tier_cost(m, "fp8", "int8")  # 1.7 vs 1.4 bits, 30 vs 24 MB/s
    assert other.coded_bytes == pytest.approx(base.coded_bytes * 1.7 / 1.4)
    assert other.decode_s == pytest.approx(base.decode_s * 24 / 30)
    small, _ = F.tier_cost(m, "fp8", window=256)  # 1.6 bits, 20 MB/s at W 256
    assert small.coded_bytes == pytest.approx(base.coded_bytes * 1.6 / 1.4)
    int8_small, _ = F.tier_cost(m, "int8", window=256)  # the sweep has no int8 bits: native's change
    assert int8_small.coded_bytes == pytest.approx(F.tier_cost(m, "int8")[0].coded_bytes * 5.2 / 4.6)
    assert pipelined_seconds([1, 1], [0.5, 0.5], [2, 2]) == pytest.approx(5.5)  # compute-bound: 1 + 2, then 0.5 + 2
    assert pipelined_seconds([3, 3], [0.5, 0.5], [1, 1]) == pytest.approx(7.0)  # link-bound: 6 + the last decode


@pytest.mark.parametrize("drop", ["tiers", "restore", "by_window", "by_context", "acceptance", "predictors",
                                  "best_predictor", "window", "ALL"])
def test_missing_keys_are_said_not_crashed_on(drop):
    m = {} if drop == "ALL" else {k: v for k, v in synthetic().items() if k != drop}
    for goal in F.GOALS:
        for context, link in [(64, 0.1), (9000, 3.0), (200_000, 50.0)]:
            ours = T.recommend(m, context, link, goal, "bf16")
            assert ours.source == "measured" and 1 <= ours.window <= context
            assert set(ours.why) == {"kv_tier", "coded", "window", "gamma"}
            json.dumps(ours.as_dict(), allow_nan=False)
            S.contradictions(ours, S.seed_preset(context, link, goal))
    if drop in ("acceptance", "ALL"):
        assert any("no acceptance measured" in n for n in ours.notes)
    if drop in ("tiers", "restore", "by_window", "by_context", "acceptance", "predictors"):
        assert drop in F.missing(m)
    for rows in (F.bits_rows(m), F.window_rows(m, "fp8", 100, 1.0), F.context_rows(m), F.acceptance_rows(m),
                 F.restore_rows(m, "native", None, 512, 4096)):
        assert isinstance(rows, list)


# -- contradictions ------------------------------------------------------------------------------
def test_speculation_that_does_not_pay_contradicts_the_seed_gamma():
    ours = T.recommend(synthetic(), 4096, 30, "latency", "bf16")
    text = S.contradictions(ours, S.seed_preset(4096, 30, "latency"))
    assert "seed: γ 2–4 for < 8K; measured: speculation does not pay at bf16/native (best γ 0, fixed:2 0.91× ar)" in text


def test_a_break_even_below_a_slow_link_contradicts_cross_datacenter_coding():
    m = synthetic(mu=2e-3)  # a slow predictor: coding pays only below ~0.06 Gbit/s
    m["tiers"]["native"]["breakeven_gbit_s"] = 0.06
    ours = T.recommend(m, 4096, 1.0, "latency", "bf16")
    assert not ours.coded
    text = S.contradictions(ours, S.seed_preset(4096, 1.0, "latency"))
    assert any(c.startswith("seed: coding for cross-datacenter links; measured break-even 0.06 Gbit/s, below this "
                            "1 Gbit/s link: raw transfer restores faster") for c in text), text


def test_a_measured_window_outside_the_seed_range_contradicts_it():
    m = synthetic()
    m["by_window"][0]["native_bits"] = 2.0  # W 256 codes far better: on a slow link it restores fastest
    ours = T.recommend(m, 2048, 0.1, "latency", "bf16")
    assert ours.coded and ours.window == 256
    text = S.contradictions(ours, S.seed_preset(2048, 0.1, "latency"))
    assert any(c.startswith("seed: W 512–1024 for < 8K; measured best W 256 at 0.1 Gbit/s") for c in text), text


def test_coding_on_a_fast_link_and_the_memory_ratio_contradict_the_seed():
    m = synthetic(mu=1e-7, dec=1e-7)  # a predictor and decoder fast enough to pay on a fast link
    ours, seed = T.recommend(m, 8192, 25.0, "latency", "bf16"), S.seed_preset(8192, 25.0, "latency")
    assert ours.coded and not seed.coded
    assert any(c.startswith("seed: no coding for latency on a fast link; measured: coded restore is faster")
               for c in S.contradictions(ours, seed))
    memory = T.recommend(m, 8192, 5.0, "memory", "bf16")
    assert "seed: FP8 + coding 6–8× under FP16; measured fp8+coding 11.4× (1.4 vs 16 bits/scalar)" in \
        S.contradictions(memory, S.seed_preset(8192, 5.0, "memory"))
    assert S.contradictions(S.seed_preset(8192, 5.0, "memory"), S.seed_preset(8192, 5.0, "memory")) == []


def test_comparison_rows():
    m = synthetic()
    ours = T.recommend(m, 8192, 1.0, "latency", "bf16")
    rows = S.comparison_rows(ours, S.seed_preset(8192, 1.0, "latency"))
    assert [r["choice"] for r in rows] == ["KV tier", "coding", "W", "γ"]
    assert rows[2]["seed"] == "1024–2048" and rows[3]["measured"] == "0" and rows[3]["seed"] == "4–6"
    assert all(r["why"] for r in rows)


# -- from the store -----------------------------------------------------------------------------------
def test_tune_reads_the_newest_measurement_of_the_target_and_tier():
    with Store(":memory:") as st:
        with pytest.raises(ValueError) as e:
            T.tune(st, None, "bf16", 4096, 1.0, "latency")
        assert str(e.value) == ("no KV measurements for SmolLM2-135M-Instruct yet: run `python -m engine bench kv` "
                                "(or press Measure on the KV & prefetch page)")
        old = synthetic()
        _store(st, old)
        new = synthetic()
        new["acceptance"][0]["tokens_per_s"] = {"ar": 10.0, "fixed:2": 30.0}  # bf16/native: now γ 2 pays
        newest = _store(st, new)
        _store(st, synthetic(), target="other-model")
        ours, seed, contra = T.tune(st, "embedded", "bf16", 4096, 1.0, "latency")
        assert ours.figures["measurement_id"] == newest and (ours.gamma_lo, ours.gamma_hi) == (2, 2)
        assert seed.source == "seed" and not ours.notes
        ours, _, _ = T.tune(st, None, "fp32", 4096, 1.0, "latency")  # no fp32 measurement: the newest, noted
        assert ours.notes[0] == "no KV measurement of SmolLM2-135M-Instruct at fp32: using the newest at bf16"
        assert ours.figures["target_tier"] == "fp32"  # γ still read at fp32 from the acceptance entries
        with pytest.raises(ValueError, match="context must be"):  # inputs are checked before the store
            T.tune(st, None, "bf16", 0, 1.0, "latency")


# -- the CLI -------------------------------------------------------------------------------------
def test_cli_tune_json_and_text(db, capsys):
    from engine.cli.main import main

    assert main(["tune", "--context", "8192", "--link-gbit-s", "1", "--goal", "memory", "--db", str(db), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ours"]["kv_tier"], out["ours"]["coded"], out["seed"]["kv_tier"]) == ("fp8", True, "fp8")
    assert out["ours"]["window"] <= 8192 and out["measurement"]["target"] == TARGET
    assert [r["choice"] for r in out["table"]] == ["KV tier", "coding", "W", "γ"]
    assert any("11.4×" in c for c in out["contradictions"])
    assert main(["tune", "--context", "8192", "--link-gbit-s", "1", "--goal", "latency", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].split() == ["choice", "measured", "seed", "why"]
    assert "speculation does not pay at bf16/native" in text and "contradictions with the seed:" in text


@pytest.mark.parametrize("args,needle", [
    (["--context", "0", "--link-gbit-s", "1", "--goal", "memory"], "context must be from 1 to 4194304 tokens, got 0"),
    (["--context", "x", "--link-gbit-s", "1", "--goal", "memory"], "argument --context: invalid int value: 'x'"),
    (["--context", "2048", "--link-gbit-s", "0", "--goal", "memory"], "link bandwidth must be > 0"),
    (["--context", "2048", "--link-gbit-s", "1", "--goal", "speed"], "unknown goal 'speed'"),
    (["--context", "2048", "--link-gbit-s", "1"], "required: --goal"),
    (["--context", "2048", "--link-gbit-s", "1", "--goal", "memory", "--target-tier", "q9"], "unknown tier(s) q9"),
    (["--context", "2048", "--link-gbit-s", "1", "--goal", "memory", "--target", "nope"],
     "no KV measurements for nope yet: run `python -m engine bench kv`"),
])
def test_cli_tune_bad_input_is_one_line_exit_2(db, args, needle, capsys):
    from engine.cli.main import main

    rc = main(["tune", *args, "--db", str(db)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_cli_tune_without_a_database_file(tmp_path, capsys):
    from engine.cli.main import main

    missing = tmp_path / "none.duckdb"
    assert main(["tune", "--context", "2048", "--link-gbit-s", "1", "--goal", "memory", "--db", str(missing)]) == 2
    assert "no KV measurements for SmolLM2-135M-Instruct yet" in capsys.readouterr().err and not missing.exists()


# -- measure_kv: engine/service/kv/measure.py imported lazily -----------------------------------------
MEASURE = "engine.service.kv.measure"


def test_measure_kv_calls_the_measurement_and_reports_an_import_failure(tmp_path, monkeypatch):
    from engine.service import latest_kv_measurement, measure_kv

    monkeypatch.setitem(sys.modules, MEASURE, None)  # an import that fails
    with pytest.raises(ValueError) as e:
        measure_kv(str(tmp_path / "kv.duckdb"))
    assert str(e.value).startswith("cannot load the KV benchmark (engine/service/kv/measure.py): ")
    assert "\n" not in str(e.value)

    calls = []
    monkeypatch.setitem(sys.modules, MEASURE, _fake_measure(calls))
    db = str(tmp_path / "kv.duckdb")
    assert measure_kv(db) == 0
    assert calls == [KVOptions.quick(db=db)] and calls[0].acceptance_tiers == []
    row, notes = latest_kv_measurement(db, None)
    assert row["result"]["window"] == 512 and notes == []
    monkeypatch.setitem(sys.modules, MEASURE, types.ModuleType(MEASURE))
    with pytest.raises(ValueError, match=r"cannot load the KV benchmark .*cannot import name '(KVOptions|run)'"):
        measure_kv(db)


def _fake_measure(calls: list) -> types.ModuleType:
    """A stand-in for kv/measure.py: stores the synthetic measurement where the options' db says."""
    mod = types.ModuleType(MEASURE)

    def run(opts: KVOptions) -> int:
        calls.append(opts)
        with Store(opts.db) as st:
            _store(st, synthetic())
        return 0

    mod.run, mod.KVOptions = run, KVOptions
    return mod


# -- the KV & prefetch page -----------------------------------------------------------------------------
@pytest.fixture
def page_env(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "ui.duckdb"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECLAB_DB", str(path))
    monkeypatch.delenv("SPECLAB_TARGET", raising=False)
    monkeypatch.delenv("SPECLAB_DRAFT", raising=False)
    return path


def _page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.switch_page("views/kv.py").run()
    return at


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def test_page_on_a_fresh_database_shows_the_controls_and_the_seed_preset_beside_measure(page_env, monkeypatch):
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    assert at.title[0].value == "KV & prefetch"
    assert at.sidebar.text_input(key="speclab_db").value == str(page_env)  # app.py ran: navigation and sidebar
    assert not page_env.exists()  # nothing measured, nothing stored: the page only read
    # Every control at once, at the defaults (bench kv's own, native KV, fp32 as on every other page) ...
    assert at.selectbox(key="kv_tier").value == "native" and at.toggle(key="kv_coded").value is True
    assert at.selectbox(key="kv_predictor").value == "q8_0" and at.selectbox(key="kv_window").value == 512
    assert at.number_input(key="kv_context").value == 2048 and at.select_slider(key="kv_link").value == 1
    assert at.radio(key="kv_goal").value == "latency" and at.selectbox(key="kv_target_tier").value == "fp32"
    # ... the measurement offered beside them, saying what the quick run measures ...
    assert len(at.info) == 1 and "No KV measurements for SmolLM2-135M-Instruct" in at.info[0].value
    assert "python -m engine bench kv" in at.info[0].value and "no acceptance" in at.info[0].value
    assert [b.label for b in at.button] == ["Measure now (about 5 minutes)"]
    # ... and the seed preset's recommendation for them.
    (seed,) = (df.value for df in at.dataframe)
    assert list(seed.columns) == ["choice", "seed", "why"] and list(seed["choice"]) == ["KV tier", "coding", "W", "γ"]
    assert list(seed["seed"]) == ["native", "on", "512–1024", "2–4"]  # latency over a 1 Gbit/s (slow) link
    assert not at.get("plotly_chart")

    at.radio(key="kv_goal").set_value("memory").run()  # the controls work before any measurement
    assert not at.exception and not _errors(at)
    assert at.dataframe[0].value.loc[0, "seed"] == "fp8"
    at.number_input(key="kv_context").set_value(10**9).run()
    assert not at.exception and _errors(at) == ["context must be from 1 to 4194304 tokens, got 1000000000"]
    at.number_input(key="kv_context").set_value(2048).run()

    monkeypatch.setitem(sys.modules, MEASURE, None)  # the measurement cannot be imported: one line
    at.button(key="kv_measure").click().run()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and errors[0].startswith("cannot load the KV benchmark") and "\n" not in errors[0]
    assert at.selectbox(key="kv_tier")  # the controls stay

    calls: list = []
    monkeypatch.setitem(sys.modules, MEASURE, _fake_measure(calls))
    at.button(key="kv_measure").click().run()
    assert not at.exception and not _errors(at), _errors(at)
    assert calls == [KVOptions.quick(db=str(page_env))]
    assert not at.info and not at.button and len(at.dataframe) == 3  # measured: the page now shows it


def test_the_spinner_promises_only_what_the_quick_run_measures():
    from bench.kv import parse
    from engine.service.kv.actions import MEASURE_KV_WHAT

    quick = parse(["--quick", "--db", ""])
    assert quick.acceptance_tiers == [] and quick.target_tier == "bf16"
    assert "no acceptance" in MEASURE_KV_WHAT[True] and "bf16" in MEASURE_KV_WHAT[True]
    assert "acceptance at fp32 and bf16" in MEASURE_KV_WHAT[False]
    assert parse(["--db", ""]).acceptance_tiers == ["fp32", "bf16"]


def test_page_shows_the_measurement_and_the_recommendation(page_env):
    with Store(page_env) as st:
        _store(st, synthetic())
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    assert not at.info and not at.button
    assert len(at.get("plotly_chart")) == 3  # restore vs raw, vs W, vs context
    bits, acceptance, table = (df.value for df in at.dataframe)
    assert list(bits["KV tier"]) == list(KV_TIERS) and bits["coded ×"].iloc[1] == pytest.approx(16 / 1.4)
    assert len(acceptance) == 6 and set(acceptance["kv_tier"]) == set(KV_TIERS)
    assert list(table.columns) == ["choice", "measured", "seed", "why"]
    assert list(table["choice"]) == ["KV tier", "coding", "W", "γ"]
    # Acceptance at fp32 by default, the tier every other page starts at (the KV was coded at bf16).
    assert at.selectbox(key="kv_target_tier").options == ["fp32", "bf16"]
    assert at.selectbox(key="kv_target_tier").value == "fp32"
    assert any("the KV coded with the target at bf16" in c.value and "acceptance measured at: fp32, bf16" in c.value
               for c in at.caption)
    assert "speculation does not pay" not in " ".join(md.value for md in at.markdown)  # fixed:4 wins at fp32
    at.selectbox(key="kv_target_tier").set_value("bf16").run()
    assert "speculation does not pay" in " ".join(md.value for md in at.markdown)

    at.radio(key="kv_goal").set_value("memory").run()
    assert not at.exception and not _errors(at)
    table = at.dataframe[2].value
    assert table.loc[table["choice"] == "KV tier", "measured"].item() == "fp8"
    at.selectbox(key="kv_predictor").set_value("int8").run()
    assert not at.exception and not _errors(at)
    assert at.dataframe[0].value["coded bits"].iloc[1] == pytest.approx(1.7)


def test_page_invalid_inputs_show_a_message_not_an_exception(page_env):
    with Store(page_env) as st:
        _store(st, synthetic())
    at = _page()
    at.number_input(key="kv_context").set_value(10**9).run()
    assert not at.exception
    errors = _errors(at)
    assert len(errors) == 1 and errors[0] == "context must be from 1 to 4194304 tokens, got 1000000000"

    at.number_input(key="kv_context").set_value(300).run()  # W 512 > 300 tokens: said, and one window used
    assert not at.exception and not _errors(at)
    assert any("W 512 exceeds the context (300 tokens): one window of 300" in c.value for c in at.caption)


def test_page_says_what_a_partial_measurement_lacks(page_env):
    m = synthetic()
    for key in ("by_window", "by_context", "restore"):
        m.pop(key)
    with Store(page_env) as st:
        _store(st, copy.deepcopy(m))
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    captions = " ".join(c.value for c in at.caption)
    assert "Not in this measurement: restore, by_window, by_context" in captions
    assert "No restore sweep stored." in captions and not at.get("plotly_chart")


# -- issue 48: the page's figures -----------------------------------------------------------------------
def _spec(at: AppTest, i: int) -> dict:
    return json.loads(at.get("plotly_chart")[i].proto.spec)


def test_a_quick_measurement_says_where_acceptance_was_measured_and_where_not(page_env):
    m = synthetic()
    m["acceptance"] = []  # the quick run's: no acceptance at any tier
    with Store(page_env) as st:
        _store(st, m)
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    assert at.selectbox(key="kv_target_tier").value == "fp32"
    captions = [c.value for c in at.caption]
    assert any(c.startswith("No acceptance in this measurement: the KV was coded with the target at bf16, and the "
                            "quick run (the page's Measure) skips acceptance") for c in captions)
    assert len(at.dataframe) == 2  # sizes and the recommendation: no empty acceptance table

    m = synthetic()
    m["acceptance"] = [r for r in m["acceptance"] if r["target_tier"] == "bf16"]
    assert F.acceptance_note(m, "fp32") == ("No acceptance at fp32 in this measurement, only at bf16 (the KV coded at "
                                            "bf16); `python -m engine bench kv --acceptance-tiers fp32` measures it.")
    assert F.acceptance_note(m, "bf16") is None and F.acceptance_tiers(m) == ["bf16"]


def test_code_once_times_the_encode_without_its_own_predictor(monkeypatch):
    """Issue 48's Encode 2.36e+10 MB/s beside a decode of 21.9: the encode's wall time less the
    *restore's* μ seconds, which can exceed a fast encode's whole time, floored at 1e-9 s: 23.6 MB
    of bf16 KV / 1e-9 s = 2.36e10 MB/s. The encode is now timed less its own μ calls."""
    import time

    import engine.runtime.kv.offload as O
    from engine.service.kv import measure as kv_measure

    raw = 1_000_000

    class Mu:
        tier, read = "native", 0

        def next(self, ids):
            time.sleep(0.05)  # the predictor, during the encode
            return ids

    class Off:
        raw_bytes, stored_bytes, sizes = raw, raw // 4, [raw // 4]

    def offload(kv, ids, tier, slow, name, window, codec, mu):
        mu.next(ids)
        time.sleep(0.01)  # the range coder
        return Off()

    def restore(off, slow, codec, mu, timing):
        timing.mu.append(0.2)  # the restore's μ beside the fetch thread: longer than the whole encode
        timing.decode.append(0.04)
        return "kv"

    kit = types.SimpleNamespace(mu=lambda tier: Mu(), codec=lambda tier: object())
    monkeypatch.setattr(O, "offload", offload)
    monkeypatch.setattr(O, "restore", restore)
    monkeypatch.setattr(O, "tier_kv", lambda kv, tier: types.SimpleNamespace(equals=lambda other: True,
                                                                              codes=types.SimpleNamespace(size=raw)))
    r = kv_measure.code_once("kv", [1, 2, 3], "native", kit, 3)
    assert r["encode_mu_s"] >= 0.05 and 0.01 <= r["encode_s"] < 0.05
    assert 1 < r["encode_mb_s"] <= raw / 0.01 / 1e6  # ≤ 100 MB/s, the coder's own time; was 1e15
    assert r["decode_mb_s"] == pytest.approx(raw / 0.04 / 1e6)


def test_page_does_not_show_an_encode_rate_no_clock_could_time(page_env):
    m = synthetic()
    nbytes = F.raw_bytes(m)  # 2048 tokens × 11520 scalars × 2 bytes
    m["encode_mb_s"] = m["predictors"]["q8_0"]["encode_mb_s"] = nbytes / 1e-9 / 1e6  # the old floor's figure
    assert F.speeds(synthetic())["encode_mb_s"] == 40.0 and F.speeds(m) == {"encode_mb_s": None, "decode_mb_s": 24.0}
    with Store(page_env) as st:
        _store(st, m)
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    metrics = {x.label: x.value for x in at.metric}
    assert metrics["Encode MB/s"] == "—" and metrics["Decode MB/s"] == "24"
    assert any(c.value.startswith("Encode MB/s not shown: 4.72e+10 MB/s would mean the 4.72e+07 bytes took "
                                  "under 1 µs, which no clock timed") for c in at.caption)


def test_chart_labels_sit_on_the_lines_they_name(page_env):
    """On a log x axis plotly reads an annotation's x as log10(x) but a line's as x: each label is
    placed at log10 of its line."""
    with Store(page_env) as st:
        _store(st, synthetic())
    at = _page()
    spec = _spec(at, 0)  # restore vs raw
    lines = sorted(sh["x0"] for sh in spec["layout"]["shapes"])
    labels = {a["text"]: a["x"] for a in spec["layout"]["annotations"]}
    assert lines == [1, 6.1] and set(labels) == {"1 Gbit/s", "break-even 6.1"}
    assert labels["1 Gbit/s"] == pytest.approx(math.log10(1))
    assert labels["break-even 6.1"] == pytest.approx(math.log10(6.1))
    assert spec["layout"]["xaxis"]["type"] == "log"


def test_a_flat_ratio_gets_a_sensible_axis_and_its_value_in_words(page_env):
    m = synthetic()
    for r in m["by_window"]:  # W does not move the ratio (the README's 4.651 bits at every W)
        r["native_bits"], r["fp8_bits_coded"] = 4.6214, 1.4
    m["by_window"][2]["native_bits"] = 4.62141
    with Store(page_env) as st:
        _store(st, m)
    at = _page()
    assert not at.exception and not _errors(at), _errors(at)
    spec = _spec(at, 1)  # ratio and throughput vs W
    ratio = 16 / 4.6214
    lo, hi = spec["layout"]["yaxis"]["range"]
    assert lo == 0 and hi == pytest.approx((16 / 1.4) * 1.15)  # from 0, not 3.462–3.46206
    assert spec["layout"]["yaxis2"]["range"][0] == 0
    assert any(c.value == f"native coded: {ratio:.3g}× at every W; fp8 coded: {16 / 1.4:.3g}× at every W"
               for c in at.caption)
    assert F.axis_range([3.462, 3.46206]) == pytest.approx([0.0, 3.46206 * 1.15])
    assert F.axis_range([None, float("nan")]) is None and F.axis_range([0.0]) == [0.0, 1.0]
    assert F.flat_series([{"a": 3.462}, {"a": 3.46206}, {"a": None}], ["a"]) == {"a": pytest.approx(3.46203)}
    assert F.flat_series([{"a": 3.0}, {"a": 3.5}], ["a"]) == {}
