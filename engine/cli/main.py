"""`python -m engine <command>`: everything the workbench does, headless.

Parsing and printing only: each command is one call into engine/service.py or the module that
does the work."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from engine.base.helpers import csv_list, one_line
from engine.decode.costs import REPS
from engine.decode.policies import DEFAULT_POLICY, POLICY_EXAMPLES, split_policies
from engine.service import TRACE_POLICIES
from engine.service.options import (
    KV_TIER_ARG,
    KV_TIERS_ARG,
    add_db_arg,
    add_model_args,
    exact_verify,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TIERS_ARG = ("--tiers", dict(default="fp32", help="comma-separated target tiers"))
JSON_ARG = ("--json", dict(action="store_true", help="print JSON instead of text"))
PROMPTS_ARG = ("--prompts", dict(default="heldout", help="prompt set: heldout, bench or train"))


class UsageError(ValueError):
    """Bad command-line arguments (argparse's errors, made one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit; we want one line
        raise UsageError(f"{self.prog}: {message}")


# name → (help, the function, its arguments as (flag, add_argument kwargs), model args?, db help)
COMMANDS: dict[str, tuple[str, Callable, list, bool, str | None]] = {}


def command(name: str, help: str, *args: tuple, models: bool = False, db: str | None = None):
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable:
        COMMANDS[name] = (help, fn, list(args), models, db)
        return fn
    return register


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _load(a: argparse.Namespace, tier: str, progress: Callable[[str], None] = _say):
    from engine.runtime.models import load_pair

    return load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code, progress=progress,
                     exact_verify=exact_verify(a), eagle=getattr(a, "eagle", None))


def _pairs(a: argparse.Namespace, tiers: list[str]) -> Iterator:
    """The pair at each tier, loaded when the caller gets to it."""
    for tier in tiers:
        yield _load(a, tier)


def _bar(desc: str, unit: str = "run"):
    from tqdm import tqdm

    return tqdm(total=0, desc=desc, unit=unit, file=sys.stderr)


def _open_or_fail(db: str) -> None:
    """A corrupt or locked file fails now, not after minutes of work; released at once."""
    if db:
        from store import Store

        with Store(db, wait_s=0.0):
            pass


# -- generate and the one-off commands -------------------------------------------------------------
@command("generate", "generate once, stream the text, store the run",
         ("--prompt", dict(required=True)), ("--chat", dict(action="store_true", help="apply the chat template")),
         ("--policy", dict(default="fixed:4", help=f"one of {', '.join(POLICY_EXAMPLES)}")),
         ("--max-new-tokens", dict(type=int, default=128)), ("--temperature", dict(type=float, default=0.0)),
         ("--top-p", dict(type=float, default=1.0)), ("--seed", dict(type=int, default=None)), KV_TIER_ARG,
         ("--task", dict(default=None, help="label stored with the run (code, math, …)")),
         ("--no-reuse", dict(action="store_true", help="recompute the whole prompt: no cross-request prefix KV")),
         ("--prefix-budget", dict(type=float, default=512.0, help="prefix cache budget in MiB")),
         ("--json", dict(action="store_true", help="print one JSON object instead of the text")),
         ("--config", dict(default=None, help="a SpecLab config (`export --format json|yaml`): it supplies the "
                           "models, tiers, policy, sampling and reuse; a flag set to other than its default "
                           "overrides it")),
         models=True, db="DuckDB file for the run; '' stores nothing")
def cmd_generate(a: argparse.Namespace) -> int:
    from engine.runtime.prefix_cache import PrefixCache
    from engine.service.runs import Request, check, keep, open_generation

    if a.config:
        _apply_config(a, _tuned(a, "generate"))
    req = Request(a.prompt, a.policy, a.chat, a.task, a.max_new_tokens, a.temperature, a.top_p, a.seed,
                  a.kv_tier, reuse=not a.no_reuse)
    check(req)  # before loading models: a typo should fail in milliseconds
    prefix = PrefixCache(int(a.prefix_budget * 2**20))  # a budget ≤ 0 fails here, before any model loads
    _open_or_fail(a.db)
    pair = _load(a, a.target_tier, progress=lambda m: None)
    gen = open_generation(pair, req, a.db, prefix=prefix, say=_say)  # speckv/rakv: costs, controller
    shown = ""
    for _ in gen:
        if not a.json:  # stream: print what the new tokens add to the decoded text
            text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    kept = keep(gen, req, a.db)
    row, steps, run_id, cfg, policy = kept.row, kept.steps, kept.run_id, gen.cfg, gen.policy
    if kept.staged:
        _say(f"warning: {kept.note}")
    s = gen.summary
    if a.json:
        print(json.dumps(dict(
            text=row["output"], token_ids=gen.token_ids, tokens_per_s=s.tokens_per_s,
            ttft_ms=s.ttft_ms, mean_accepted=s.mean_accepted, acceptance_rate=s.acceptance_rate,
            tokens_per_step=s.tokens_per_step, n_tokens=s.n_tokens, n_steps=s.n_steps,
            stop_reason=s.stop_reason, policy=policy.name, target=pair.target_name,
            draft=pair.draft_name, target_tier=pair.target_tier, draft_tier=pair.draft_tier,
            kv_tier=cfg.kv_tier, kv_bytes_per_token=gen.kv_bytes_per_token,
            device=str(pair.device), seed=gen.seed, run_id=run_id, reused_tokens=s.reused_tokens,
            prefix_hit=s.prefix_hit, steps=steps)))
    else:
        rate = "–" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        _say(f"\n[{policy.name} · {pair.target_tier} · KV {cfg.kv_tier} {gen.kv_bytes_per_token / 1024:.1f} KiB/token · "
             f"{s.n_tokens} tokens · {s.tokens_per_s:.1f} tok/s · "
             f"TTFT {s.ttft_ms:.0f} ms · {s.tokens_per_step:.2f} tok/step · acceptance {rate} · "
             f"{s.stop_reason}{f' · run {run_id}' if run_id else ''}]")
    return 0


# -- tuned configurations: --config and export ---------------------------------------------------
# (flag dest, TunedConfig field, flag value → field value) of the flags a config can supply.
# Precedence: the config supplies every value; a flag whose value differs from its default
# overrides it (a flag at its default cannot be told from an absent one, so it keeps the file's).
_TUNED_FLAGS: list[tuple[str, str, Callable]] = [
    ("target", "target", lambda v: v or "embedded"), ("draft", "draft", lambda v: v or None),
    ("target_tier", "target_tier", str), ("draft_tier", "draft_tier", lambda v: v), ("kv_tier", "kv_tier", str),
    ("policy", "policy", str), ("controller_version", "controller_version", lambda v: v),
    ("gamma_min", "gamma_min", lambda v: v), ("gamma_max", "gamma_max", lambda v: v),
    ("kv_window", "kv_window", lambda v: v), ("kv_coded", "kv_coded", bool), ("no_reuse", "reuse", lambda v: not v),
    ("prefix_budget", "prefix_budget_mib", float), ("max_new_tokens", "max_new_tokens", int),
    ("temperature", "temperature", float), ("top_p", "top_p", float), ("seed", "seed", lambda v: v),
]
# Set from the policy unless given with it: a new policy brings its own γ range and controller.
_FOLLOW_POLICY = ("gamma_min", "gamma_max", "controller", "controller_version")


def _flag_defaults(name: str) -> argparse.ArgumentParser:
    """A parser holding command `name`'s flags, for their defaults (`get_default`)."""
    _, _, args, models, _ = COMMANDS[name]
    p = argparse.ArgumentParser(add_help=False)
    if models:
        add_model_args(p)
    for flag, kw in args:
        p.add_argument(flag, **{k: v for k, v in kw.items() if k != "required"})
    return p


def _tuned(a: argparse.Namespace, name: str):
    """The TunedConfig of command `name`: `--config`'s file overridden by the flags set to other
    than their defaults, or the flags alone."""
    from engine.service.export import from_dict, load_config

    defaults = _flag_defaults(name)
    flags = [(dest, key, conv) for dest, key, conv in _TUNED_FLAGS if hasattr(a, dest)]
    if not a.config:
        values = {key: conv(getattr(a, dest)) for dest, key, conv in flags}
        return from_dict({k: v for k, v in values.items() if v is not None}, "flags")
    base = load_config(a.config).to_dict()
    given = {key: conv(getattr(a, dest)) for dest, key, conv in flags if getattr(a, dest) != defaults.get_default(dest)}
    if "policy" in given and given["policy"] != base["policy"]:
        base.update({k: None for k in _FOLLOW_POLICY if k not in given})
    if not given:
        return from_dict(base, f"config {a.config}")
    return from_dict(dict(base, **given), f"config {a.config} with the flags given")


def _apply_config(a: argparse.Namespace, cfg) -> None:
    """Puts a TunedConfig's values into `generate`'s arguments (the controller version pinned)."""
    a.target = None if cfg.target == "embedded" else cfg.target
    a.draft, a.target_tier, a.draft_tier, a.kv_tier = cfg.draft, cfg.target_tier, cfg.draft_tier, cfg.kv_tier
    a.policy, a.max_new_tokens, a.temperature, a.top_p = cfg.pinned_policy(), cfg.max_new_tokens, cfg.temperature, cfg.top_p
    a.seed, a.no_reuse, a.prefix_budget = cfg.seed, not cfg.reuse, cfg.prefix_budget_mib


@command("export", "export a tuned configuration: SpecLab JSON/YAML (`generate --config` reads it), Hugging Face "
         "generate kwargs or a vLLM speculative_config; stored with a version per name",
         ("--config", dict(default=None, help="a SpecLab config to start from; flags set to other than their "
                           "defaults override it")),
         ("--format", dict(default="json", choices=("json", "yaml", "hf", "vllm"))),
         ("--out", dict(default=None, help="write the export to this file instead of printing it")),
         ("--name", dict(default=None, help="the stored export's name (default: target-policy)")),
         ("--policy", dict(default=DEFAULT_POLICY, help=f"one of {', '.join(POLICY_EXAMPLES)}")),
         ("--controller-version", dict(type=int, default=None, help="speckv*: the stored controller's version")),
         ("--gamma-min", dict(type=int, default=None, help="γ range (default: from the policy)")),
         ("--gamma-max", dict(type=int, default=None)), KV_TIER_ARG,
         ("--kv-window", dict(type=int, default=None, help="KV offload window W in tokens")),
         ("--kv-coded", dict(action="store_true", help="code offloaded KV windows")),
         ("--no-reuse", dict(action="store_true", help="no cross-request prefix KV")),
         ("--prefix-budget", dict(type=float, default=512.0, help="prefix cache budget in MiB")),
         ("--max-new-tokens", dict(type=int, default=128)), ("--temperature", dict(type=float, default=0.0)),
         ("--top-p", dict(type=float, default=1.0)), ("--seed", dict(type=int, default=None)),
         models=True, db="DuckDB file the export is stored in; '' stores nothing")
def cmd_export(a: argparse.Namespace) -> int:
    from engine.service import save_export
    from engine.service.export import default_name, render

    cfg = _tuned(a, "export")
    name = (a.name or "").strip() or default_name(cfg)
    if a.db:
        name, version, text = save_export(a.db, cfg, a.format, name)
        _say(f"saved as {name} v{version} in {a.db}")
    else:
        text = render(cfg, a.format)
    if a.out:
        try:
            Path(a.out).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {a.out}: {e.strerror or e}") from None
        _say(f"wrote {a.format} export {name} to {a.out}")
    else:
        print(text, end="")
    return 0


@command("setup", "convert the embedded model's GGUF to a local safetensors cache, once")
def cmd_setup(a: argparse.Namespace) -> int:
    from engine.runtime.models import EMBEDDED_LABEL, embedded_dir

    print(f"embedded model {EMBEDDED_LABEL}: {embedded_dir()}")
    return 0


@command("import-speckv", "import SpecKV's phase-2 step CSV as runs (source speckv)",
         ("path", dict(help="phase2_step_results.csv")), JSON_ARG, db="DuckDB file to import into")
def cmd_import_speckv(a: argparse.Namespace) -> int:
    from engine.datasets.speckv import import_speckv
    from store import Store

    if not os.path.isfile(a.path):  # before opening: a typo must not create an empty database
        raise ValueError(f"{a.path} does not exist or is not a file")
    with Store(a.db) as st:
        report = import_speckv(st, a.path)
    if a.json:
        print(json.dumps(dict(dataclasses.asdict(report), db=a.db)))
    else:
        print(f"imported {report.runs_added} runs ({report.steps} steps) from {report.path}"
              f" into {a.db}; {report.runs_skipped} already there")
    return 0


@command("divergence", "speculative vs plain greedy output, per target tier",
         ("--tiers", dict(default="fp32,bf16,int8,nf4", help="comma-separated target tiers")),
         ("--policy", dict(default="fixed:4")), ("--max-new-tokens", dict(type=int, default=64)),
         ("--prompts-per-task", dict(type=int, default=2)), JSON_ARG, models=True)
def cmd_divergence(a: argparse.Namespace) -> int:
    from engine.datasets.prompts import bench_prompts
    from engine.decode.policies import make_policy
    from engine.lab import divergence
    from engine.service import parse_tiers

    tiers = parse_tiers(a.tiers)
    make_policy(a.policy)
    prompts = [p for _, p in bench_prompts(a.prompts_per_task)]
    results = []
    for pair in _pairs(a, tiers):
        d = divergence.measure(pair, prompts, a.policy, a.max_new_tokens)
        results.append(dataclasses.asdict(d))
        if not a.json:
            print(f"{d.tier:>5}  {a.policy}: identical on {d.identical_fraction:.0%} of {d.prompts} prompts; "
                  f"first divergence {d.first_divergence} (of {a.max_new_tokens} tokens); with prefix reuse "
                  f"identical on {d.reuse_identical_fraction:.0%}, first divergence {d.reuse_first_divergence}")
    if a.json:
        print(json.dumps(results))
    return 0


def _distill_configs() -> dict[str, type]:
    """--kind → its config: a few target layers (draft) or a feature-level head (eagle)."""
    from engine.training.distill import DistillConfig
    from engine.training.eagle_distill import EagleDistillConfig

    return {"draft": DistillConfig, "eagle": EagleDistillConfig}


def _distill_args() -> list[tuple]:
    """--kind, and one flag per field of either kind's config, typed by the field's annotation."""
    kinds = {"int": int, "float": float, "bool": _bool, "list[int]": _int_list}
    flags = {f.name: ("--" + f.name.replace("_", "-"), dict(type=kinds.get(str(f.type).split(" ")[0], str), default=None))
             for cfg in _distill_configs().values() for f in dataclasses.fields(cfg)}
    kind = ("--kind", dict(default="draft", choices=tuple(_distill_configs()),
                           help="draft: target layers re-trained as a small model; eagle: a one-layer head on the "
                           "target's hidden states"))
    return [kind, *flags.values()]


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text.lower() in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


@command("distill", "make a draft (--kind draft) or an EAGLE head (--kind eagle) for a target by distillation (resumable)")
def cmd_distill(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.training import distill
    from engine.training import eagle_distill as eagle_train

    config = _distill_configs()[a.kind]
    names = {f.name for f in dataclasses.fields(config)}
    others = sorted({f.name for c in _distill_configs().values() for f in dataclasses.fields(c)} - names)
    wrong = [n for n in others if getattr(a, n) is not None]
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} is not an option of distill --kind {a.kind}")
    given = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    {"draft": distill.run, "eagle": eagle_train.run}[a.kind](config(**given), progress=tqdm, say=_say)
    return 0


@command("bench", "benchmarks against peers, run as in bench/", ("name", dict(help="a file bench/<name>.py")),
         ("args", dict(nargs=argparse.REMAINDER, help="passed on to the benchmark")))
def cmd_bench(a: argparse.Namespace) -> int:
    if not a.name.isidentifier():
        raise ValueError(f"unknown benchmark {a.name!r}")
    try:
        mod = importlib.import_module(f"bench.{a.name}")
    except ModuleNotFoundError:
        known = sorted(p.stem for p in (REPO_ROOT / "bench").glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"unknown benchmark {a.name!r}; known: {', '.join(known)}") from None
    return int(mod.main(a.args) or 0)


# -- measure, replay, learn ------------------------------------------------------------------------
@command("costs", "measure draft/verify costs per tier, KV tier and context (stored)", TIERS_ARG, KV_TIERS_ARG,
         ("--buckets", dict(default="64,256,512", help="context lengths to measure at")),
         ("--reps", dict(type=int, default=REPS, help="timed repetitions per point (after warm-up)")),
         ("--calibrate", dict(action="store_true", help="instead of measuring: scale the stored table to the "
                                                          "stored live steps of the pair (per k)")),
         JSON_ARG, models=True, db="DuckDB file")
def cmd_costs(a: argparse.Namespace) -> int:
    from engine.lab.profiling import measure_costs
    from engine.service import calibrate_costs, cost_key, parse_kv_tiers, parse_tiers
    from store import Store

    tiers, kv_tiers = parse_tiers(a.tiers), parse_kv_tiers(a.kv_tiers)
    try:
        buckets = tuple(int(b) for b in csv_list(a.buckets))
    except ValueError:
        raise ValueError(f"--buckets takes comma-separated context lengths, got {a.buckets!r}") from None
    if not buckets or min(buckets) < 1 or a.reps < 1:
        raise ValueError("--buckets needs positive context lengths and --reps ≥ 1")
    _open_or_fail(a.db)
    out = []
    for pair, kv_tier in ((pair, kv) for pair in _pairs(a, tiers) for kv in kv_tiers):
        if a.calibrate:
            with Store(a.db) as st:
                table = calibrate_costs(st, cost_key(pair, kv_tier))
        else:
            table = measure_costs(pair, buckets, a.reps, progress=_say, kv_tier=kv_tier)
            with Store(a.db) as st:
                st.add_costs(table.to_rows(a.reps))
        out.append(dict(table.key, buckets=table.buckets, draft_ms=table.draft_ms,
                        verify_ms=table.verify_ms, step_factor=table.step_factor, prefill_ms=table.prefill_ms,
                        fill_ms=table.fill_ms, cold_read_ms=table.cold_read_ms, warm_read_ms=table.warm_read_ms))
        if not a.json:
            print(f"{pair.target_tier}, KV {kv_tier}: draft {pair.draft_name} ({pair.draft_tier}) on {pair.device}")
            none = [None] * len(table.buckets)
            for b, d, v, p, c, w in zip(table.buckets, table.draft_ms, table.verify_ms, table.prefill_ms or none,
                                        table.cold_read_ms or none, table.warm_read_ms or none):
                reads = "" if None in (p, c, w) else f"  prefill {p:7.1f}  draft reads cold {c:6.1f}, warm {w:5.2f}/token"
                print(f"  ctx {b:5d}  draft {d:6.2f} ms/token  verify k=0..8 " + " ".join(f"{x:6.1f}" for x in v) + reads)
            if table.step_factor:
                print("  live / measured step time, k=0..8 " + " ".join(f"{x:6.3f}" for x in table.step_factor))
    if a.json:
        print(json.dumps(out))
    return 0


@command("trace", "acceptance traces along the target's greedy output (stored)", TIERS_ARG, KV_TIERS_ARG, PROMPTS_ARG,
         ("--per-task", dict(type=int, default=None, help="prompts per task (default: all)")),
         ("--max-new-tokens", dict(type=int, default=128)),
         ("--temperature", dict(type=float, default=None,
                                help="also store Σ min(p, q) per position at this sampling temperature")),
         models=True, db="DuckDB file")
def cmd_trace(a: argparse.Namespace) -> int:
    from engine.service import parse_kv_tiers, parse_tiers, prompt_set, trace_prompts
    from store import Store

    tiers, kv_tiers, prompts = parse_tiers(a.tiers), parse_kv_tiers(a.kv_tiers), prompt_set(a.prompts, a.per_task)
    if a.max_new_tokens < 2:
        raise ValueError("--max-new-tokens must be ≥ 2 for a trace to have a position")
    made = 0
    with Store(a.db) as st:  # one connection; each trace is committed as it is made
        for pair in _pairs(a, tiers):
            for kv_tier in kv_tiers:
                bar = _bar(f"trace {pair.target_tier}, KV {kv_tier}", "trace")
                made += trace_prompts(st, pair, prompts, a.max_new_tokens, a.temperature,
                                      on_start=lambda n: bar.reset(total=n), on_trace=lambda: bar.update(1),
                                      kv_tier=kv_tier)
                bar.close()
    _say(f"{made} traces stored in {a.db}")
    return 0


@command("whatif", "replay policies over stored traces with the stored cost tables",
         ("--policies", dict(default=TRACE_POLICIES)),
         ("--tiers", dict(default=None, help="only these target tiers")),
         ("--kv-tiers", dict(default=None, help="only traces made at these KV tiers (native, fp8, int8)")),
         ("--by", dict(default="task", choices=("task", "prompt"), help="rows per task or per prompt")),
         JSON_ARG, db="DuckDB file")
def cmd_whatif(a: argparse.Namespace) -> int:
    from engine.service import parse_kv_tiers, parse_tiers, replay_rows
    from store import Store

    kv_tiers = parse_kv_tiers(a.kv_tiers) if a.kv_tiers else None
    with Store(a.db, read_only=True) as st:
        rows = replay_rows(st, split_policies(a.policies), parse_tiers(a.tiers) if a.tiers else None, a.by, kv_tiers)
    if a.json:
        print(json.dumps(rows))
        return 0
    width = min(max(len(str(r[a.by])) for r in rows), 48) if a.by == "prompt" else 14
    print(f"{'tier':5} {'KV':6} {'policy':14} {a.by:{width}} {'prompts':>7} {'tok/step':>8} {'tok/s':>8}  self-scored gap")
    for r in rows:
        tps = f"{r['tokens_per_s']:8.1f}" if r["tokens_per_s"] else "       –"
        gap = f"{r['self_scored_gap']:+.1%}" if r["self_scored_gap"] is not None else ""
        print(f"{r['target_tier']:5} {r['kv_tier']:6} {r['policy']:14} {str(r[a.by])[:48]:{width}} {r['prompts']:7d} "
              f"{r['tokens_per_step']:8.2f} {tps}  {gap}")
    return 0


@command("retrain", "retrain the speckv controller from runs or traces in the store",
         ("--source", dict(default="traces", choices=("traces", "runs", "speckv"))),
         ("--protocol", dict(default=None, choices=("paper", "prompt"), help="split over rows (the paper's) or "
                             "over prompts (default: paper for speckv, else prompt)")),
         ("--sweep", dict(default=None, help="only runs of this profile sweep (source runs)")),
         ("--seed", dict(type=int, default=42)),
         ("--no-activate", dict(action="store_true", help="store it without making it the default")),
         JSON_ARG, db="DuckDB file")
def cmd_retrain(a: argparse.Namespace) -> int:
    from engine.service import retrain
    from store import Store

    with Store(a.db) as st:
        r = retrain(st, a.source, a.protocol, a.seed, a.sweep, activate=not a.no_activate)
    if a.json:
        print(json.dumps(r.to_dict()))
        return 0
    print(f"speckv v{r.version} ({r.source}, {r.protocol} split: {r.n_train} train / {r.n_test} test rows)\n"
          f"  MLP(16)  test corr {r.test_corr:.3f}  MSE {r.test_mse:.4f}  decision {r.decision_ms_median:.4f} ms (median)\n"
          f"  RF(100)  test corr {r.rf_test_corr:.3f}  MSE {r.rf_test_mse:.4f}  decision {r.rf_decision_ms_median:.3f} ms\n"
          f"  what-if ({r.whatif_kind}): {r.whatif_gain_vs_fixed4:+.1%} vs fixed:4, "
          f"{r.whatif_gain_vs_best_fixed:+.1%} vs the best fixed γ\n  {json.dumps(r.whatif)}")
    return 0


@command("profile", "sweep prompts × target tiers × KV tiers × policies live; every run and step stored", TIERS_ARG,
         KV_TIERS_ARG,
         ("--policies", dict(default="ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,speckv,rakv")), PROMPTS_ARG,
         ("--per-task", dict(type=int, default=2)), ("--max-new-tokens", dict(type=int, default=128)),
         ("--sweep", dict(default="default", help="sweep name: a rerun with the same name resumes it")),
         ("--json", dict(action="store_true", help="print the per-tier table as JSON")), models=True, db="DuckDB file")
def cmd_profile(a: argparse.Namespace) -> int:
    from engine.decode.policies import parse_policy
    from engine.lab.profiling import sweep_jobs
    from engine.service import (
        format_sweep,
        parse_kv_tiers,
        parse_tiers,
        profile,
        prompt_set,
        sweep_table,
    )
    from store import Store

    tiers, prompts, policies = parse_tiers(a.tiers), prompt_set(a.prompts, a.per_task), split_policies(a.policies)
    kv_tiers = parse_kv_tiers(a.kv_tiers)
    for spec in policies:
        parse_policy(spec)  # a typo fails before any model loads
    with Store(a.db) as st:  # one read-write connection for the sweep; each run committed as it finishes
        bar = _bar(f"profile {a.sweep}")
        try:
            profile(st, a.sweep, sweep_jobs(prompts, tiers, policies, kv_tiers), lambda tier: _load(a, tier), a.max_new_tokens,
                    on_start=lambda n: bar.reset(total=n), on_run=lambda: bar.update(1), say=_say)
        except KeyboardInterrupt:
            bar.close()
            _say(f"\ninterrupted: finished runs are stored; rerun with --sweep {a.sweep} to resume")
            return 130
        bar.close()
    with Store(a.db, read_only=True) as st:
        table = sweep_table(st.runs(sweep=a.sweep))
    print(json.dumps(table) if a.json else format_sweep(table))
    return 0


@command("tune", "recommend a KV tier, coding, W and γ from the stored `bench kv` measurement, beside the seed "
         "preset",
         ("--context", dict(type=int, required=True, help="context length in tokens")),
         ("--link-gbit-s", dict(type=float, required=True, help="bandwidth of the link the KV is restored over")),
         ("--goal", dict(required=True, help="latency or memory")),
         ("--target", dict(default=None, help="the measured target (default: the embedded model)")),
         ("--target-tier", dict(default=None, help="its weight tier (default: the newest measurement's)")),
         JSON_ARG, db="DuckDB file with the KV measurements")
def cmd_tune(a: argparse.Namespace) -> int:
    from engine.service import format_tune, tune_kv

    out = tune_kv(a.db, a.target, a.target_tier, a.context, a.link_gbit_s, a.goal)
    print(json.dumps(out) if a.json else format_tune(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help, fn, args, models, db) in COMMANDS.items():
        p = sub.add_parser(name, help=help)
        if models:
            add_model_args(p)
        for flag, kw in args + (_distill_args() if name == "distill" else []):
            p.add_argument(flag, **kw)
        if db:
            add_db_arg(p, db)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a command; user errors end as one line on stderr and exit 2, never a traceback."""
    from store import StoreError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as e:
        _say(f"error: interrupted{f' ({e})' if str(e) else ''}")
        return 130
    except (ValueError, StoreError) as e:  # user input: UsageError is a ValueError too
        _say(f"error: {one_line(e, limit=2000)}")
        return 2
    except Exception as e:  # the last line of defence: a bug, still reported on one line
        if os.environ.get("SPECLAB_DEBUG"):
            raise
        _say(f"error: {one_line(e, limit=2000)} (SPECLAB_DEBUG=1 shows the traceback)")
        return 1
