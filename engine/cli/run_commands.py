"""Commands that run one thing: generate, export, setup, import-speckv, divergence, distill, vocab, bench."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from pathlib import Path
from typing import Callable

from engine.base.flags import KV_TIER_ARG, add_model_args
from engine.base.helpers import csv_list
from engine.cli.parsing import COMMANDS, JSON_ARG, REPO_ROOT, command, load, open_or_fail, pairs, say
from engine.decode.policies import DEFAULT_POLICY, POLICY_EXAMPLES
from engine.service import SUFFIX_BUDGET


# -- generate and the one-off commands -------------------------------------------------------------
@command("generate", "generate once, stream the text, store the run",
         ("--prompt", dict(required=True)), ("--chat", dict(action="store_true", help="apply the chat template")),
         ("--policy", dict(default="fixed:4", help=f"one of {', '.join(POLICY_EXAMPLES)}")),
         ("--max-new-tokens", dict(type=int, default=128)), ("--temperature", dict(type=float, default=0.0)),
         ("--top-p", dict(type=float, default=1.0)), ("--seed", dict(type=int, default=None)), KV_TIER_ARG,
         ("--task", dict(default=None, help="label stored with the run (code, math, …)")),
         ("--no-reuse", dict(action="store_true", help="recompute the whole prompt: no cross-request prefix KV")),
         ("--prefix-budget", dict(type=float, default=512.0, help="prefix cache budget in MiB")),
         # 2048: prefix.disk.DEFAULT_BUDGET_MIB (a literal here: the CLI starts without torch)
         ("--prefix-disk-budget", dict(type=float, default=2048.0, metavar="MIB", help="budget of the prefix "
                                       "cache's disk tier, which later runs (other processes) reuse; least recently "
                                       "used entries go first")),
         ("--prefix-dir", dict(default=None, metavar="DIR", help="the disk tier's folder (default: prefix-kv in the "
                               "model cache, $SPECLAB_CACHE or ~/.cache/speclab)")),
         ("--suffix-budget", dict(type=int, default=SUFFIX_BUDGET, help="tokens of earlier outputs (the runs "
                                  "stored in --db for this target, newest first) the suffix proposer draws from")),
         ("--json", dict(action="store_true", help="print one JSON object instead of the text")),
         ("--config", dict(default=None, help="a SpecLab config (`export --format json|yaml`): it supplies the "
                           "models, tiers, policy, sampling and reuse; a flag set to other than its default "
                           "overrides it")),
         models=True, db="DuckDB file for the run; '' stores nothing")
def cmd_generate(a: argparse.Namespace) -> int:
    from engine.oracles.suffix import check_budget
    from engine.runtime.models import pair_device
    from engine.runtime.prefix.cache import PrefixCache
    from engine.runtime.prefix.disk import mib_to_bytes
    from engine.service.generation import Request, check, keep, open_generation, suffix_history

    if a.config:
        _apply_config(a, _tuned(a, "generate"))
    req = Request(a.prompt, a.policy, a.chat, a.task, a.max_new_tokens, a.temperature, a.top_p, a.seed,
                  a.kv_tier, reuse=not a.no_reuse)
    check(req, a.engine)  # before loading models: a typo should fail in milliseconds
    prefix = PrefixCache(int(a.prefix_budget * 2**20))  # a budget ≤ 0 fails here, before any model loads
    disk_budget = mib_to_bytes(a.prefix_disk_budget, "--prefix-disk-budget")  # likewise
    check_budget(a.suffix_budget, "--suffix-budget")
    open_or_fail(a.db)
    pair = load(a, a.target_tier, progress=lambda m: None)
    # one run a process: only the disk tier can hand this run an earlier run's prefix (torch KV only)
    if not a.no_reuse and pair.engine == "torch":
        prefix.disk = _prefix_disk(pair, a.prefix_dir, disk_budget)
    # speckv/rakv: costs and controller; a missing cost table is probed in seconds (measured after the run)
    gen = open_generation(pair, req, a.db, prefix=prefix, say=say, measure=False)
    if "suffix" in gen.proposers:  # read only where it is used: one process, one run
        gen.history = suffix_history(a.db, pair, a.suffix_budget)
    shown = ""
    for _ in gen:
        if not a.json:  # stream: print what the new tokens add to the decoded text
            text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    kept = keep(gen, req, a.db)
    row, steps, run_id, cfg, policy = kept.row, kept.steps, kept.run_id, gen.cfg, gen.policy
    if kept.staged:
        say(f"warning: {kept.note}")
    s = gen.summary
    costs = policy.costs.describe() if getattr(policy, "costs", None) is not None else None
    if a.json:
        print(json.dumps(dict(
            text=row["output"], token_ids=gen.token_ids, tokens_per_s=s.tokens_per_s,
            ttft_ms=s.ttft_ms, mean_accepted=s.mean_accepted, acceptance_rate=s.acceptance_rate,
            tokens_per_step=s.tokens_per_step, n_tokens=s.n_tokens, n_steps=s.n_steps,
            stop_reason=s.stop_reason, policy=policy.name, target=pair.target_name,
            draft=pair.draft_name, target_tier=pair.target_tier, draft_tier=pair.draft_tier,
            kv_tier=cfg.kv_tier, kv_bytes_per_token=gen.kv_bytes_per_token,
            device=pair_device(pair), seed=gen.seed, run_id=run_id, reused_tokens=s.reused_tokens,
            prefix_hit=s.prefix_hit, costs=costs, steps=steps)))
    else:
        rate = "–" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        say(f"\n[{policy.name} · {pair.target_tier} · KV {cfg.kv_tier} {gen.kv_bytes_per_token / 1024:.1f} KiB/token · "
             f"{s.n_tokens} tokens · {s.tokens_per_s:.1f} tok/s · "
             f"TTFT {s.ttft_ms:.0f} ms · {s.tokens_per_step:.2f} tok/step · acceptance {rate} · "
             f"{s.stop_reason}{f' · costs: {costs}' if costs else ''}{f' · run {run_id}' if run_id else ''}]")
    if costs is not None and a.db:
        _measure_costs_after(a.db, pair, req, len(gen.prompt_ids))
    return 0


def _measure_costs_after(db: str, pair, req, n_prompt: int) -> None:
    """After a run that read probed costs (or a table short of the contexts it reached): the table
    measured and stored now, for the runs after it; a busy machine leaves it for a later run."""
    from engine.lab.timing import MachineBusy
    from engine.service.costs.tables import measure_missing, reach

    try:
        table = measure_missing(db, pair, req.kv_tier, reach(n_prompt, req.max_new_tokens), say)
    except MachineBusy as e:
        say(f"warning: {e}")
        return
    if table is not None:
        say(f"cost table stored ({table.describe()})")


def _prefix_disk(pair, folder: str | None, budget: int):
    """The prefix cache's disk tier for `pair`, in `folder` (default: the model cache's prefix-kv)."""
    from engine.runtime.prefix.disk import PrefixDisk, default_folder, pair_identity

    return PrefixDisk(Path(folder) if folder else default_folder(), budget, pair_identity(pair), pair.device, say)


# -- tuned configurations: --config and export ---------------------------------------------------
# (flag dest, TunedConfig field, flag value → field value) of the flags a config can supply.
# The precedence of a file and flags is tuned_config.with_flags'.
_TUNED_FLAGS: list[tuple[str, str, Callable]] = [
    ("target", "target", lambda v: v or "embedded"), ("draft", "draft", lambda v: v or None),
    ("engine", "engine", str), ("target_tier", "target_tier", lambda v: v), ("draft_tier", "draft_tier", lambda v: v),
    ("kv_tier", "kv_tier", str),
    ("policy", "policy", str), ("controller_version", "controller_version", lambda v: v),
    ("gamma_min", "gamma_min", lambda v: v), ("gamma_max", "gamma_max", lambda v: v),
    ("kv_window", "kv_window", lambda v: v), ("kv_coded", "kv_coded", bool), ("no_reuse", "reuse", lambda v: not v),
    ("prefix_budget", "prefix_budget_mib", float), ("max_new_tokens", "max_new_tokens", int),
    ("temperature", "temperature", float), ("top_p", "top_p", float), ("seed", "seed", lambda v: v),
]
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
    than their defaults, or the flags alone (the rules: tuned_config.with_flags)."""
    from engine.service.export.tuned_config import with_flags

    defaults = _flag_defaults(name)
    flags = [(dest, key, conv) for dest, key, conv in _TUNED_FLAGS if hasattr(a, dest)]
    given = {key: conv(getattr(a, dest)) for dest, key, conv in flags if getattr(a, dest) != defaults.get_default(dest)}
    return with_flags(a.config, given, {key: conv(getattr(a, dest)) for dest, key, conv in flags})


def _apply_config(a: argparse.Namespace, cfg) -> None:
    """Puts a TunedConfig's values into `generate`'s arguments (the controller version pinned)."""
    a.target = None if cfg.target == "embedded" else cfg.target
    a.draft, a.target_tier, a.draft_tier, a.kv_tier = cfg.draft, cfg.target_tier, cfg.draft_tier, cfg.kv_tier
    a.engine = cfg.engine
    a.policy, a.max_new_tokens, a.temperature, a.top_p = cfg.pinned_policy(), cfg.max_new_tokens, cfg.temperature, cfg.top_p
    a.seed, a.no_reuse, a.prefix_budget = cfg.seed, not cfg.reuse, cfg.prefix_budget_mib


CONFIG_SUFFIXES = (".json", ".yaml", ".yml")  # `export --out FILE` with one of these: the config alone


@command("export", "export a tuned configuration: SpecLab JSON/YAML (`generate --config` reads it), Hugging Face "
         "generate kwargs or a vLLM engine config; stored with a version per name. --out DIR writes a "
         "self-contained directory (the config beside the draft it names, as a model that engine loads)",
         ("--config", dict(default=None, help="a SpecLab config to start from; flags set to other than their "
                           "defaults override it")),
         ("--format", dict(default="json", choices=("json", "yaml", "hf", "vllm", "llamacpp", "tree"))),
         ("--out", dict(default=None, metavar="DIR|FILE", help="DIR: a self-contained export directory (the config "
                        "in the engine's own form, the draft as a model it loads, a manifest of checksums); "
                        "FILE.json/.yaml: the config text alone")),
         ("--check", dict(default=None, metavar="DIR", help="check an export directory (every file as written, the "
                          "draft's vocabulary against the target's, --engine-version) and say what it holds")),
         ("--engine-version", dict(default=None, help="with --check: the release of the engine that will load it")),
         ("--speculators", dict(default=None, help=argparse.SUPPRESS)),
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
    from engine.service.export.formats import render
    from engine.service.export.tuned_config import default_name

    if a.speculators:
        raise ValueError("export --speculators is gone: vLLM loads none of SpecLab's layouts as a speculators type; "
                         "`export --format vllm --out DIR` writes the draft as a model vLLM loads (draft_model)")
    if a.check:
        return _check_export(a.check, a.engine_version)
    cfg = _tuned(a, "export")
    name = (a.name or "").strip() or default_name(cfg)
    directory = a.out is not None and Path(a.out).suffix.lower() not in CONFIG_SUFFIXES
    made_by = f"python -m engine export --format {a.format} --policy {cfg.policy} --out {a.out}"
    if directory and a.format == "llamacpp":
        from engine.service.export.llamacpp import llamacpp_summary, write_llamacpp_export

        written = llamacpp_summary(a.out, write_llamacpp_export(cfg, a.out, made_by))
    elif directory:
        from engine.service.export.model_dir import summary, write_export_dir

        written = summary(a.out, write_export_dir(cfg, a.format, a.out, made_by=made_by))
    if a.db:
        name, version, text = save_export(a.db, cfg, a.format, name)
        say(f"saved as {name} v{version} in {a.db}")
    else:
        text = render(cfg, a.format)
    if directory:
        print(written)
    elif a.out:
        try:
            Path(a.out).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {a.out}: {e.strerror or e}") from None
        say(f"wrote {a.format} export {name} to {a.out}")
    else:
        print(text, end="")
    return 0


def _check_export(path: str, engine_version: str | None) -> int:
    """`export --check DIR`: one line naming what the directory holds, or its first problem."""
    from engine.service.export.model_dir import check_export_dir, summary

    print(summary(path, check_export_dir(path, engine_version)))
    return 0


@command("setup", "convert the embedded model's GGUF to a local safetensors cache, once")
def cmd_setup(a: argparse.Namespace) -> int:
    from engine.base.names import EMBEDDED_LABEL
    from engine.runtime.embedded import embedded_dir

    print(f"embedded model {EMBEDDED_LABEL}: {embedded_dir()}")
    return 0


@command("import-speckv", "import SpecKV's phase-2 step CSV as runs (source speckv)",
         ("path", dict(help="phase2_step_results.csv")), JSON_ARG, db="DuckDB file to import into")
def cmd_import_speckv(a: argparse.Namespace) -> int:
    from engine.datasets.speckv_csv import import_speckv
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

    if a.engine != "torch":
        raise ValueError("divergence measures logit distances on the torch engine; on llama.cpp `bench peers` "
                         "counts the prompts whose output differs from its own plain decoding")
    tiers = parse_tiers(a.tiers)
    make_policy(a.policy)
    prompts = [p for _, p in bench_prompts(a.prompts_per_task)]
    results = []
    for pair in pairs(a, tiers):
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
    {"draft": distill.run, "eagle": eagle_train.run}[a.kind](config(**given), progress=tqdm, say=say)
    return 0


@command("vocab", "rank the embedded model's tokens by frequency on real text (the reduced-vocabulary draft heads' "
         "engine/data/vocab_rank.safetensors)",
         ("--conversations", dict(type=int, default=4000, help="ShareGPT conversations counted (a subsample)")))
def cmd_vocab(a: argparse.Namespace) -> int:
    from engine.training import vocab

    if a.conversations < 0:
        raise ValueError(f"--conversations must be ≥ 0, got {a.conversations}")
    vocab.make(a.conversations, say=say)
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
