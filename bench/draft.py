"""How good is the draft, and does it pay? On the held-out prompts (never trained on), one run:

    agreement            teacher-forced greedy agreement with the target on its own responses
    mean_accepted_at_4   drafted tokens accepted per step, live `fixed:4`
    tokens_per_step_at_4 the same steps counted as EAGLE/Medusa papers count "acceptance length"
                         (τ): accepted drafted tokens plus the target's own token
    draft_cost_ratio     draft forward per token / target forward per token (same context)
    fixed:k vs ar        end-to-end tokens/s of fixed:1..6 against plain decoding

Run: python bench/draft.py [--json]   or   python -m engine bench draft [--json]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.args import add_model_args  # noqa: E402
from engine.kv.cache import new_cache  # noqa: E402
from engine.models import ModelPair, load_pair  # noqa: E402
from engine.policies import make_policy  # noqa: E402
from engine.prompts import heldout  # noqa: E402
from engine.common import median_ms  # noqa: E402
from engine.forward import sync_device  # noqa: E402
from engine.generation import Generation, GenConfig, encode_prompt  # noqa: E402


@torch.inference_mode()
def agreement(pair: ModelPair, prompt_ids: list[int], response: list[int]) -> tuple[int, int]:
    """(hits, positions): draft argmax == target's greedy token, along the target's response."""
    if not response:
        return 0, 0
    x = torch.tensor([prompt_ids + response[:-1]], device=pair.device)  # [1, S]
    logits = pair.draft(x, logits_to_keep=len(response)).logits[0, :, : pair.vocab_size]  # [R, V]
    guess = logits.argmax(-1).tolist()
    return sum(g == t for g, t in zip(guess, response)), len(response)


@torch.inference_mode()
def per_token_ms(model, ids: list[int], device: torch.device, n: int = 24) -> float:
    """Median ms of a one-token forward after `ids`, cache rolled back each time."""
    cache = new_cache(model)
    model(torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    x = torch.tensor([[ids[-1]]], device=device)

    def once() -> None:
        model(x, cache=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)

    return median_ms(once, n, warmup=3, sync=lambda: sync_device(device))


def measure(pair: ModelPair, per_task: int, max_new: int, ks: list[int]) -> dict:
    prompts = heldout()
    by_task: dict[str, list[int]] = {}  # task -> [hits, positions]
    for task, p in prompts:  # agreement on every held-out prompt: cheap, one forward each
        ids = encode_prompt(pair.tokenizer, p, chat=True)
        resp = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=max_new)).run().token_ids
        h, n = agreement(pair, ids, resp)
        tally = by_task.setdefault(task, [0, 0])
        tally[0], tally[1] = tally[0] + h, tally[1] + n
    hits, total = (sum(col) for col in zip(*by_task.values()))
    timed = [encode_prompt(pair.tokenizer, p, chat=True) for _, p in heldout(per_task)]
    ctx = timed[0] * 2  # a mid-length context for the cost probe
    draft_ms = per_token_ms(pair.draft, ctx, pair.device)
    target_ms = per_token_ms(pair.target, ctx, pair.device)
    policies = ["ar"] + [f"fixed:{k}" for k in ks]
    tokens = dict.fromkeys(policies, 0)
    seconds = dict.fromkeys(policies, 0.0)
    accepted, emitted = [], []
    Generation(pair, timed[0], make_policy("fixed:4"), GenConfig(max_new_tokens=8)).run()  # warm-up
    for i, ids in enumerate(timed):
        shift = i % len(policies)  # rotate the order: no policy always runs first
        for pol in policies[shift:] + policies[:shift]:
            g = Generation(pair, ids, make_policy(pol), GenConfig(max_new_tokens=max_new)).run()
            tokens[pol] += g.summary.n_tokens
            seconds[pol] += g.summary.wall_ms / 1e3
            if pol == "fixed:4":
                accepted += [r.accepted for r in g.records[1:] if r.k_drafted]
                emitted += [r.emitted for r in g.records[1:] if r.k_drafted]
    tok_s = {p: tokens[p] / seconds[p] for p in policies}
    best = max((p for p in policies if p != "ar"), key=tok_s.get)
    return dict(
        agreement=hits / max(total, 1), agreement_positions=total,
        agreement_by_task={t: h / max(n, 1) for t, (h, n) in by_task.items()},
        mean_accepted_at_4=sum(accepted) / max(len(accepted), 1),
        tokens_per_step_at_4=sum(emitted) / max(len(emitted), 1),
        draft_ms=draft_ms, target_ms=target_ms, draft_cost_ratio=draft_ms / target_ms,
        tok_s=tok_s, best_fixed_k=int(best.split(":")[1]), best_fixed_vs_ar=tok_s[best] / tok_s["ar"],
        fixed_vs_ar={p: tok_s[p] / tok_s["ar"] for p in policies if p != "ar"},
        heldout_prompts=len(prompts), timed_prompts=len(timed), max_new_tokens=max_new,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench draft", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompts-per-task", type=int, default=3, help="held-out prompts per task for timing")
    p.add_argument("--ks", default="1,2,3,4,5,6", help="fixed γ values to time against ar")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    res = measure(pair, a.prompts_per_task, a.max_new_tokens, [int(k) for k in a.ks.split(",")])
    res.update(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
               draft_tier=pair.draft_tier, device=str(pair.device), threads=torch.get_num_threads())
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{pair.target_name} ({pair.target_tier}) + {pair.draft_name} ({pair.draft_tier}) on {pair.device}")
    print(f"  agreement {res['agreement']:.3f} over {res['agreement_positions']} held-out positions ("
          + ", ".join(f"{t} {a:.3f}" for t, a in res["agreement_by_task"].items()) + ")")
    print(f"  mean accepted at γ=4 {res['mean_accepted_at_4']:.2f} drafted tokens per step "
          f"({res['tokens_per_step_at_4']:.2f} tokens per step with the target's own, τ)")
    print(f"  draft {res['draft_ms']:.2f} ms/token vs target {res['target_ms']:.2f}: ratio {res['draft_cost_ratio']:.3f}")
    for pol, r in res["fixed_vs_ar"].items():
        print(f"  {pol:8} {res['tok_s'][pol]:6.2f} tok/s  vs ar {res['tok_s']['ar']:6.2f}: {r:.3f}")
    print(f"  best fixed γ = {res['best_fixed_k']} ({res['best_fixed_vs_ar']:.3f}× ar)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
