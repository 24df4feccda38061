"""A live generation: the model-backed oracles under the one step loop (engine/decode/step.py), with
the clock on the wall. Also the prompt encoding and the `runs` row a finished run leaves."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from engine.base.names import check_kv_tier
from engine.decode.policies import Policy
from engine.decode.records import RunSummary, StepRecord
from engine.decode.step import Setting, decode, summarize
from engine.decode.tree import budget_tree_shape
from engine.oracles import build, check_proposers, target_verifier
from engine.oracles.sampling import Sampler
from engine.oracles.suffix import SuffixHistory, prompt_key
from engine.runtime.forward import WallClock
from engine.runtime.kv.calibration import CodecKit
from engine.runtime.kv.offload import Offloaded, SlowTier
from engine.runtime.models import ModelPair, pair_device
from engine.runtime.prefix.cache import PrefixCache


@dataclass(frozen=True)
class GenConfig:
    max_new_tokens: int = 128  # generated tokens, EOS included
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling
    top_p: float = 1.0  # nucleus filter applied to both q and p before acceptance
    seed: int | None = None  # sampling seed; drawn (and recorded with the run) when None
    kv_tier: str = "native"  # the target's KV cache tier: native, fp8, int8 (engine/runtime/kv/tiers.py)
    reuse: bool = True  # take the longest stored prefix from the prefix cache (when a run has one)

    def validate(self, engine: str = "torch") -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_kv_tier(self.kv_tier, engine)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise ValueError("the prompt is empty")
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation ({"role", "content"} messages) through the chat template, ready for the
    assistant's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat asked for, but this tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_tree_run(pair: ModelPair, policy: str, nodes: int, width: int, others: list[str]) -> None:
    """A tree policy's run, before any model runs: a shape the vocabulary allows, proposers that
    grow trees, a target engine that verifies them; else one ValueError line."""
    budget_tree_shape(nodes, width, pair.vocab_size)
    if others:
        raise ValueError(f"policy {policy} grows token trees with the draft model only, not {', '.join(others)}")
    if pair.engine != "torch":
        raise ValueError(f"the {pair.engine} engine verifies chains only: run {policy} on torch")


@dataclass
class Generation:
    """One generation. Iterate it to stream `StepRecord`s; afterwards `summary`, `token_ids`
    and `records` hold the run."""

    pair: ModelPair
    prompt_ids: list[int]
    policy: Policy
    cfg: GenConfig = field(default_factory=GenConfig)
    prefix: PrefixCache | None = None  # the process's cross-request cache (shared by sessions)
    # The cross-request history the suffix proposer reads: a live one is read through a snapshot
    # taken as the run starts and is fed this run's output at its end; a frozen one (a snapshot,
    # `without`) is only read (Compare gives every policy the same one). None: no history.
    history: SuffixHistory | None = None
    seed: int | None = field(init=False)  # cfg.seed, or the one drawn for a sampling run
    token_ids: list[int] = field(init=False, default_factory=list)
    records: list[StepRecord] = field(init=False, default_factory=list)
    summary: RunSummary | None = field(init=False, default=None)
    kv_bytes_per_token: int | None = field(init=False, default=None)  # what the target's cache held, per token
    proposers: tuple[str, ...] = field(init=False, default=())  # the run's proposers (the policy's, or all the pair has)
    _verifier: object | None = field(init=False, default=None, repr=False)  # the run's target verifier

    def __post_init__(self) -> None:
        self.cfg.validate(self.pair.engine)
        if not self.prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if len(self.prompt_ids) >= self.pair.max_context:
            raise ValueError(f"the prompt is {len(self.prompt_ids)} tokens, over the target's context of "
                             f"{self.pair.max_context}")
        # Checked here, before any model runs: a proposer the pair cannot run is a ValueError.
        self.proposers = check_proposers(self.pair, getattr(self.policy, "proposers", None))
        if (growers := getattr(self.policy, "tree_proposers", None)) is not None:  # a policy that drafts token trees
            check_tree_run(self.pair, self.policy.name, self.policy.nodes, self.policy.width,
                           [p for p in self.proposers if p not in growers])
        self.seed = self.cfg.seed
        if self.seed is None and self.cfg.temperature > 0:
            self.seed = random.randrange(2**31)

    def __iter__(self) -> Iterator[StepRecord]:
        assert not self.records, "a Generation runs once; make a new one"
        pair, cfg, n_prompt = self.pair, self.cfg, len(self.prompt_ids)
        sampler = Sampler(cfg.temperature, cfg.top_p, self.seed, pair.device)
        prefix = self.prefix if cfg.reuse else None
        verifier = target_verifier(pair, self.prompt_ids, sampler, prefix, cfg.kv_tier)  # the draft's cache stays native
        self._verifier = verifier
        seen = self.history.snapshot() if self.history is not None else None  # what this run's proposals read
        proposers = build(pair, self.prompt_ids, sampler, verifier, self.proposers,
                          getattr(self.policy, "proposer_options", None), seen)
        budget = min(cfg.max_new_tokens, pair.max_context - n_prompt)
        clock = WallClock(pair.device)
        t_start, paused = clock(), 0.0
        # The run's wall time is its own: while the consumer holds it paused at a yield (another
        # session's step in the decode slot, an offload) the clock does not count for it.
        with torch.inference_mode():
            try:
                for rec in decode(proposers, verifier, self.policy, Setting(n_prompt, budget, pair.target_tier, cfg.kv_tier), clock):
                    self.records.append(rec)
                    self.token_ids.extend(rec.token_ids)
                    t_yield = clock()
                    yield rec
                    paused += clock() - t_yield
            except GeneratorExit:  # the consumer stopped early (a Stop button): what ran is a run too
                if self.records:
                    self.summary = summarize(self.records, clock() - t_start - paused, "stopped", verifier.hit.kind)
                raise
            wall_ms = clock() - t_start - paused
            verifier.ensure_cache()  # paused after its last token: the cache is still away
            self.kv_bytes_per_token = verifier.held_bytes_per_token()
            if prefix is not None:  # after the clock: storing is for the next request
                draft = proposers.get("draft")
                verifier.remember(draft.cache if draft is not None else None)
            proposers = seen = None  # the snapshot released: feeding the history need not copy its trie
            if self.history is not None and not self.history.frozen:
                self.history.add(prompt_key(self.prompt_ids), self.token_ids)
        stop = "eos" if verifier.ended else "max_new_tokens" if budget == cfg.max_new_tokens else "context"
        self.summary = summarize(self.records, wall_ms, stop, verifier.hit.kind)

    def offload(self, slow: SlowTier, window: int, kit: CodecKit | None = None) -> Offloaded:
        """Pauses a generation between two steps (after a record was yielded): its target KV
        moves to `slow` window by window, coded with `kit` if given, and is restored, pipelined,
        when iteration resumes. Greedy output is the same as an uninterrupted run's."""
        if self._verifier is None or self._verifier.cache is None or self.summary is not None:
            raise ValueError("only a running generation, paused between steps, can offload its KV")
        return self._verifier.offload(slow, window, kit, name=f"gen{id(self):x}")

    def run(self) -> "Generation":
        """Run to the end without streaming."""
        for _ in self:
            pass
        return self


def run_row(gen: Generation, prompt: str, policy_spec: str, chat: bool, task: str | None = None) -> dict:
    """The `runs` row for a finished generation (the store's schema)."""
    s, pair, cfg = gen.summary, gen.pair, gen.cfg
    assert s is not None, "the generation has not run"
    return dict(
        target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
        kv_tier=cfg.kv_tier, device=pair_device(pair), policy=policy_spec, prompt=prompt, task=task,
        chat=chat, temperature=cfg.temperature, top_p=cfg.top_p, seed=gen.seed,
        max_new_tokens=cfg.max_new_tokens,
        output=pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True),
        token_ids=list(gen.token_ids), n_tokens=s.n_tokens, n_steps=s.n_steps,
        tokens_per_s=s.tokens_per_s, ttft_ms=s.ttft_ms, wall_ms=s.wall_ms,
        tokens_per_step=s.tokens_per_step, mean_accepted=s.mean_accepted,
        acceptance_rate=s.acceptance_rate, stop_reason=s.stop_reason, error=None,
        reused_tokens=s.reused_tokens, prefix_hit=s.prefix_hit, engine=pair.engine,
        config=dict(asdict(cfg), seed=gen.seed, draft_tier=pair.draft_tier, n_prompt_tokens=len(gen.prompt_ids),
                    proposers=list(gen.proposers)),
    )
