"""Profiling: acceptance traces and sweeps (DESIGN.md, "Acceptance traces and exact what-if replay").

A trace records, at every position p of the target's greedy output, what the draft would propose
from there: its k_max greedy tokens, their entropy/confidence, and L(p), how many of them match
the target's output. Under greedy decoding the output does not depend on γ, so any policy can be
replayed over a trace exactly (engine/whatif.py). The draft reads the prompt alone, then one
token at a time; a live run's catch-up reads several at once, which the draft's row-invariant
forward (engine/invariance.py) computes bit for bit alike."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from engine import signals
from engine.models import ModelPair
from engine.policies import K_MAX, make_policy
from engine.speculative import GenConfig, Generation, crop_to, encode_prompt, forward_logits, run_row, warp


@dataclass
class Trace:
    """One traced prompt: the `traces` row and its `trace_positions` rows (store/schema.py)."""

    row: dict
    positions: list[dict]


@torch.inference_mode()
def trace(pair: ModelPair, prompt: str, task: str | None = None, max_new_tokens: int = 128,
          chat: bool = True, k_max: int = K_MAX, temperature: float | None = None) -> Trace:
    """The target's greedy output for `prompt` and the draft's k_max-token proposals along it.
    With `temperature`, each position also gets Σ min(p, q) of the warped first-token laws (the
    acceptance probability speculative sampling would have there)."""
    ids = encode_prompt(pair.tokenizer, prompt, chat)
    gen = Generation(pair, ids, make_policy("ar"), GenConfig(max_new_tokens=max_new_tokens)).run()
    out = gen.token_ids  # [N], exactly what plain decoding emits
    q = _target_laws(pair, ids, out, temperature) if temperature else None
    _, cache = forward_logits(pair, pair.draft, ids, None, keep=1)
    positions = []
    for p in range(1, len(out)):  # out[0] comes from the prefill; steps start at position 1
        positions.append(_propose(pair, cache, ids, out, p, k_max, q, temperature))
        crop_to(cache, len(ids) + p)  # keep prompt + out[:p]; drop the proposal
    row = dict(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
               draft_tier=pair.draft_tier, device=str(pair.device), prompt=prompt, task=task, chat=chat,
               max_new_tokens=max_new_tokens, k_max=k_max, prompt_ids=ids, token_ids=out,
               stop_reason=gen.summary.stop_reason, config=dict(temperature=temperature))
    return Trace(row, positions)


def _propose(pair, cache, ids, out, p, k_max, q, temperature) -> dict:
    """The draft's greedy tokens from prompt + out[:p]; the cache has read all but out[p - 1]."""
    feed, drafted, ents, confs, first = [out[p - 1]], [], [], [], None
    for j in range(k_max):
        logits, cache = forward_logits(pair, pair.draft, feed, cache, keep=1)
        probs = torch.softmax(logits[0], dim=-1)  # as Generation._choose computes the signals
        x = int(logits[0].argmax())
        drafted.append(x), ents.append(float(signals.entropy_bits(probs))), confs.append(float(signals.confidence(probs)))
        first = logits[0] if j == 0 else first
        feed = [x]
    n = 0
    while n < len(drafted) and p + n < len(out) and drafted[n] == out[p + n]:
        n += 1
    accept_prob = None
    if q is not None:
        accept_prob = float(torch.minimum(warp(first, temperature, 1.0), q[p]).sum())
    return dict(position=p, accept_len=n, draft_ids=drafted, entropies=ents, confidences=confs,
                accept_prob=accept_prob, context_len=len(ids) + p)


def _target_laws(pair, ids, out, temperature) -> torch.Tensor:
    """q at every output position p (the law of out[p] given the prefix): [N, V]."""
    logits, _ = forward_logits(pair, pair.target, ids + out[:-1], None, keep=len(out))
    return warp(logits, temperature, 1.0)


# -- sweeps ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    tier: str
    task: str
    prompt: str
    policy: str


def sweep_jobs(prompts: Iterable[tuple[str, str]], tiers: list[str], policies: list[str]) -> list[Job]:
    """Tier-major (a tier's models load once), then prompt, then policy."""
    prompts = list(prompts)
    return [Job(t, task, p, pol) for t, (task, p), pol in itertools.product(tiers, prompts, policies)]


def run_job(pair: ModelPair, job: Job, context, max_new_tokens: int, chat: bool = True) -> tuple[dict, list[dict]]:
    """One live run of a sweep: its `runs` row and `steps` rows."""
    ids = encode_prompt(pair.tokenizer, job.prompt, chat)
    gen = Generation(pair, ids, make_policy(job.policy, context), GenConfig(max_new_tokens=max_new_tokens)).run()
    row = run_row(gen, job.prompt, job.policy, chat, job.task)
    return row, [asdict(r) for r in gen.records]


def pending(jobs: list[Job], done: set[tuple[str, str, str]]) -> list[Job]:
    """Jobs whose (tier, prompt, policy) has no stored run in this sweep yet: a rerun resumes."""
    return [j for j in jobs if (j.tier, j.prompt, j.policy) not in done]

