"""Cross-request prefix KV reuse on real workloads, against recomputing every prompt, in one run:

    shared      a ~1,000-token system prompt (real ShareGPT text) with different user questions
    nosharing   unrelated first questions of ShareGPT conversations (only the chat template's
                opening is shared)
    multiturn   ShareGPT conversations turn by turn, each turn re-sending the conversation
    longdoc     one long document (a few thousand tokens of ShareGPT answers), several questions
    code        HumanEval problems

Each workload runs as a sequence of requests with a fresh prefix cache under RAKV-ASD's four
configurations, one after another in a rotating order: no reuse (`ar`, reuse off), reuse-only,
joint:4 (fixed:4 with reuse) and rakv. Prints TTFT and total time with and without reuse, the hit
rate, reused tokens, peak bytes, each configuration's regret against the best of its workload,
and whether outputs with reuse equal those without, token for token.

Run: python bench/prefix.py [--json]   or   python -m engine bench prefix …"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.args import add_model_args  # noqa: E402

CONFIGS = {"no reuse": ("ar", False), "reuse-only": ("reuse-only", True), "joint:4": ("joint:4", True),
           "rakv": ("rakv", True)}
QUESTIONS = ("Summarize the document above in three sentences.", "List the main topics the document covers.",
             "What practical advice does the document give?", "Who is the intended reader of the document?")


def workloads(tokenizer, n: int, doc_tokens: int, system_tokens: int) -> dict[str, list[list[dict]]]:
    """Name → requests, each a list of chat messages. Real text throughout; the long document and
    the system prompt are cut to a token count."""
    from engine.importers import humaneval, sharegpt

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(text: str, tokens: int) -> str:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])

    short, long_answers, convs = [], [], []
    for msgs in sharegpt.conversations():
        first = msgs[0]["content"]
        if 8 <= count(first) <= 64 and len(short) < 3 * n:
            short.append(first)
        answers = [m["content"] for m in msgs if m["role"] == "assistant" and count(m["content"]) >= 300]
        long_answers += answers[:1]
        if len(msgs) >= 6 and len(convs) < 2 and sum(count(m["content"]) for m in msgs[:5]) <= 1200:
            convs.append(msgs[:5])
        if len(short) >= 3 * n and len(convs) >= 2 and sum(map(count, long_answers)) >= 2 * max(doc_tokens, system_tokens):
            break
    # Alternate answers feed the system prompt and the document: each is real text of its length.
    system = cut("\n\n".join(long_answers[0::2]), system_tokens)
    doc = cut("\n\n".join(long_answers[1::2]), doc_tokens)
    return dict(
        shared=[[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in short[:n]],
        nosharing=[[{"role": "user", "content": q}] for q in short[n: 2 * n]],
        multiturn=[c[: 2 * t + 1] for c in convs for t in range(3)],
        longdoc=[[{"role": "user", "content": f"{doc}\n\n{q}"}] for q in QUESTIONS[: max(2, n // 2)]],
        code=[[{"role": "user", "content": f"Complete this Python function:\n\n{p['prompt']}"}]
              for p in humaneval.problems()[:n]],
    )


def run(pair, requests: list[list[int]], spec: str, reuse: bool, ctx, max_new: int, budget: int) -> dict:
    """One configuration over a workload's requests, in order, with a fresh prefix cache."""
    from engine.forward import sync_device
    from engine.generation import GenConfig, Generation
    from engine.policies import make_policy
    from engine.prefix_cache import PrefixCache

    cache = PrefixCache(budget)
    out = []
    for ids in requests:
        t0 = time.perf_counter()  # around the whole request: storing its state counts too
        g = Generation(pair, ids, make_policy(spec, ctx), GenConfig(max_new_tokens=max_new, reuse=reuse), prefix=cache).run()
        sync_device(pair.device)
        out.append(dict(ttft_ms=g.summary.ttft_ms, wall_ms=(time.perf_counter() - t0) * 1e3, reused=g.summary.reused_tokens,
                        hit=g.summary.prefix_hit, tokens=g.token_ids, prompt_tokens=len(ids)))
    stats = cache.stats()
    hits = stats["exact_hits"] + stats["partial_hits"]
    return dict(requests=out, total_ms=sum(r["wall_ms"] for r in out),
                ttft_ms_median=statistics.median(r["ttft_ms"] for r in out),
                ttft_ms_mean=statistics.fmean(r["ttft_ms"] for r in out),
                reused_tokens=sum(r["reused"] for r in out), prompt_tokens=sum(r["prompt_tokens"] for r in out),
                hit_rate=hits / stats["lookups"] if reuse and stats["lookups"] else 0.0,
                peak_bytes=stats["peak_bytes"], evictions=stats["evictions"])


def measure(pair, loads: dict[str, list[list[dict]]], ctx, max_new: int, budget: int) -> dict:
    from engine.generation import encode_messages

    names, results = list(CONFIGS), {}
    for i, (wl, convs) in enumerate(loads.items()):
        requests = [encode_messages(pair.tokenizer, m) for m in convs]
        shift = i % len(names)  # rotate: no configuration always runs first on a cold machine
        res = {c: run(pair, requests, CONFIGS[c][0], CONFIGS[c][1], ctx, max_new, budget)
               for c in names[shift:] + names[:shift]}
        best = min(res[c]["total_ms"] for c in ("no reuse", "reuse-only", "joint:4"))
        plain = [r["tokens"] for r in res["no reuse"]["requests"]]
        for c, r in res.items():
            r["vs_best"] = r["total_ms"] / best
            r["identical_to_no_reuse"] = [x["tokens"] for x in r["requests"]] == plain if c in ("reuse-only",) else None
            for x in r["requests"]:
                del x["tokens"]
        results[wl] = res
    nr, ro = results["shared"]["no reuse"], results["shared"]["reuse-only"]
    reuse_runs = [results[w][c] for w in results for c in CONFIGS if CONFIGS[c][1]]
    return dict(
        workloads=results,
        ttft_speedup_shared=nr["ttft_ms_median"] / ro["ttft_ms_median"],
        miss_overhead=results["nosharing"]["reuse-only"]["total_ms"] / results["nosharing"]["no reuse"]["total_ms"] - 1,
        hit_rate=statistics.fmean(r["hit_rate"] for r in reuse_runs),
        peak_bytes=max(r["peak_bytes"] for r in reuse_runs), budget_bytes=budget,
        rakv_vs_best=max(results[w]["rakv"]["vs_best"] for w in results) - 1,
        reuse_identical=all(results[w]["reuse-only"]["identical_to_no_reuse"] for w in results),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench prefix", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--requests", type=int, default=6, help="requests per workload (longdoc: half)")
    p.add_argument("--doc-tokens", type=int, default=3000, help="length of the long document")
    p.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget-mib", type=float, default=512.0, help="prefix cache budget")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from engine.models import load_pair
    from engine.service import policy_context
    from store import Store

    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    with Store(":memory:") as st:  # rakv's cost table, measured for this run
        ctx = policy_context(st, pair, say=lambda m: print(m, file=sys.stderr))
    loads = workloads(pair.tokenizer, a.requests, a.doc_tokens, a.system_tokens)
    res = measure(pair, loads, ctx, a.max_new_tokens, int(a.budget_mib * 2**20))
    res.update(target=pair.target_name, target_tier=pair.target_tier, device=str(pair.device))
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"prefix reuse, {pair.target_name} ({pair.target_tier}) on {pair.device}, {a.max_new_tokens} new tokens a request")
    for wl, res_wl in res["workloads"].items():
        nr = res_wl["no reuse"]
        print(f"  {wl:10} {len(nr['requests'])} requests, {nr['prompt_tokens']} prompt tokens")
        for c, r in res_wl.items():
            same = "" if r["identical_to_no_reuse"] is None else f"  same output {r['identical_to_no_reuse']}"
            print(f"    {c:10} TTFT median {r['ttft_ms_median']:7.1f} ms  total {r['total_ms'] / 1e3:6.2f} s "
                  f"({r['vs_best']:.3f}× best)  hit rate {r['hit_rate']:.2f}  reused {r['reused_tokens']}{same}")
    print(f"TTFT speed-up on the shared prompt {res['ttft_speedup_shared']:.2f}×; miss overhead "
          f"{res['miss_overhead']:+.1%}; rakv vs best {res['rakv_vs_best']:+.1%}; peak {res['peak_bytes'] / 2**20:.1f} MiB "
          f"of {res['budget_bytes'] / 2**20:.0f}; outputs with reuse identical: {res['reuse_identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
