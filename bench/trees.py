"""Do token trees pay here? In ONE run, on held-out prompts (greedy, the chat template), per target tier:

    live runs    `ar`, the chain `fixed:4` and each `tree:NxW` through the engine's own step loop
                 (the draft grows each tree level by level, EAGLE-2's rule: oracles/tree_growth.py;
                 the target verifies it in one read), in turns per prompt: tok/s, τ (tokens a
                 target verify emits), and each output against HF generate's, token for token
    rakv         the default policy, on the pair's cost table measured in the run (which prices a
                 tree's draft levels and its verify): it weighs trees of 4, 8, 16 nodes beside chains
    ratios       per prompt, then the geometric mean and its 95% interval (t over the prompts' log
                 ratios): every policy against `ar`, rakv against the best fixed policy (`ci95`),
                 the best tree against the chain
    verify cost  one target read of a tree of N nodes over a held-out prompt's context, timed in
                 turns beside the reads a run takes today (a plain step, a chain of 4's verify), as
                 the ratio to the plain step

Whether a tree pays is its τ over the chain's against the verify's cost ratio at its size plus
what growing it costs the draft; the live runs pay all three.

Run: python -m engine bench trees [--json] [--tiers fp32,bf16] [--nodes 4,8,16] [--width 3]"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from engine.base.flags import add_model_args
from engine.datasets.prompts import heldout
from engine.decode.costs import CostTable
from engine.decode.policies import PolicyContext
from engine.decode.policies.fixed import parse_tree
from engine.decode.tree import DraftTree
from engine.lab.generation import encode_prompt
from engine.lab.profiling import measure_costs
from engine.oracles.sampling import Sampler
from engine.oracles.target import TargetVerifier
from engine.runtime.forward import crop_to, forward_logits, forward_tree_logits
from engine.runtime.models import ModelPair, load_pair
from engine.service.generation import Request, open_generation

CHAIN = 4  # the chain every tree is set beside: the default drafts' fixed γ
VERIFY_NODES = (0, 1, 2, 4, 8, 16)  # tree sizes the verify is timed at


def _prefilled(pair: ModelPair, prompt: list[int]) -> TargetVerifier:
    v = TargetVerifier(pair, prompt, Sampler(0.0, 1.0, None, pair.device))
    v.prefill()
    return v


def hf_generate(pair: ModelPair, prompt: list[int], max_new: int) -> list[int]:
    """HF generate's greedy continuation of `prompt` on the pair's target: the exactness reference."""
    x = torch.tensor([prompt], device=pair.device)
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                               pad_token_id=pair.tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def live(pair: ModelPair, ids: list[list[int]], policies: list[str], max_new: int,
         context: PolicyContext | None = None) -> dict[str, list[dict]]:
    """policy → one run per prompt (tokens, tok/s, τ, the steps that verified a tree), the policies
    in turns per prompt after one untimed warm-up run each (the kernels' first reads, the draft's
    lazy load). `context`: rakv's cost table."""
    def one(policy: str, prompt: list[int]) -> dict:
        gen = open_generation(pair, Request(prompt="", policy=policy, max_new_tokens=max_new), context=context,
                              prompt_ids=prompt)
        t0 = time.perf_counter()
        list(gen)
        wall = time.perf_counter() - t0
        return dict(tokens=gen.token_ids, tok_s=len(gen.token_ids) / wall, tau=gen.summary.tokens_per_step,
                    tree_steps=sum(1 for r in gen.records if r.tree_parents), steps=len(gen.records) - 1)

    for policy in policies:
        one(policy, ids[0])
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for prompt in ids:
        for policy in policies:
            runs[policy].append(one(policy, prompt))
    return runs


def geo_ratio(num: list[float], den: list[float]) -> tuple[float, list[float]]:
    """The geometric mean of num[i] / den[i] and its 95% interval (t over the log ratios)."""
    logs = [math.log(a / b) for a, b in zip(num, den)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), [math.exp(mean)] * 2
    from scipy import stats

    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), [math.exp(mean - half), math.exp(mean + half)]


def verify_ms(pair: ModelPair, prompt: list[int], sizes: tuple[int, ...], reps: int) -> dict[str, float]:
    """Median ms over `prompt`'s context, in turns per rep: one tree read of each size (`tree:N`),
    and the reads a run takes today, a plain step and a chain's verify (`plain`, `chain:4`)."""
    v = _prefilled(pair, prompt)
    start, root = len(v.tokens) - 1, v.tokens[-1]
    chain = [(7 * i + 11) % pair.vocab_size for i in range(CHAIN)]
    reads = {"plain": lambda: forward_logits(pair.target, [root], v.cache, 1, pair.vocab_size),
             f"chain:{CHAIN}": lambda: forward_logits(pair.target, [root] + chain, v.cache, CHAIN + 1, pair.vocab_size)}
    for n in sizes:
        tree = DraftTree.bushy([(7 * i + 11) % pair.vocab_size for i in range(n)])
        reads[f"tree:{n}"] = (lambda tree=tree: forward_tree_logits(
            pair.target, [root] + tree.tokens, v.cache, tree.mask(), tree.positions(start), pair.vocab_size))
    times: dict[str, list[float]] = {k: [] for k in reads}
    for rep in range(reps + 1):  # the first round warms up
        for name, read in reads.items():
            t0 = time.perf_counter()
            read()
            if rep:
                times[name].append((time.perf_counter() - t0) * 1e3)
            crop_to(v.cache, start)
    return {k: statistics.median(t) for k, t in times.items()}


def measure(pair: ModelPair, prompts: list[tuple[str, str]], max_new: int, shapes: list[tuple[int, int]],
            reps: int, say=print, costs: CostTable | None = None) -> dict:
    """The live runs, their ratios and the verify's cost by size; with `costs` (the pair's measured
    table, which prices trees) rakv runs too, against ar and the best fixed policy."""
    ids = [encode_prompt(pair.tokenizer, p, chat=True) for _, p in prompts]
    want = [hf_generate(pair, i, max_new) for i in ids]
    chain, trees = f"fixed:{CHAIN}", [f"tree:{n}x{w}" for n, w in shapes]
    adaptive = ["rakv"] if costs is not None else []
    runs = live(pair, ids, ["ar", chain] + trees + adaptive, max_new, PolicyContext(costs=costs))
    out: dict = dict(prompts=len(ids), max_new_tokens=max_new, policies={})
    for policy, rs in runs.items():
        vs_ar, ci = geo_ratio([r["tok_s"] for r in rs], [r["tok_s"] for r in runs["ar"]])
        out["policies"][policy] = dict(tok_s=statistics.fmean(r["tok_s"] for r in rs),
                                       tau=statistics.fmean(r["tau"] for r in rs), vs_ar=vs_ar, vs_ar_ci95=ci,
                                       tree_steps=sum(r["tree_steps"] for r in rs), steps=sum(r["steps"] for r in rs),
                                       identical_to_hf_generate=all(r["tokens"] == w for r, w in zip(rs, want)))
        p = out["policies"][policy]
        say(f"  {policy:10} {p['tok_s']:6.1f} tok/s  τ {p['tau']:.3f}  × ar {vs_ar:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
            f"  tree steps {p['tree_steps']}/{p['steps']}  identical to HF generate {p['identical_to_hf_generate']}")
    fixed = ["ar", chain] + trees
    best_fixed = max(fixed, key=lambda t: out["policies"][t]["tok_s"])
    if adaptive:
        ratio, ci = geo_ratio([r["tok_s"] for r in runs["rakv"]], [r["tok_s"] for r in runs[best_fixed]])
        out.update(rakv_vs_ar=out["policies"]["rakv"]["vs_ar"], rakv_vs_ar_ci95=out["policies"]["rakv"]["vs_ar_ci95"],
                   best_fixed=best_fixed, rakv_vs_best_fixed=ratio, ci95=ci)
        say(f"  rakv × the best fixed policy ({best_fixed}): {ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    best = max(trees, key=lambda t: out["policies"][t]["tok_s"]) if trees else None
    ms = verify_ms(pair, ids[0], VERIFY_NODES, reps)
    out.update(verify_ms=ms, verify_ms_by_nodes={str(n): ms[f"tree:{n}"] for n in VERIFY_NODES},
               verify_cost_by_nodes={str(n): ms[f"tree:{n}"] / ms["plain"] for n in VERIFY_NODES},
               chain_verify_cost=ms[f"chain:{CHAIN}"] / ms["plain"],
               tau_chain=out["policies"][chain]["tau"],
               tau_tree=max(out["policies"][t]["tau"] for t in trees) if trees else None,
               best_tree=best, chain_vs_ar=out["policies"][chain]["vs_ar"],
               identical_to_hf_generate=all(p["identical_to_hf_generate"] for p in out["policies"].values()))
    if best:
        ratio, ci = geo_ratio([r["tok_s"] for r in runs[best]], [r["tok_s"] for r in runs[chain]])
        out.update(best_tree_vs_ar=out["policies"][best]["vs_ar"], best_tree_vs_chain=ratio, best_tree_vs_chain_ci95=ci)
        say(f"  best tree {best}: × the chain {ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench trees", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tiers", default="fp32", help="target tiers, comma-separated")
    p.add_argument("--prompts-per-task", type=int, default=2, help="held-out prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--nodes", default="4,8,16", help="tree node budgets")
    p.add_argument("--width", type=int, default=3, help="children a node at most")
    p.add_argument("--reps", type=int, default=5, help="timed verify reads per size")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        shapes = [(int(n), a.width) for n in a.nodes.split(",") if n]
        for n, w in shapes:
            parse_tree(f"{n}x{w}")
    except ValueError as e:
        p.error(str(e) if "tree:" in str(e) else "--nodes takes comma-separated integers")
    prompts = heldout(a.prompts_per_task)[: 4 * a.prompts_per_task]
    say = (lambda s: print(s, file=sys.stderr)) if a.json else print
    res: dict = dict(tiers={})
    for tier in [t for t in a.tiers.split(",") if t]:
        pair = load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code)
        say(f"{pair.target_name} at {tier}, draft {pair.draft_name}: {len(prompts)} held-out prompts × "
            f"{a.max_new_tokens} tokens")
        say("  measuring the cost table rakv reads (its trees' prices included)")
        costs = measure_costs(pair)
        with torch.inference_mode():
            res["tiers"][tier] = measure(pair, prompts, a.max_new_tokens, shapes, a.reps, say, costs)
        t = res["tiers"][tier]
        say(f"  a tree read's cost by nodes (× a plain step, {t['verify_ms']['plain']:.1f} ms): "
            + "  ".join(f"{n}: {c:.2f}" for n, c in t["verify_cost_by_nodes"].items())
            + f"; a chain of {CHAIN}'s verify: {t['chain_verify_cost']:.2f}")
        del pair
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
