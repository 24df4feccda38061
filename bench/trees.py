"""Do token trees pay here? In ONE run, on held-out prompts (greedy, the chat template), per target tier:

    τ            tokens a target verify emits: a chain of γ = 4 from the draft, and trees the draft
                 grows best-first (EAGLE-2's rule: the frontier node with the highest cumulative
                 draft probability gets its next most likely child) to a node budget, at most
                 `--width` children a node; every step verifies one tree in one target pass
    verify cost  one target read of a tree of N nodes over a held-out prompt's context, timed in
                 turns beside the reads a run takes today (a plain step, a chain of 4's verify), as
                 the ratio to the plain step
    exactness    every tree run's output against plain greedy decoding (which test_tree.py holds
                 equal to HF generate): identical, token for token

The draft grows each tree by reading every node's path after the context (one draft read per
expanded node): what a tree proposes is measured here, not what growing it costs, so no tok/s is
printed. Whether a tree pays is τ_tree / τ_chain against the verify's cost ratio at that size.

Run: python -m engine bench trees [--json] [--tiers fp32,bf16] [--nodes 4,8,16]"""
from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time

import torch

from engine.base.flags import add_model_args
from engine.datasets.prompts import heldout
from engine.decode.records import DraftToken
from engine.decode.tree import ROOT, DraftTree, budget_tree_shape
from engine.lab.generation import encode_prompt
from engine.oracles.draft import draft_read
from engine.oracles.sampling import Sampler
from engine.oracles.target import TargetVerifier
from engine.runtime.forward import crop_to, forward_logits, forward_tree_logits
from engine.runtime.models import ModelPair, load_pair

CHAIN = 4  # the chain every tree is set beside: the default drafts' fixed γ
VERIFY_NODES = (0, 1, 2, 4, 8, 16)  # tree sizes the verify is timed at


def grow(pair: ModelPair, context: list[int], nodes: int, width: int) -> DraftTree:
    """A tree of `nodes` the draft proposes after `context` (its newest token the root), grown
    best-first by cumulative draft probability; `nodes` = γ and `width` = 1 is the chain."""
    budget_tree_shape(nodes, width, pair.vocab_size)
    _, cache = draft_read(pair, context[:-1], None) if len(context) > 1 else (None, None)
    held = cache.get_seq_length() if cache is not None else 0
    tree, paths = DraftTree(), {ROOT: [context[-1]]}
    kids: dict[int, list[tuple[int, float]]] = {}  # row → its children not yet taken (token, probability)
    frontier = [(-1.0, ROOT)]  # (−cumulative probability, row): the next node to give a child
    cum = {ROOT: 1.0}
    while tree.size < nodes and frontier:
        _, row = heapq.heappop(frontier)
        if row not in kids:
            logits, cache = draft_read(pair, paths[row], cache)  # [1, V]: the draft after row's path
            crop_to(cache, held)
            p = torch.softmax(logits[0].float(), -1)
            top = p.topk(width)
            kids[row] = list(zip(top.indices.tolist(), top.values.tolist()))
        token, prob = kids[row].pop(0)
        child = tree.add(row, DraftToken(token, 0.0, prob), "draft")
        paths[child], cum[child] = paths[row] + [token], cum[row] * prob
        heapq.heappush(frontier, (-cum[child], child))  # its own first child
        if kids[row]:
            heapq.heappush(frontier, (-cum[row] * kids[row][0][1], row))  # row's next child
    return tree


def _prefilled(pair: ModelPair, prompt: list[int]) -> TargetVerifier:
    v = TargetVerifier(pair, prompt, Sampler(0.0, 1.0, None, pair.device))
    v.prefill()
    return v


def decode(pair: ModelPair, prompt: list[int], max_new: int, nodes: int, width: int) -> tuple[list[int], list[int]]:
    """Greedy decoding where every step verifies one grown tree: (tokens, tokens emitted per verify)."""
    v = _prefilled(pair, prompt)
    per_verify = []
    while len(v.tokens) - len(prompt) < max_new and not v.ended:
        left = max_new - (len(v.tokens) - len(prompt))
        tree = grow(pair, v.tokens, min(nodes, left - 1), width) if left > 1 else DraftTree()
        per_verify.append(len(v.verify_tree(tree)[1]))
    return v.tokens[len(prompt):][:max_new], per_verify


def plain(pair: ModelPair, prompt: list[int], max_new: int) -> list[int]:
    v = _prefilled(pair, prompt)
    while len(v.tokens) - len(prompt) < max_new and not v.ended:
        v.verify([])
    return v.tokens[len(prompt):][:max_new]


def verify_ms(pair: ModelPair, prompt: list[int], sizes: tuple[int, ...], reps: int) -> dict[str, float]:
    """Median ms over `prompt`'s context, in turns per rep: one tree read of each size (`tree:N`),
    and the reads a run takes today, a plain step and a chain's verify (`plain`, `chain:4`)."""
    v = _prefilled(pair, prompt)
    start, root = len(v.tokens) - 1, v.tokens[-1]
    chain = [(7 * i + 11) % pair.vocab_size for i in range(CHAIN)]
    reads = {"plain": lambda: forward_logits(pair.target, [root], v.cache, 1, pair.vocab_size),
             f"chain:{CHAIN}": lambda: forward_logits(pair.target, [root] + chain, v.cache, CHAIN + 1, pair.vocab_size)}
    for n in sizes:
        tree = DraftTree()
        for i in range(n):  # a bushy tree: two children a node, breadth first
            parent = ROOT if i < 2 else (i - 2) // 2 + 1
            tree.add(parent, DraftToken((7 * i + 11) % pair.vocab_size, 0.0, 1.0), "draft")
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
            reps: int, say=print) -> dict:
    ids = [encode_prompt(pair.tokenizer, p, chat=True) for _, p in prompts]
    want = [plain(pair, i, max_new) for i in ids]
    out: dict = dict(prompts=len(ids), max_new_tokens=max_new, shapes={})
    for nodes, width in [(CHAIN, 1)] + shapes:
        name = f"chain:{nodes}" if width == 1 else f"tree:{nodes}x{width}"
        emitted, same = [], True
        for i, w in zip(ids, want):
            toks, per = decode(pair, i, max_new, nodes, width)
            emitted += per
            same &= toks == w
        out["shapes"][name] = dict(nodes=nodes, width=width, tau=sum(emitted) / len(emitted), verifies=len(emitted),
                                   identical_to_plain=same)
        say(f"  {name:12} τ {out['shapes'][name]['tau']:.3f} over {len(emitted)} verifies, identical {same}")
    ms = verify_ms(pair, ids[0], VERIFY_NODES, reps)
    out["verify_ms"] = ms
    out["verify_ms_by_nodes"] = {str(n): ms[f"tree:{n}"] for n in VERIFY_NODES}
    out["verify_cost_by_nodes"] = {str(n): ms[f"tree:{n}"] / ms["plain"] for n in VERIFY_NODES}
    out["chain_verify_cost"] = ms[f"chain:{CHAIN}"] / ms["plain"]
    chain = out["shapes"][f"chain:{CHAIN}"]["tau"]
    trees = {k: s for k, s in out["shapes"].items() if s["width"] > 1}
    best = max(trees, key=lambda k: trees[k]["tau"]) if trees else None
    out.update(tau_chain=chain, tau_tree=trees[best]["tau"] if best else None, best_tree=best,
               identical_to_plain=all(s["identical_to_plain"] for s in out["shapes"].values()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench trees", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tiers", default="fp32", help="target tiers, comma-separated")
    p.add_argument("--prompts-per-task", type=int, default=2, help="held-out prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--nodes", default="4,8,16", help="tree node budgets")
    p.add_argument("--width", type=int, default=3, help="children a node at most")
    p.add_argument("--reps", type=int, default=5, help="timed verify reads per size")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        shapes = [(int(n), a.width) for n in a.nodes.split(",") if n]
    except ValueError:
        p.error("--nodes takes comma-separated integers")
    prompts = heldout(a.prompts_per_task)[: 4 * a.prompts_per_task]
    say = (lambda s: print(s, file=sys.stderr)) if a.json else print
    res: dict = dict(tiers={})
    for tier in [t for t in a.tiers.split(",") if t]:
        pair = load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code)
        say(f"{pair.target_name} at {tier}, draft {pair.draft_name}: {len(prompts)} held-out prompts × "
            f"{a.max_new_tokens} tokens")
        with torch.inference_mode():
            res["tiers"][tier] = measure(pair, prompts, a.max_new_tokens, shapes, a.reps, say)
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
