"""Whether a pair's decodes come out bitwise the same on one thread and on all the cores, which
the workbench needs before its decode turns may drop to one thread under CPU pressure
(engine/runtime/kernels/threads.py).

The probe runs what a turn runs, not a model call that stands for it: a trace (every proposer the
pair has drafting K_MAX tokens at each position, their entropies and confidences, the target's
plain steps, the acceptance probability of each first draft token at a temperature) and a
`fixed:4` run greedy and sampled (the target's verify of several rows, the draft's reads after a
partial acceptance, rejection sampling), once on one thread and once on all, and compares every
token and every recorded number but the clock's. The row-invariant CPU kernels
(engine/runtime/kernels/rowdot.py) split each read among the threads by output element, and the laws'
sums over the vocabulary go a block at a time (engine/oracles/sampling.law_sum), so a pair on
them passes by construction; a torch op that splits a reduction by thread count fails it, and
that pair's turns keep every core."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, ContextManager

import torch

from engine.decode.policies import make_policy
from engine.lab.generation import GenConfig, Generation, encode_prompt
from engine.lab.profiling import tracing
from engine.runtime.models import ModelPair

PROMPT = "List three facts about the moon, one per line."
NEW_TOKENS = 12  # enough steps for every proposer to draft past a rejection
TEMPERATURE = 0.8  # the sampled run's, and the trace's laws
TIMING = ("draft_ms", "verify_ms", "decide_ms")  # a step's clock readings, which differ on any rerun


def _decode(pair: ModelPair) -> Iterator[list[Any] | None]:
    """A trace and two fixed:4 runs of PROMPT, None after each step (where the workbench lets
    other decodes take their turns), then everything they computed except the clock."""
    out: list[Any] = []
    for item in tracing(pair, PROMPT, None, NEW_TOKENS, temperature=TEMPERATURE):
        if item is None:
            yield None
        else:
            out += [item.row["token_ids"], item.positions]
    ids = encode_prompt(pair.tokenizer, PROMPT, True)
    for temperature in (0.0, TEMPERATURE):
        gen = Generation(pair, ids, make_policy("fixed:4"),
                         GenConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=0))
        steps = []
        for rec in gen:
            steps.append({k: v for k, v in asdict(rec).items() if k not in TIMING})
            yield None
        out += [steps, gen.token_ids]
    yield out


def _on(pair: ModelPair, threads: int, cores: int, hold: Callable[[], ContextManager[Any]]) -> list[Any]:
    """_decode on `threads` intra-op threads, each step inside `hold()`. Between the steps the
    count is `cores` again: torch's setting is also the one new threads start from."""
    it = _decode(pair)
    while True:
        with hold():
            torch.set_num_threads(threads)
            try:
                item = next(it)
            finally:
                torch.set_num_threads(cores)
        if item is not None:
            return item


def thread_invariant(pair: ModelPair, cores: int,
                     hold: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> bool:
    """True when the pair decodes the same bits on one thread as on `cores` (CPU, torch engine,
    more than one core). Each step runs inside `hold()` (the workbench: its decode slot)."""
    if pair.engine != "torch" or pair.device.type != "cpu" or cores <= 1:
        return False
    return _on(pair, 1, cores, hold) == _on(pair, cores, cores, hold)
