"""`python -m engine <command>`: everything the workbench does, headless."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from engine.models import EMBEDDED, TIERS
from engine.policies import POLICY_EXAMPLES

DEFAULT_DB = "speclab.duckdb"
REPO_ROOT = Path(__file__).resolve().parents[1]


class UsageError(ValueError):
    """Bad command-line arguments (argparse's errors, made one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit; we want one line
        raise UsageError(f"{self.prog}: {message}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help=f"HF id or local dir (default: {EMBEDDED})")
    p.add_argument("--draft", default=None, help="HF id or local dir (default: the target at nf4)")
    p.add_argument("--target-tier", default="fp32", choices=TIERS)
    p.add_argument("--draft-tier", default=None, choices=TIERS)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if present)")
    p.add_argument("--trust-remote-code", action="store_true", help="run a model repo's own code")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate once, stream the text, store the run")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    add_model_args(p)
    p.add_argument("--policy", default="fixed:4", help=f"one of {', '.join(POLICY_EXAMPLES)}")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--task", default=None, help="label stored with the run (code, math, …)")
    p.add_argument("--db", default=os.environ.get("SPECLAB_DB", DEFAULT_DB),
                   help="DuckDB file for the run; '' stores nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(func=cmd_generate)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against peers, run as in bench/")
    p.add_argument("name", help="benchmark name: a file bench/<name>.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    p.set_defaults(func=cmd_bench)


def _add_import_speckv(sub) -> None:
    p = sub.add_parser("import-speckv", help="import SpecKV's phase-2 step CSV as runs (source speckv)")
    p.add_argument("path", help="phase2_step_results.csv")
    p.add_argument("--db", default=DEFAULT_DB, help=f"DuckDB file to import into (default: {DEFAULT_DB})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_import_speckv)


def cmd_import_speckv(a: argparse.Namespace) -> int:
    from store import Store
    from store.speckv import import_speckv

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


def _add_setup(sub) -> None:
    p = sub.add_parser("setup", help="convert the embedded model's GGUF to a local safetensors cache, once")
    p.set_defaults(func=cmd_setup)


def cmd_setup(a: argparse.Namespace) -> int:
    from engine.models import EMBEDDED_LABEL, embedded_dir

    print(f"embedded model {EMBEDDED_LABEL}: {embedded_dir()}")
    return 0


def _add_divergence(sub) -> None:
    p = sub.add_parser("divergence", help="speculative vs plain greedy output, per target tier")
    add_model_args(p)
    p.add_argument("--tiers", default="fp32,bf16,int8,nf4", help="comma-separated target tiers")
    p.add_argument("--policy", default="fixed:4")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-per-task", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_divergence)


def cmd_divergence(a: argparse.Namespace) -> int:
    from engine import divergence
    from engine.models import load_pair
    from engine.policies import make_policy
    from engine.prompts import bench_prompts

    from engine.lab import parse_tiers

    tiers = parse_tiers(a.tiers)
    make_policy(a.policy)
    prompts = [p for _, p in bench_prompts(a.prompts_per_task)]
    results = []
    for tier in tiers:
        pair = load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code)
        d = divergence.measure(pair, prompts, a.policy, a.max_new_tokens)
        results.append(dataclasses.asdict(d))
        if not a.json:
            print(f"{tier:>5}  {a.policy}: identical on {d.identical_fraction:.0%} of {d.prompts} prompts; "
                  f"first divergence {d.first_divergence} (of {a.max_new_tokens} tokens)")
        del pair
    if a.json:
        print(json.dumps(results))
    return 0


def _add_distill(sub) -> None:
    from engine.distill import DistillConfig

    p = sub.add_parser("distill", help="make a draft for a target by distillation (resumable)")
    for f in dataclasses.fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "layers":
            p.add_argument(flag, type=_int_list, default=None, help="target layers to copy, e.g. 0,1,2,29")
        else:
            kind = {"int": int, "float": float, "bool": _bool}.get(str(f.type).split(" ")[0], str)
            p.add_argument(flag, type=kind, default=None)
    p.set_defaults(func=cmd_distill)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_distill(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.distill import DistillConfig, run

    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(DistillConfig)
             if getattr(a, f.name, None) is not None}
    cfg = DistillConfig(**given)
    run(cfg, progress=tqdm, say=lambda m: print(m, file=sys.stderr))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from engine import lab

    for add in (_add_setup, _add_generate, _add_divergence, _add_distill, _add_bench, _add_import_speckv,
                *lab.COMMANDS):
        add(sub)
    return parser


def _check_store(db: str) -> None:
    if db:
        from store import Store

        # Released at once: a generation can take minutes, the app may want the file meanwhile.
        with Store(db, wait_s=0.0):
            pass


def _store_run(db: str, row: dict, steps: list[dict]) -> str | None:
    if not db:
        return None
    from store import Store

    with Store(db) as st:
        run_id = st.add_run(row, steps)
        if st.staged:
            print(f"warning: {st.message}", file=sys.stderr)
        return run_id


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.models import load_pair
    from engine.lab import context_for
    from engine.policies import make_policy, parse_policy
    from engine.speculative import Generation, GenConfig, encode_prompt, run_row

    parse_policy(a.policy)  # before loading models: a typo should fail in milliseconds
    cfg = GenConfig(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    cfg.validate()
    _check_store(a.db)  # a corrupt or unopenable file fails now, not after the generation
    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    policy = make_policy(a.policy, context_for(a.db, pair, a.policy))  # speckv/rakv: costs, controller
    gen = Generation(pair, encode_prompt(pair.tokenizer, a.prompt, a.chat), policy, cfg)
    shown = ""
    for _ in gen:
        if not a.json:  # stream: print what the new tokens add to the decoded text
            text = pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    row = run_row(gen, a.prompt, policy.name, a.chat, a.task)
    steps = [dataclasses.asdict(r) for r in gen.records]
    run_id = _store_run(a.db, row, steps)
    s = gen.summary
    if a.json:
        out = dict(
            text=row["output"], token_ids=gen.token_ids, tokens_per_s=s.tokens_per_s,
            ttft_ms=s.ttft_ms, mean_accepted=s.mean_accepted, acceptance_rate=s.acceptance_rate,
            tokens_per_step=s.tokens_per_step, n_tokens=s.n_tokens, n_steps=s.n_steps,
            stop_reason=s.stop_reason, policy=policy.name, target=pair.target_name,
            draft=pair.draft_name, target_tier=pair.target_tier, draft_tier=pair.draft_tier,
            device=str(pair.device), seed=cfg.seed, run_id=run_id, steps=steps,
        )
        print(json.dumps(out))
    else:
        rate = "–" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        print(
            f"\n[{policy.name} · {pair.target_tier} · {s.n_tokens} tokens · {s.tokens_per_s:.1f} tok/s · "
            f"TTFT {s.ttft_ms:.0f} ms · {s.tokens_per_step:.2f} tok/step · acceptance {rate} · "
            f"{s.stop_reason}{f' · run {run_id}' if run_id else ''}]",
            file=sys.stderr,
        )
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if not a.name.isidentifier():
        raise ValueError(f"unknown benchmark {a.name!r}")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        mod = importlib.import_module(f"bench.{a.name}")
    except ModuleNotFoundError:
        known = sorted(p.stem for p in (REPO_ROOT / "bench").glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"unknown benchmark {a.name!r}; known: {', '.join(known)}") from None
    return int(mod.main(a.args) or 0)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Runs a command; user errors end as one line on stderr and exit 2, never a traceback."""
    from store import StoreError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as e:
        print(f"error: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 130
    except (ValueError, StoreError) as e:  # user input: UsageError is a ValueError too
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # the last line of defence: a bug, still reported on one line
        if os.environ.get("SPECLAB_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {_one_line(e)} (SPECLAB_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
