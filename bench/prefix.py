"""Cross-request prefix KV reuse on real workloads, against recomputing every prompt, in one run:

    shared      a ~1,000-token system prompt (real ShareGPT text) with different user questions
    nosharing   unrelated first questions of ShareGPT conversations (only the chat template's
                opening is shared)
    multiturn   ShareGPT conversations turn by turn, each turn re-sending the conversation
    longdoc     one long document (a few thousand tokens of ShareGPT answers), several questions
    code        HumanEval problems

Each workload runs as a sequence of requests under RAKV-ASD's four configurations, each with its
own prefix cache, taking turns request by request: no reuse (`ar`, reuse off), reuse-only,
joint:4 (fixed:4 with reuse) and rakv. Prints TTFT and total time with and without reuse, the hit
rate, reused tokens, peak bytes, each configuration's regret against the best of its workload,
and whether outputs with reuse equal those without, token for token.

Run: python bench/prefix.py [--json]   or   python -m engine bench prefix …"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from engine.base.flags import add_model_args

CONFIGS = {"no reuse": ("ar", False), "reuse-only": ("reuse-only", True), "joint:4": ("joint:4", True),
           "rakv": ("rakv", True)}
BASELINES = ("no reuse", "reuse-only", "joint:4")  # RAKV-ASD's: rakv's regret is against the best of them
RACE_MARGIN = 1.25  # after the first round, a configuration this far behind the best sits out the rest
# A Williams square: over four requests each configuration runs once in each place and once
# right after each other one.
ORDERS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))
QUESTIONS = ("Summarize the document above in three sentences.", "List the main topics the document covers.",
             "What practical advice does the document give?", "Who is the intended reader of the document?")


def workloads(tokenizer, n: int, doc_tokens: int, system_tokens: int) -> dict[str, list]:
    """Name → requests, each a list of chat messages (and held-out first questions to calibrate
    on). Real text throughout; the long document and the system prompt are cut to a token count."""
    from engine.datasets import humaneval, sharegpt

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
        calibration=short[2 * n: 3 * n],
        shared=[[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in short[:n]],
        nosharing=[[{"role": "user", "content": q}] for q in short[n: 2 * n]],
        multiturn=[c[: 2 * t + 1] for c in convs for t in range(3)],
        longdoc=[[{"role": "user", "content": f"{doc}\n\n{q}"}] for q in QUESTIONS[: max(2, n // 2)]],
        code=[[{"role": "user", "content": f"Complete this Python function:\n\n{p['prompt']}"}]
              for p in humaneval.problems()[:n]],
    )


def calibrated(pair, st, prompts: list[str], max_new: int, draft_prompts: int = 3):
    """The policies' context after a short profile of held-out requests, as a user tunes a pair:
    their live steps calibrate the cost table (`costs --calibrate`: the bare forwards miss what a
    live step pays beyond them) and give rakv the pair's acceptance, per proposer, as its priors.
    The draft model's policies run on the first `draft_prompts`; the other proposers on all of
    them: an n-gram lookup drafts only where the text repeats (~11 steps in 32 tokens of chat)."""
    from engine.oracles import available
    from engine.service import calibrate_costs, cost_key, policy_context
    from engine.service.generation import Request, generate

    # Each other proposer drafts too, so that rakv's prior for it is its measured acceptance (as
    # `bench draft` calibrates): without one a weak EAGLE head starts every request at α0 = 0.6.
    others = [f"fixed:2@{p}" for p in available(pair) if p != "draft"]
    for i, prompt in enumerate(prompts):
        for spec in (("ar", "fixed:1", "fixed:2", "fixed:4") if i < draft_prompts else ()) + tuple(others):
            generate(pair, Request(prompt, spec, task="calibration", max_new_tokens=max_new), st, context=None)
    calibrate_costs(st, cost_key(pair))
    return policy_context(st, pair)


def request(pair, ids: list[int], spec: str, reuse: bool, cache, ctx, max_new: int) -> dict:
    """One request under one configuration, timed whole: storing its state counts too."""
    from engine.runtime.forward import sync_device
    from engine.service.generation import Request, open_generation

    gc.collect()  # the previous request's garbage is not this one's to collect
    t0 = time.perf_counter()
    req = Request("", spec, max_new_tokens=max_new, reuse=reuse)
    g = open_generation(pair, req, context=ctx, prefix=cache, prompt_ids=ids).run()
    sync_device(pair.device)
    return dict(ttft_ms=g.summary.ttft_ms, wall_ms=(time.perf_counter() - t0) * 1e3, reused=g.summary.reused_tokens,
                hit=g.summary.prefix_hit, tokens=g.token_ids, prompt_tokens=len(ids),
                drafting_steps=sum(r.k_drafted > 0 for r in g.records))


def _median_request(same: tuple[dict, ...]) -> dict:
    """One request's runs in several rounds: the first, with the median times."""
    return dict(same[0], ttft_ms=statistics.median(r["ttft_ms"] for r in same),
                wall_ms=statistics.median(r["wall_ms"] for r in same), rounds=len(same))


def summary(out: list[dict], stats: dict, reuse: bool) -> dict:
    """A configuration's figures over a workload, from its requests and its cache's counters."""
    hits = stats["exact_hits"] + stats["partial_hits"]
    return dict(requests=out, total_ms=sum(r["wall_ms"] for r in out),
                ttft_ms_median=statistics.median(r["ttft_ms"] for r in out),
                ttft_ms_mean=statistics.fmean(r["ttft_ms"] for r in out),
                reused_tokens=sum(r["reused"] for r in out), prompt_tokens=sum(r["prompt_tokens"] for r in out),
                drafting_steps=sum(r["drafting_steps"] for r in out),
                hit_rate=hits / stats["lookups"] if reuse and stats["lookups"] else 0.0,
                peak_bytes=stats["peak_bytes"], evictions=stats["evictions"])


def measure(pair, loads: dict[str, list[list[dict]]], ctx, max_new: int, budget: int, rounds: int = 1,
            say=lambda m: None) -> dict:
    """Each configuration keeps its own prefix cache over a workload's request sequence; the
    configurations take turns request by request, so that a slow spell of this shared machine
    falls on all of them alike rather than on whichever ran then, in a balanced order (each
    first, last and after each other alike): a rotation would always put rakv after joint:4.
    With several rounds (fresh caches each), a request's time is its median over the rounds;
    a configuration over RACE_MARGIN × the best after the first round sits the rest out."""
    from engine.lab.generation import encode_messages
    from engine.runtime.prefix.cache import PrefixCache

    names, results = list(CONFIGS), {}
    for wl, convs in loads.items():
        requests = [encode_messages(pair.tokenizer, m) for m in convs]
        say(f"{wl}: {len(requests)} requests × {len(names)} configurations, {rounds} round(s)…")
        runs: dict[str, list[list[dict]]] = {c: [] for c in names}  # per configuration: rounds of requests
        active, stats = list(names), {}
        for rnd in range(rounds):
            caches = {c: PrefixCache(budget) for c in active}
            for c in active:
                runs[c].append([])
            for i, ids in enumerate(requests):
                for c in (names[j] for j in ORDERS[(i + rnd) % len(ORDERS)] if names[j] in active):
                    runs[c][-1].append(request(pair, ids, *CONFIGS[c], caches[c], ctx, max_new))
            if rnd == 0:  # its cache counters stand for every round; its totals pick who runs on
                stats = {c: caches[c].stats() for c in names}
                first = {c: sum(r["wall_ms"] for r in runs[c][0]) for c in names}
                bar = RACE_MARGIN * min(first[b] for b in BASELINES)
                active = [c for c in names if first[c] <= bar]
        out = {c: [_median_request(same) for same in zip(*runs[c])] for c in names}
        res = {c: summary(out[c], stats[c], CONFIGS[c][1]) for c in names}
        best = min(res[c]["total_ms"] for c in BASELINES)
        plain = [r["tokens"] for r in out["no reuse"]]
        for c, r in res.items():
            r["vs_best"] = r["total_ms"] / best
            r["identical_to_no_reuse"] = [x["tokens"] for x in out[c]] == plain if c == "reuse-only" else None
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
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each workload; a request's time is its median (this machine's noise is ~8%% a run)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds needs at least 1, got {a.rounds}")
    from engine.runtime.models import load_pair
    from engine.service import cost_table
    from store import Store

    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    loads = workloads(pair.tokenizer, a.requests, a.doc_tokens, a.system_tokens)
    with Store(":memory:") as st:  # rakv's cost table and prior, measured for this run
        cost_table(st, pair, say=lambda m: print(m, file=sys.stderr))
        ctx = calibrated(pair, st, loads.pop("calibration"), a.max_new_tokens)
    res = measure(pair, loads, ctx, a.max_new_tokens, int(a.budget_mib * 2**20), a.rounds,
                  say=lambda m: print(m, file=sys.stderr, flush=True))
    res.update(target=pair.target_name, target_tier=pair.target_tier, device=str(pair.device),
               step_factor=ctx.costs.step_factor, rakv_alpha0=ctx.alpha0,
               rakv_priors={p: round(a, 3) for p, a in ctx.priors.items()})
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"prefix reuse, {pair.target_name} ({pair.target_tier}) on {pair.device}, {a.max_new_tokens} new tokens a request, "
          f"{a.rounds} round(s); rakv's priors {res['rakv_priors']} (the calibration runs' acceptance)")
    for wl, res_wl in res["workloads"].items():
        nr = res_wl["no reuse"]
        print(f"  {wl:10} {len(nr['requests'])} requests, {nr['prompt_tokens']} prompt tokens")
        for c, r in res_wl.items():
            same = "" if r["identical_to_no_reuse"] is None else f"  same output {r['identical_to_no_reuse']}"
            print(f"    {c:10} TTFT median {r['ttft_ms_median']:7.1f} ms  total {r['total_ms'] / 1e3:6.2f} s "
                  f"({r['vs_best']:.3f}× best)  hit rate {r['hit_rate']:.2f}  reused {r['reused_tokens']}  "
                  f"drafting steps {r['drafting_steps']}{same}")
    print(f"TTFT speed-up on the shared prompt {res['ttft_speedup_shared']:.2f}×; miss overhead "
          f"{res['miss_overhead']:+.1%}; rakv vs best {res['rakv_vs_best']:+.1%}; peak {res['peak_bytes'] / 2**20:.1f} MiB "
          f"of {res['budget_bytes'] / 2**20:.0f}; outputs with reuse identical: {res['reuse_identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
