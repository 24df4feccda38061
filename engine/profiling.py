"""Measuring a pair: acceptance traces, cost tables, and profiling sweeps, all through the
model-backed oracles a live run uses (docs/architecture.md, "Traces and replay", "Costs").

A trace records, at every position p of the target's greedy output, what the draft proposes
from there: its k_max greedy tokens, their entropy/confidence, and L(p), how many of them match
the output. The draft reads the prompt alone, then one token at a time; a live run's catch-up
reads several at once, which the draft's row-invariant forward computes bit for bit alike, so
any policy replays over a trace exactly (engine/whatif.py)."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from engine.common import median_ms, medians_ms
from engine.costs import CONTEXT_BUCKETS, REPS, WARMUP, CostTable
from engine.forward import crop_to, forward_logits, sync_device
from engine.kv.cache import new_cache
from engine.generation import GenConfig, Generation, encode_prompt, run_row
from engine.models import ModelPair
from engine.oracles.model import DraftModelProposer, TargetVerifier, draft_read, target_reads
from engine.prefix_cache import fill, kv_of
from engine.policies import K_MAX, make_policy
from engine.records import DraftToken
from engine.sampling import Sampler, warp


@dataclass
class Trace:
    """One traced prompt: the `traces` row and its `trace_positions` rows (store/schema.py)."""

    row: dict
    positions: list[dict]


def _always(j: int, token: DraftToken) -> bool:
    return True


@torch.inference_mode()
def trace(pair: ModelPair, prompt: str, task: str | None = None, max_new_tokens: int = 128,
          chat: bool = True, k_max: int = K_MAX, temperature: float | None = None,
          kv_tier: str = "native") -> Trace:
    """The target's greedy output for `prompt` (its KV cache at `kv_tier`) and the draft's
    k_max-token proposals along it. With `temperature`, each position also gets Σ min(p, q) of
    the warped first-token laws (the acceptance probability speculative sampling would have there)."""
    ids = encode_prompt(pair.tokenizer, prompt, chat)
    gen = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=max_new_tokens, kv_tier=kv_tier)).run()
    out = gen.token_ids  # [N], exactly what plain decoding emits at this KV tier
    q = _target_laws(pair, ids, out, temperature, kv_tier) if temperature else None  # [N, V]
    proposer = DraftModelProposer(pair, ids, Sampler(0.0, 1.0, None, pair.device))
    proposer.update(0, out[:1])
    positions = []
    for p in range(1, len(out)):  # out[0] comes from the prefill; steps start at position 1
        drafted = proposer.propose(k_max, _always)
        n = 0
        while n < len(drafted) and p + n < len(out) and drafted[n].token_id == out[p + n]:
            n += 1
        accept_prob = None
        if q is not None:  # the draft's greedy law p = softmax(logits); warped: ∝ p^(1/T)
            p_warped = torch.softmax(torch.log(drafted[0].p) / temperature, dim=-1)
            accept_prob = float(torch.minimum(p_warped, q[p]).sum())
        positions.append(dict(position=p, accept_len=n, draft_ids=[d.token_id for d in drafted],
                              entropies=[d.entropy for d in drafted], confidences=[d.confidence for d in drafted],
                              accept_prob=accept_prob, context_len=len(ids) + p))
        proposer.update(0, out[p : p + 1])  # the proposal is dropped; the output moves on
    row = dict(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
               draft_tier=pair.draft_tier, kv_tier=kv_tier, device=str(pair.device), prompt=prompt, task=task, chat=chat,
               max_new_tokens=max_new_tokens, k_max=k_max, prompt_ids=ids, token_ids=out,
               stop_reason=gen.summary.stop_reason, config=dict(temperature=temperature))
    return Trace(row, positions)


def _target_laws(pair, ids, out, temperature, kv_tier: str = "native") -> torch.Tensor:
    """q at every output position p (the law of out[p] given the prefix): [N, V]."""
    with target_reads(pair, kv_tier)():
        logits, _ = forward_logits(pair.target, ids + out[:-1], new_cache(pair.target, kv_tier), len(out), pair.vocab_size)
    return warp(logits, temperature, 1.0)


@torch.inference_mode()
def measure_costs(pair: ModelPair, buckets: tuple[int, ...] = CONTEXT_BUCKETS, reps: int = REPS,
                  progress: Callable[[str], None] = lambda m: None, kv_tier: str = "native") -> CostTable:
    """Times the live oracles on a context of `bucket` random tokens: one drafted token (a draft
    forward, its law and signals), a verify of k = 0..8 drafted tokens (the target forward under
    the pair's verify mode, acceptance, roll-back), the target's prefill and the draft's catch-up
    reads (the bucket's tokens into an empty cache; K_MAX tokens after them); and filling a cache from the prefix cache, per position. Medians after warm-up.
    The target's cache is at `kv_tier`: its reads dequantize the context (the draft's stays native)."""
    dev = pair.device
    buckets = tuple(b for b in buckets if b + K_MAX + 2 <= pair.max_context) or (min(buckets),)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(0.0, 1.0, None, dev)
    sync = lambda: sync_device(dev)  # noqa: E731
    draft_ms, verify_ms, prefill_ms, cold_read_ms, warm_read_ms = [], [], [], [], []
    reads = target_reads(pair, kv_tier)

    def prefill(ids: list[int]) -> None:  # the target reads a prompt into an empty cache at the tier
        with reads():
            forward_logits(pair.target, ids, new_cache(pair.target, kv_tier), 1, pair.vocab_size)

    for b in buckets:
        progress(f"costs at context {b}")
        ids = torch.randint(0, pair.vocab_size, (b + 1 + K_MAX,), generator=gen).tolist()
        proposer = DraftModelProposer(pair, ids[:b], sampler)
        verifier = TargetVerifier(pair, ids[:b], sampler, kv_tier=kv_tier)
        verifier.prefill()
        verifier.rewind(b + 1)
        proposer.update(0, ids[b : b + 1])

        def draft_one() -> None:
            proposer.propose(1, _always)
            proposer.rewind(b, ids[b : b + 1])

        def warm_read() -> None:  # K_MAX tokens after the b-token cache, then back
            draft_read(pair, ids[b + 1 :], proposer.cache)
            crop_to(proposer.cache, b)

        def verify(k: int) -> None:
            verifier.verify([DraftToken(x, 0.0, 0.0) for x in ids[b + 1 : b + 1 + k]])
            verifier.rewind(b + 1)

        # In turns, so that a slow spell of the machine cannot make one k look cheaper than another.
        ms = medians_ms([draft_one, *(lambda k=k: verify(k) for k in range(K_MAX + 1)),
                         lambda: prefill(ids[:b]),
                         lambda: draft_read(pair, ids[:b], None), warm_read], reps, WARMUP, sync)
        draft_ms.append(ms[0])
        verify_ms.append(ms[1 : K_MAX + 2])
        prefill_ms.append(ms[-3])
        cold_read_ms.append(ms[-2])
        warm_read_ms.append(ms[-1] / K_MAX)
    stored = kv_of(verifier.cache, buckets[-1])
    fill_ms = median_ms(lambda: fill(new_cache(pair.target, kv_tier), stored, buckets[-1]), reps, WARMUP, sync) / buckets[-1]
    key = dict(device=str(dev), target=pair.target_name, draft=pair.draft_name,
               target_tier=pair.target_tier, draft_tier=pair.draft_tier, kv_tier=kv_tier)
    return CostTable(list(buckets), draft_ms, verify_ms, key, prefill_ms=prefill_ms, fill_ms=fill_ms,
                     cold_read_ms=cold_read_ms, warm_read_ms=warm_read_ms)


# -- sweeps ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    tier: str  # the target's weight tier
    task: str
    prompt: str
    policy: str
    kv_tier: str = "native"  # the target's KV cache tier

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What a stored run of the sweep is matched on: (tier, KV tier, prompt, policy)."""
        return (self.tier, self.kv_tier, self.prompt, self.policy)


def sweep_jobs(prompts: Iterable[tuple[str, str]], tiers: list[str], policies: list[str],
               kv_tiers: Iterable[str] = ("native",)) -> list[Job]:
    """Tier-major (a tier's models load once), then KV tier (a policy context per KV tier), then
    prompt, then policy."""
    prompts, kv_tiers = list(prompts), list(kv_tiers)
    return [Job(t, task, p, pol, kv) for t, kv, (task, p), pol in itertools.product(tiers, kv_tiers, prompts, policies)]


def run_job(pair: ModelPair, job: Job, context, max_new_tokens: int, chat: bool = True) -> tuple[dict, list[dict]]:
    """One live run of a sweep: its `runs` row and `steps` rows."""
    ids = encode_prompt(pair.tokenizer, job.prompt, chat)
    cfg = GenConfig(max_new_tokens=max_new_tokens, kv_tier=job.kv_tier)
    gen = Generation(pair, ids, make_policy(job.policy, context), cfg).run()
    row = run_row(gen, job.prompt, job.policy, chat, job.task)
    return row, [asdict(r) for r in gen.records]


def pending(jobs: list[Job], done: set[tuple[str, str, str, str]]) -> list[Job]:
    """Jobs whose (tier, KV tier, prompt, policy) has no stored run in this sweep yet: a rerun resumes."""
    return [j for j in jobs if j.key not in done]

