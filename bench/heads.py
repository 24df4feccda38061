"""What does a reduced-vocabulary draft head buy? Per head size K (the draft's LM head cut to the
K most frequent target tokens, `@draft:vocab=K`; engine/runtime/vocab_head.py), in ONE run at fp32:

    cost_ratio   ms of one draft step (a one-token read through the body and the K-row head, as the
                 proposer runs it) / ms of one plain target step; every configuration timed in
                 turns (interleaved), medians
    agreement    teacher-forced: draft greedy top-1 (over its K ids) == the target's greedy next
                 token, along the target's own greedy continuations of held-out prompts
    coverage     share of those target tokens inside the head (an upper bound on agreement)
    tau_at_4     tokens per target step of live `fixed:4@draft:vocab=K` runs on a few held-out prompts
    tok_s        their wall-clock tokens per second (beside `ar`'s; one run each, so noisy)

Run: python -m engine bench heads [--json]   (defaults: ~3–5 minutes on the idle 2-core CPU)"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import torch

from engine.base.flags import add_model_args
from engine.base.helpers import medians_ms
from engine.datasets.prompts import heldout
from engine.lab.generation import encode_prompt
from engine.oracles.draft import draft_read
from engine.oracles.sampling import Sampler, draft_signals
from engine.runtime import vocab_head
from engine.runtime.forward import crop_to, forward_last_state, forward_logits, sync_device
from engine.runtime.models import ModelPair, load_pair
from engine.service.generation import Request, open_generation

SIZES = (4096, 8192, 16384, 32768, 0)  # 0: the full head
GAMMA = 4


def _name(k: int) -> str:
    return "full" if k == 0 else str(k)


def _policy(k: int, vocab: int) -> str:
    return f"fixed:{GAMMA}@draft:vocab={k or vocab}"  # the full head named: the pair's default may be a sub-head


def _heads(pair: ModelPair, sizes: tuple[int, ...]) -> dict[int, vocab_head.SubHead | None]:
    return {k: vocab_head.sub_head(pair, k) if k else None for k in sizes}


def _greedy(pair: ModelPair, ids: list[int], n: int) -> list[int]:
    return open_generation(pair, Request("-", "ar", max_new_tokens=n), context=None, prompt_ids=ids).run().token_ids


@torch.inference_mode()
def agreement(pair: ModelPair, heads: dict, texts: list[tuple[list[int], list[int]]]) -> dict[int, dict]:
    """Per K: (hits, covered) / positions over (prompt ids, target continuation) pairs. One body
    read per text; every head scores the same states (the full head's rows at its ids)."""
    w = pair.draft.get_output_embeddings().weight[: pair.vocab_size]  # [V, H]
    tally = {k: [0, 0, 0] for k in heads}
    for prompt, resp in texts:
        x = torch.tensor([prompt + resp[:-1]], device=pair.device)  # [1, S]
        states = pair.draft.get_decoder()(input_ids=x).last_hidden_state[0, -len(resp):]  # [R, H]
        logits = states @ w.T  # [R, V]
        want = torch.tensor(resp, device=pair.device)  # [R]
        for k, h in heads.items():
            guess = logits.argmax(-1) if h is None else h.ids[logits[:, h.ids].argmax(-1)]
            covered = len(resp) if h is None else int(h.t2d[want].sum())
            t = tally[k]
            t[0], t[1], t[2] = t[0] + int((guess == want).sum()), t[1] + covered, t[2] + len(resp)
    return {k: dict(agreement=h / max(n, 1), coverage=c / max(n, 1), positions=n) for k, (h, c, n) in tally.items()}


@torch.inference_mode()
def costs(pair: ModelPair, heads: dict, ctx: list[int], reps: int) -> tuple[float, dict[int, float]]:
    """(target ms per plain step, {K: draft ms per step}), one-token reads after `ctx`, caches
    rolled back each time, all timed in turns."""
    _, tcache = forward_logits(pair.target, ctx, None, 1, pair.vocab_size)
    _, dcache = forward_last_state(pair.draft, ctx, None)
    tok, n = [ctx[-1]], len(ctx)

    def target_step() -> None:
        forward_logits(pair.target, tok, tcache, 1, pair.vocab_size)
        crop_to(tcache, n)

    sampler = Sampler(0.0, 1.0, 0, pair.device)

    def draft_step(head) -> Callable[[], None]:
        def once() -> None:  # what the proposer does per drafted token (greedy)
            logits, _ = draft_read(pair, tok, dcache, head)
            x, p = sampler.choose(logits[0])
            draft_signals(p)
            crop_to(dcache, n)
        return once

    ms = medians_ms([target_step] + [draft_step(h) for h in heads.values()], reps, warmup=3,
                    sync=lambda: sync_device(pair.device))
    return ms[0], dict(zip(heads, ms[1:]))


@torch.inference_mode()
def live(pair: ModelPair, sizes: tuple[int, ...], prompts: list[list[int]], max_new: int) -> dict[str, dict]:
    """τ at γ = 4 and tok/s per K (and `ar`), configurations interleaved per prompt."""
    runs = {"ar": "ar", **{_name(k): _policy(k, pair.vocab_size) for k in sizes}}
    acc = {name: [0, 0, 0.0] for name in runs}  # tokens after the prefill, steps, wall ms
    for i, ids in enumerate(prompts):
        order = list(runs)[i % len(runs):] + list(runs)[: i % len(runs)]  # a rotating order
        for name in order:
            g = open_generation(pair, Request("-", runs[name], max_new_tokens=max_new), context=None,
                                prompt_ids=ids).run()
            s, a = g.summary, acc[name]
            a[0], a[1], a[2] = a[0] + s.n_tokens - 1, a[1] + s.n_steps, a[2] + s.wall_ms
    return {name: dict(tau_at_4=t / max(st, 1) if name != "ar" else 1.0,
                       tok_s=(t + len(prompts)) / max(ms, 1e-9) * 1e3) for name, (t, st, ms) in acc.items()}


def measure(pair: ModelPair, sizes: tuple[int, ...], agree_per_task: int, live_prompts: int, max_new: int,
            agree_tokens: int, reps: int, say=lambda m: None) -> dict:
    t0 = time.perf_counter()
    heads = _heads(pair, sizes)
    chosen = heldout(agree_per_task)
    say(f"target continuations of {len(chosen)} held-out prompts ({agree_tokens} tokens each)")
    texts = [(ids, _greedy(pair, ids, agree_tokens))
             for ids in (encode_prompt(pair.tokenizer, p, chat=True) for _, p in chosen)]
    say("agreement")
    agree = agreement(pair, heads, texts)
    say("costs")
    ctx = texts[0][0] + texts[0][1]
    target_ms, draft_ms = costs(pair, heads, ctx, reps)
    say(f"live runs: {live_prompts} prompts × {len(sizes) + 1} configurations, {max_new} tokens")
    runs = live(pair, sizes, [ids for ids, _ in texts[:live_prompts]], max_new)
    rows = [dict(head=_name(k), size=k or pair.vocab_size, draft_ms=draft_ms[k], cost_ratio=draft_ms[k] / target_ms,
                 **agree[k], **runs[_name(k)]) for k in sizes]
    return dict(target_ms=target_ms, rows=rows, ar=runs["ar"], context_tokens=len(ctx),
                agreement_prompts=len(texts), live_prompts=min(live_prompts, len(texts)), max_new=max_new,
                elapsed_s=time.perf_counter() - t0)


def format_report(res: dict) -> str:
    head = f"{'head':>6} {'draft ms':>9} {'cost':>6} {'agree':>6} {'cover':>6} {'τ@4':>5} {'tok/s':>6}"
    lines = [f"draft heads at fp32: target step {res['target_ms']:.1f} ms (context {res['context_tokens']}), "
             f"agreement over {res['rows'][0]['positions']} positions of {res['agreement_prompts']} held-out prompts, "
             f"τ over {res['live_prompts']} prompts × {res['max_new']} tokens", head]
    for r in res["rows"]:
        lines.append(f"{r['head']:>6} {r['draft_ms']:9.2f} {r['cost_ratio']:6.3f} {r['agreement']:6.3f} "
                     f"{r['coverage']:6.3f} {r['tau_at_4']:5.2f} {r['tok_s']:6.1f}")
    lines.append(f"{'ar':>6} {'':>9} {'':>6} {'':>6} {'':>6} {1.0:5.2f} {res['ar']['tok_s']:6.1f}")
    lines.append(f"({res['elapsed_s']:.0f} s)")
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(0 if x.strip() == "full" else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--sizes takes integers or 'full', got {text!r}") from None


def add_measure_args(p: argparse.ArgumentParser, agreement_per_task: int, agreement_tokens: int) -> None:
    """`measure`'s options (bench self_draft takes them too), and --json."""
    p.add_argument("--agreement-per-task", type=int, default=agreement_per_task,
                   help="held-out prompts per task for agreement")
    p.add_argument("--agreement-tokens", type=int, default=agreement_tokens,
                   help="target continuation length per prompt")
    p.add_argument("--live-prompts", type=int, default=4, help="prompts of the live τ runs (the first agreement ones)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="length of the live runs")
    p.add_argument("--reps", type=int, default=30, help="timed one-token steps (and product passes) per configuration")
    p.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench heads", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--sizes", default="4096,8192,16384,32768,full", help="head sizes K ('full': the whole head)")
    add_measure_args(p, agreement_per_task=2, agreement_tokens=64)
    a = p.parse_args(argv)
    sizes = _sizes(a.sizes)
    for k in sizes:
        if k < 0:
            raise ValueError(f"head size must be ≥ 1, got {k}")
    pair = load_pair(a.target, a.draft, "fp32", a.draft_tier, a.device, a.trust_remote_code)
    res = measure(pair, sizes, a.agreement_per_task, a.live_prompts, a.max_new_tokens, a.agreement_tokens, a.reps,
                  say=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res) if a.json else format_report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
