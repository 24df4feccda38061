"""Decode speed against peers measured in the same run, same models, dtype and threads:

    engine `ar`      vs  HF `generate` (greedy)
    engine `fixed:4` vs  HF assisted generation (same draft, 4 tokens, constant schedule)

Run: python bench/decode.py [--json]   or   python -m engine bench decode [--json]
Prints ratios (> 1: the engine is faster); never asserts an absolute time."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

from engine.base.flags import add_model_args
from engine.datasets.prompts import bench_prompts
from engine.lab.generation import encode_prompt
from engine.runtime.forward import sync_device
from engine.runtime.kernels.verify import stock_kernels
from engine.runtime.models import ModelPair, load_pair
from engine.service.generation import Request, open_generation


def _hf(pair: ModelPair, ids: list[int], max_new: int, assisted: bool) -> list[int]:
    x = torch.tensor([ids], device=pair.device)  # [1, S]
    kw = dict(assistant_model=pair.draft) if assisted else {}
    with stock_kernels():  # HF as shipped: its verify reads through torch's own linears
        out = pair.target.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
            pad_token_id=pair.tokenizer.pad_token_id or pair.tokenizer.eos_token_id, **kw,
        )
    return out[0, len(ids):].tolist()


def _engine(pair: ModelPair, ids: list[int], max_new: int, policy: str) -> list[int]:
    return open_generation(pair, Request("", policy, max_new_tokens=max_new), context=None,
                           prompt_ids=ids).run().token_ids


def _constant_schedule(draft: torch.nn.Module, k: int) -> None:
    """HF assisted generation at a fixed γ: no +2/−1 schedule, no confidence early stop."""
    gc = draft.generation_config
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


METHODS = {
    "hf_generate": lambda pair, ids, n: _hf(pair, ids, n, assisted=False),
    "ar": lambda pair, ids, n: _engine(pair, ids, n, "ar"),
    "hf_assisted": lambda pair, ids, n: _hf(pair, ids, n, assisted=True),
    "fixed4": lambda pair, ids, n: _engine(pair, ids, n, "fixed:4"),
}


def measure(pair: ModelPair, prompts: list[str], max_new: int, reps: int) -> dict:
    encoded = [encode_prompt(pair.tokenizer, p, chat=True) for p in prompts]
    _constant_schedule(pair.draft, 4)
    for fn in METHODS.values():  # warm-up: first-call allocations and lazy inits off the clock
        fn(pair, encoded[0], 8)
    tokens = dict.fromkeys(METHODS, 0)
    seconds = dict.fromkeys(METHODS, 0.0)
    outputs: dict[str, list[list[int]]] = {m: [] for m in METHODS}
    names = list(METHODS)
    with torch.inference_mode():
        for r in range(reps):
            for i, ids in enumerate(encoded):
                # Rotate the order so no method always runs on a cooler or warmer machine.
                shift = (r + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    sync_device(pair.device)
                    t0 = time.perf_counter()
                    out = METHODS[name](pair, ids, max_new)
                    sync_device(pair.device)
                    seconds[name] += time.perf_counter() - t0
                    tokens[name] += len(out)
                    if r == 0:
                        outputs[name].append(out)
    tok_s = {m: tokens[m] / seconds[m] for m in METHODS}
    return dict(
        ar_tok_s=tok_s["ar"],
        hf_generate_tok_s=tok_s["hf_generate"],
        ar_vs_hf_generate=tok_s["ar"] / tok_s["hf_generate"],
        fixed4_tok_s=tok_s["fixed4"],
        hf_assisted_tok_s=tok_s["hf_assisted"],
        fixed4_vs_hf_assisted=tok_s["fixed4"] / tok_s["hf_assisted"],
        ar_identical_to_hf=outputs["ar"] == outputs["hf_generate"],
        fixed4_identical_to_hf=outputs["fixed4"] == outputs["hf_generate"],
        hf_assisted_identical_to_hf=outputs["hf_assisted"] == outputs["hf_generate"],
        tokens=tokens,
    )


VERIFY_ROWS = (1, 2, 3, 4, 5, 7, 9)  # a plain step, then verify reads of γ = 1 … 8


def verify_costs(pair: ModelPair, reps: int, context: int = 80) -> dict[int, dict[str, float]]:
    """Median ms of one target read of `rows` tokens after a `context`-token cache, with the
    engine's few-row kernels (runtime/kernels/verify.py) and with torch's stock linears,
    interleaved rep by rep so both see the same machine."""
    import statistics

    from engine.runtime import invariance
    from engine.runtime.forward import crop_to, forward_logits

    ids = list(range(100, 100 + context + max(VERIFY_ROWS)))
    _, cache = forward_logits(pair.target, ids[:context], None, 1)
    ms: dict[tuple[int, bool], list[float]] = {}
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first round warms caches and oneDNN's reorders
            for rows in VERIFY_ROWS:
                for stock in (False, True):
                    # as the verifier reads: batch-invariant at an exact tier (runtime/invariance.py)
                    with stock_kernels() if stock else contextlib.nullcontext(), \
                            invariance.verifying() if pair.exact_verify else contextlib.nullcontext():
                        sync_device(pair.device)
                        t0 = time.perf_counter()
                        forward_logits(pair.target, ids[context:context + rows], cache, rows)
                        sync_device(pair.device)
                        ms.setdefault((rows, stock), []).append((time.perf_counter() - t0) * 1e3)
                    crop_to(cache, context)
    med = {key: statistics.median(v[1:]) for key, v in ms.items()}
    step = med[1, True]  # HF's one-token step: the unit a verify is priced in
    return {rows: dict(stock_ms=med[rows, True], fast_ms=med[rows, False], stock_vs_step=med[rows, True] / step,
                       fast_vs_step=med[rows, False] / step) for rows in VERIFY_ROWS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench decode", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts-per-task", type=int, default=1, help="4 tasks: code, math, chat, summarization")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads for every method")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    prompts = [prompt for _, prompt in bench_prompts(a.prompts_per_task)]
    res = measure(pair, prompts, a.max_new_tokens, a.reps)
    res["verify_costs"] = verify_costs(pair, max(5, 3 * a.reps))
    res.update(
        target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
        draft_tier=pair.draft_tier, device=str(pair.device), threads=torch.get_num_threads(),
        prompts=len(prompts), reps=a.reps, max_new_tokens=a.max_new_tokens,
    )
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{pair.target_name} ({pair.target_tier}) + draft {pair.draft_name} ({pair.draft_tier}) "
              f"on {pair.device}, {res['threads']} threads, {len(prompts)} prompts × {a.reps}")
        print(f"  engine ar      {res['ar_tok_s']:7.2f} tok/s   HF generate {res['hf_generate_tok_s']:7.2f}"
              f"   ratio {res['ar_vs_hf_generate']:.3f}   identical {res['ar_identical_to_hf']}")
        print(f"  engine fixed:4 {res['fixed4_tok_s']:7.2f} tok/s   HF assisted {res['hf_assisted_tok_s']:7.2f}"
              f"   ratio {res['fixed4_vs_hf_assisted']:.3f}   identical {res['fixed4_identical_to_hf']}")
        print(f"  target read of k+1 rows, × a one-token step ({pair.fast_verify_linears} linears on few-row kernels)")
        for rows, c in res["verify_costs"].items():
            print(f"    {rows} rows: torch {c['stock_ms']:6.1f} ms ({c['stock_vs_step']:.2f}×)   "
                  f"engine {c['fast_ms']:6.1f} ms ({c['fast_vs_step']:.2f}×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
