"""The runs bench draft (bench/draft.py) times and checks: SpecLab's own (a policy on a pair), its
HF peers' (HF `generate`, assisted generation with our draft, prompt lookup; as shipped or through
SpecLab's kernels), an exactness check with prefix reuse on, and the draft model's teacher-forced
agreement and raw forward costs. Each runner maps (prompt ids, max new tokens) to (output ids,
steps or None, seconds)."""
from __future__ import annotations

import contextlib
import copy
import time
from typing import Callable

import torch

from engine.base.helpers import median_ms
from engine.decode.policies import PolicyContext
from engine.lab.generation import Generation
from engine.oracles.suffix import prompt_key
from engine.runtime.forward import forward_logits, sync_device
from engine.runtime.kernels.verify import stock_kernels
from engine.runtime.kv.cache import new_cache
from engine.runtime.models import ModelPair
from engine.service.generation import Request, open_generation

# HF assisted timed by default: HF's own schedule, within 2% of its best constant γ on the CPUs
# measured (docs/benchmarks.md); --hf-assisted constant:2,constant:4,heuristic times them all
HF_ASSISTED = ("heuristic",)
HF_ASSISTED_KNOWN = "constant:K (K tokens a step, no confidence stop), heuristic (HF's +2/−1 schedule from 4), " \
                    "default (HF's own defaults: 20 tokens, constant, dynamic confidence stop 0.4)"
HF_DEFAULTS = dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.4)
HF_STOCK = "hf_generate:stock"  # HF generate through torch's own linears, where the tier has other ones
KERNELS = "@kernels"  # an HF peer read through SpecLab's kernels instead of torch's


def check_hf_assisted(spec: str) -> None:
    kind, _, k = spec.partition(":")
    ok = (kind == "constant" and k.isdigit() and int(k) >= 1) or (spec in ("heuristic", "default"))
    if not ok:
        raise ValueError(f"unknown HF assisted setting {spec!r}; known: {HF_ASSISTED_KNOWN}")


# -- running ------------------------------------------------------------------------------------------
def _steps(g: Generation) -> list[tuple[int, int, int, str]]:
    """(k drafted, accepted, emitted, proposer) of each step after the prefill."""
    return [(r.k_drafted, r.accepted, r.emitted, r.proposer) for r in g.records[1:]]


def speclab_runner(pair: ModelPair, policy: str, ctx: PolicyContext | None, history=None) -> Callable:
    """`history`: the suffix history a run reads (frozen), read without the run's own prompt."""
    def run(ids: list[int], n: int) -> tuple[list[int], list | None, float]:
        seen = history.without(prompt_key(ids)) if history is not None else None
        gen = open_generation(pair, Request("", policy, max_new_tokens=n), context=ctx, prompt_ids=ids, history=seen)
        sync_device(pair.device)
        t0 = time.perf_counter()
        gen.run()
        sync_device(pair.device)
        return gen.token_ids, _steps(gen), time.perf_counter() - t0
    return run


def hf_assistant(pair: ModelPair) -> torch.nn.Module:
    """The draft as HF assisted generation gets it: HF's own forward (a copy without the
    row-invariant reads SpecLab's live runs need)."""
    from engine.runtime import invariance
    from engine.runtime.kernels import rowdot

    if not pair.draft_row_invariant or rowdot.converted(pair.draft)[0]:
        # a row-by-row verify patch acts only inside SpecLab's verify; a draft on the kernels
        # reads HF's own modules and torch's linears under stock_kernels, where the peers run
        return pair.draft

    m = copy.deepcopy(pair.draft)
    invariance.undo_row_invariant(m)
    return m


def hf_runner(pair: ModelPair, setting: str, assistant: torch.nn.Module | None) -> Callable:
    from engine.service.export.formats import hf_bind, hf_generate_kwargs
    from engine.service.export.tuned_config import TunedConfig

    kind, _, arg = setting.removesuffix(KERNELS).partition(":")
    ours = setting == "hf_generate" or setting.endswith(KERNELS)

    def kwargs(n: int) -> dict:
        kw = dict(max_new_tokens=n, do_sample=False)
        if kind == "hf_assisted":
            if arg == "default":
                kw = hf_bind(dict(kw, assistant_model=None, **HF_DEFAULTS), assistant)
            else:
                policy = "heuristic" if arg == "heuristic" else f"fixed:{arg.split(':')[1]}"
                kw = hf_bind(hf_generate_kwargs(TunedConfig(policy=policy, max_new_tokens=n)), assistant)
        elif kind == "hf_lookup":
            kw["prompt_lookup_num_tokens"] = int(arg)
        return kw

    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.tokenizer.eos_token_id

    @torch.inference_mode()
    def run(ids: list[int], n: int) -> tuple[list[int], None, float]:
        x = torch.tensor([ids], device=pair.device)  # [1, S]
        kw = kwargs(n)  # binds the assistant's keys before the clock starts
        sync_device(pair.device)
        t0 = time.perf_counter()
        # HF generate reads the target as the tier loads it (its kernels: the exactness reference),
        # and so does an @kernels peer; every other peer runs as shipped, through torch's linears
        with contextlib.nullcontext() if ours else stock_kernels():
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), pad_token_id=pad, **kw)
        sync_device(pair.device)
        return out[0, len(ids):].tolist(), None, time.perf_counter() - t0
    return run


def reuse_check(pair: ModelPair, ctx: PolicyContext, policies: list[str], timed: list[list[int]],
                refs: list[list[int]], max_new: int, say: Callable[[str], None] = lambda m: None) -> dict:
    """`policies` (`ctx`: the setting's context) on every timed prompt with prefix reuse on, as a
    live run has it (one prefix cache across the prompts, which share the chat template's system
    prefix; the first prompt again at the end, an exact repeat), against HF generate's outputs:
    {identical_to_hf_generate: {policy: share}, reused_tokens}."""
    from engine.runtime.prefix.cache import PrefixCache

    identical, reused = {}, 0
    for policy in dict.fromkeys(policies):
        cache, same = PrefixCache(), 0
        for ids, ref in zip([*timed, timed[0]], [*refs, refs[0]]):
            gen = open_generation(pair, Request("", policy, max_new_tokens=max_new), context=ctx, prompt_ids=ids,
                                  prefix=cache)
            gen.run()
            same += gen.token_ids == ref
            reused += gen.summary.reused_tokens
        identical[policy] = same / (len(timed) + 1)
    say(f"  prefix reuse on: identical to HF generate {identical}, {reused} tokens reused")
    return dict(identical_to_hf_generate=identical, reused_tokens=reused)


# -- the draft model's teacher-forced agreement and raw forward costs -------------------------------
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
    """Median ms of a one-token forward after `ids` as a plain step reads it (forward_logits: the
    fused read where the target has one), cache rolled back each time."""
    _, cache = forward_logits(model, ids, new_cache(model), 1)

    def once() -> None:
        forward_logits(model, [ids[-1]], cache, 1)
        cache.crop(-1)

    return median_ms(once, n, warmup=3, sync=lambda: sync_device(device))


@torch.inference_mode()
def draft_step_ms(pair: ModelPair, ids: list[int], n: int = 24) -> float:
    """Median ms of one draft step as the proposer takes it (oracles/draft.draft_read: the pair's
    default head, the row-invariant read), after `ids`, cache rolled back each time."""
    from engine.oracles.draft import draft_read
    from engine.runtime.forward import crop_to
    from engine.runtime.vocab_head import sub_head

    head = sub_head(pair, pair.draft_vocab) if pair.draft_vocab else None
    _, cache = draft_read(pair, ids, None, head)

    def once() -> None:
        draft_read(pair, [ids[-1]], cache, head)
        crop_to(cache, len(ids))

    return median_ms(once, n, warmup=3, sync=lambda: sync_device(pair.device))
