"""How far speculative output strays from plain decoding at one tier, and output with prefix
reuse from output without.

Where the target's kernels are batch-invariant (fp32, bf16 on CPU) the two are identical. The
bitsandbytes int8/nf4 kernels are not: a (k+1)-token verify forward and k+1 one-token forwards
round differently, so a near-tie can flip. The engine stays exact with respect to its own verify
logits; this measures, per tier, what that costs against plain decoding. Prefix reuse reads a
prompt's tail after positions another request's batches computed: the same question."""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.base.helpers import first_difference
from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_messages, encode_prompt
from engine.runtime.models import ModelPair
from engine.runtime.prefix.cache import PrefixCache


@dataclass
class Divergence:
    tier: str
    policy: str
    prompts: int
    identical_fraction: float  # prompts whose speculative output equals plain decoding
    first_divergence: list[int | None]  # per prompt: first differing position, None if identical
    tokens_compared: int
    reuse_identical_fraction: float  # prompts whose follow-up, reusing the prompt's KV, equals it recomputed
    reuse_first_divergence: list[int | None]


FOLLOW_UP = "Now say it again in fewer words."


def measure(pair: ModelPair, prompts: list[str], policy: str, max_new_tokens: int) -> Divergence:
    cfg = GenConfig(max_new_tokens=max_new_tokens)

    def output(ids: list[int], spec: str = policy, prefix: PrefixCache | None = None, reuse: bool = True) -> list[int]:
        return Generation(pair, ids, make_policy(spec), replace(cfg, reuse=reuse), prefix=prefix).run().token_ids

    firsts, reuse_firsts, compared = [], [], 0
    for prompt in prompts:
        ids = encode_prompt(pair.tokenizer, prompt, chat=True)
        plain = output(ids, "ar")
        firsts.append(first_difference(plain, output(ids)))
        compared += len(plain)
        # A second turn re-sending the first: with reuse it reads only what the first run did not.
        turn = encode_messages(pair.tokenizer, [{"role": "user", "content": prompt},
                                                {"role": "assistant", "content": pair.tokenizer.decode(plain, skip_special_tokens=True)},
                                                {"role": "user", "content": FOLLOW_UP}])
        cache = PrefixCache()
        output(ids, prefix=cache)  # the first turn, stored for the second to reuse
        reused = output(turn, prefix=cache)
        reuse_firsts.append(first_difference(output(turn, reuse=False), reused))
    n = len(prompts)
    return Divergence(pair.target_tier, policy, n, sum(f is None for f in firsts) / n, firsts, compared,
                      sum(f is None for f in reuse_firsts) / n, reuse_firsts)
