"""How far speculative output strays from plain decoding at one tier.

Where the target's kernels are batch-invariant (fp32, bf16 on CPU) the two are identical. The
bitsandbytes int8/nf4 kernels are not: a (k+1)-token verify forward and k+1 one-token forwards
round differently, so a near-tie can flip. The engine stays exact with respect to its own verify
logits; this measures, per tier, what that costs against plain decoding."""
from __future__ import annotations

from dataclasses import dataclass

from engine.models import ModelPair
from engine.policies import make_policy
from engine.generation import Generation, GenConfig, encode_prompt


@dataclass
class Divergence:
    tier: str
    policy: str
    prompts: int
    identical_fraction: float  # prompts whose speculative output equals plain decoding
    first_divergence: list[int | None]  # per prompt: first differing position, None if identical
    tokens_compared: int


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(pair: ModelPair, prompts: list[str], policy: str, max_new_tokens: int) -> Divergence:
    cfg = GenConfig(max_new_tokens=max_new_tokens)
    firsts, compared = [], 0
    for prompt in prompts:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        plain = Generation(pair, ids, make_policy("ar"), cfg).run().token_ids
        spec = Generation(pair, ids, make_policy(policy), cfg).run().token_ids
        firsts.append(first_difference(plain, spec))
        compared += len(plain)
    same = sum(f is None for f in firsts)
    return Divergence(pair.target_tier, policy, len(prompts), same / len(prompts), firsts, compared)
