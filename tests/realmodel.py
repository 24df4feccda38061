"""What the embedded-pair tests share (tests/test_real_model*.py): the prompts, HF's greedy
output, the top-2 margin that excuses a near tie, and each policy's live run (made once per
tier, task and policy, then read by every test that checks it)."""
from __future__ import annotations

import torch

from engine.datasets.prompts import bench_prompts
from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from tiny import synthetic_context

MAX_NEW = 32
NEAR_TIE = 1e-4  # top-2 logit margin under which fp rounding may pick either token
PROMPTS = bench_prompts(1)  # one each of code, math, chat, summarization
TASK_PROMPTS = dict(PROMPTS)


def hf_greedy(pair, ids, n):
    x = torch.tensor([ids])
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def margin(pair, ids, prefix):
    """Top-2 logit margin of the target (fp32 copy of the same weights) after ids + prefix."""
    with torch.inference_mode():
        logits = pair.target(torch.tensor([ids + prefix])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


Run = tuple[list[int], list[tuple[int, int, int, int]]]  # token ids; per step (k chosen, drafted, accepted, emitted)
_RUNS: dict[tuple[str, str, str], Run] = {}


def live_run(pair, task: str, policy: str) -> Run:
    """`policy`'s greedy run of MAX_NEW tokens on `task`'s prompt (chat template, synthetic
    context), made once per tier: the greedy-identity test and the replay test read the same run."""
    key = (pair.target_tier, task, policy)
    if key not in _RUNS:
        ids = encode_prompt(pair.tokenizer, TASK_PROMPTS[task], chat=True)
        g = Generation(pair, ids, make_policy(policy, synthetic_context()), GenConfig(max_new_tokens=MAX_NEW)).run()
        _RUNS[key] = g.token_ids, [(r.k_chosen, r.k_drafted, r.accepted, r.emitted) for r in g.records[1:]]
    return _RUNS[key]
