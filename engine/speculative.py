"""The decode loop: a policy picks γ, the draft proposes γ tokens, the target verifies them in one
forward, and both KV caches roll back to what was accepted (DESIGN.md, "The decode step").

Notation as in gpt-fast: `q` is the target's distribution, `p` the draft's."""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from engine import invariance, signals
from engine.kv import new_cache
from engine.models import KV_TIERS, ModelPair
from engine.policies import Policy
from engine.records import AcceptanceEWMA, Action, DecodeState, DraftToken, RunSummary, StepRecord


@dataclass
class GenConfig:
    max_new_tokens: int = 128  # generated tokens, EOS included
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling
    top_p: float = 1.0  # nucleus filter applied to both q and p before acceptance
    seed: int | None = None  # sampling seed; drawn and recorded when None, so a run reproduces
    kv_tier: str = "native"  # KV cache tier (only `native` until the KV codec lands)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.kv_tier not in KV_TIERS:
            raise ValueError(f"unknown KV tier {self.kv_tier!r}; available: {', '.join(KV_TIERS)}")


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not prompt:
        raise ValueError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat asked for, but this tokenizer has no chat template")
        msgs = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def sync_device(device: torch.device) -> None:
    # CUDA runs asynchronously: read a clock only once the queued kernels are done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms_since(t0: float, device: torch.device) -> float:
    sync_device(device)
    return (time.perf_counter() - t0) * 1e3


def crop_to(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    assert extra >= 0, (cache.get_seq_length(), length)
    if extra:
        cache.crop(-extra)  # transformers ≥ 5: a negative count removes that many trailing tokens


def forward_logits(pair: ModelPair, model, ids: list[int], cache, keep: int) -> tuple[torch.Tensor, object]:
    """Logits [keep, V] (float32, shared vocab) for the last `keep` of `ids`, and the cache."""
    x = torch.tensor([ids], device=pair.device)  # [B=1, S]
    if cache is None:
        cache = new_cache(model)
    rows: int | torch.Tensor = keep
    if model is pair.draft and keep < len(ids):
        # HF slices the kept rows out of [1, S, H] as a strided view; matmul then takes a bmm path
        # that copies the whole transposed LM head (49152 × 576) first: 40 ms for a 2-token read
        # whose one-token twin takes 6. Indexing yields a contiguous row: the plain mm path.
        rows = torch.arange(len(ids) - keep, len(ids), device=pair.device)
    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=rows)
    return out.logits[0, :, : pair.vocab_size].float(), out.cache  # [keep, V]


def draft_read(pair: ModelPair, feed: list[int], cache) -> tuple[torch.Tensor, object]:
    """The draft reads tokens it has not seen. Its state at a position must never depend on the
    path (the policy) that led there: what makes the acceptance traces replay live runs exactly
    (engine/profiling.py). A row-invariant draft reads them in chunks the load-time probe
    checked; any other reads them batch-invariant, row by row (engine/invariance.py)."""
    if not pair.draft_row_invariant:
        with invariance.verifying() if len(feed) > 1 else contextlib.nullcontext():
            return forward_logits(pair, pair.draft, feed, cache, keep=1)
    for i in range(0, len(feed), invariance.CATCHUP_ROWS):
        logits, cache = forward_logits(pair, pair.draft, feed[i : i + invariance.CATCHUP_ROWS], cache, keep=1)
    return logits, cache


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution from logits [..., V]: temperature, then top-p (as HF's warpers)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # A token stays while the mass before it is < top_p; the most likely one always stays.
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def greedy_accept(draft: list[int], q_argmax: list[int]) -> tuple[int, int]:
    """Accepted count n and the target's token at the first mismatch (or the bonus token).

    q_argmax[i] is the target's choice after the context plus draft[:i]; len = len(draft) + 1."""
    n = 0
    while n < len(draft) and draft[n] == q_argmax[n]:
        n += 1
    return n, q_argmax[n]


def rejection_sample(
    draft: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p: [k, V] draft distributions the tokens were sampled from; q: [k+1, V] target's.
    Token i is accepted with probability min(1, q_i(x)/p_i(x)); on the first rejection the
    replacement comes from norm(max(0, q_i − p_i)); if all k pass, a bonus token from q_k.
    The emitted tokens are then distributed exactly as the target's own samples."""
    k = len(draft)
    u = torch.rand(k, generator=gen, device=q.device)
    for i, x in enumerate(draft):
        if u[i] * p[i, x] <= q[i, x]:  # u < q/p without dividing by a tiny p
            continue
        residual = (q[i] - p[i]).clamp_min(0.0)
        total = residual.sum()
        # q == p up to rounding leaves no residual mass; then q itself is the right law.
        dist = residual / total if total > 0 else q[i]
        return i, int(torch.multinomial(dist, 1, generator=gen))
    return k, int(torch.multinomial(q[k], 1, generator=gen))


@dataclass
class Generation:
    """One generation. Iterate it to stream `StepRecord`s; afterwards `summary`, `token_ids`
    and `records` hold the run."""

    pair: ModelPair
    prompt_ids: list[int]
    policy: Policy
    cfg: GenConfig = field(default_factory=GenConfig)

    def __post_init__(self) -> None:
        self.cfg.validate()
        if not self.prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if len(self.prompt_ids) >= self.pair.max_context:
            raise ValueError(
                f"the prompt is {len(self.prompt_ids)} tokens, over the target's context of "
                f"{self.pair.max_context}"
            )
        if self.cfg.seed is None and self.cfg.temperature > 0:
            self.cfg.seed = random.randrange(2**31)
        self.token_ids: list[int] = []
        self.records: list[StepRecord] = []
        self.summary: RunSummary | None = None

    @property
    def greedy(self) -> bool:
        return self.cfg.temperature == 0

    def __iter__(self) -> Iterator[StepRecord]:
        assert not self.records, "a Generation runs once; make a new one"
        with torch.inference_mode():
            yield from self._run()

    # -- model calls ---------------------------------------------------------------------------
    def _forward(self, model, ids: list[int], cache, keep: int) -> tuple[torch.Tensor, object]:
        return forward_logits(self.pair, model, ids, cache, keep)

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A token from logits [V] and the distribution behind it (greedy: the plain softmax,
        for the signals; the token is the logits' argmax, as HF's greedy search takes it)."""
        if self.greedy:
            return int(logits.argmax()), torch.softmax(logits, dim=-1)
        dist = warp(logits, self.cfg.temperature, self.cfg.top_p)
        return int(torch.multinomial(dist, 1, generator=self._gen)), dist

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> Iterator[StepRecord]:
        pair, cfg, dev = self.pair, self.cfg, self.pair.device
        self.policy.reset()
        self._gen = torch.Generator(device=dev)
        if cfg.seed is not None:
            self._gen.manual_seed(cfg.seed)
        tokens = list(self.prompt_ids)
        n_prompt = len(tokens)
        budget = min(cfg.max_new_tokens, pair.max_context - n_prompt)
        acc = AcceptanceEWMA()
        stop = "max_new_tokens" if budget == cfg.max_new_tokens else "context"

        # Step 0, the prefill: the target reads the prompt and emits the first token.
        sync_device(dev)
        t_start = time.perf_counter()
        logits, self._t_cache = self._forward(pair.target, tokens, None, keep=1)  # [1, V]
        first, _ = self._choose(logits[0])
        ttft = _ms_since(t_start, dev)
        tokens.append(first)
        self._d_cache, self._d_len = None, 0  # the draft catches up lazily: `ar` never pays its prefill
        yield self._emit(self._record(0, 0, Action(0), [], [first], 0, 0.0, ttft, 0.0, n_prompt))
        if first in pair.eos_ids:
            stop = "eos"

        step = 0
        while stop != "eos" and len(tokens) - n_prompt < budget:
            step += 1
            remaining = budget - (len(tokens) - n_prompt)
            state = DecodeState(
                step=step, position=len(tokens) - n_prompt, context_len=len(tokens),
                remaining=remaining, target_tier=pair.target_tier, kv_tier=cfg.kv_tier,
                history=self.records, alpha_ewma=acc.alpha, alpha_trials=acc.trials,
            )
            t0 = time.perf_counter()
            action = self.policy.choose(state)
            decide_ms = (time.perf_counter() - t0) * 1e3
            # Never draft past the budget: the bonus token needs one slot of its own.
            k = min(action.k, remaining - 1)

            t0 = time.perf_counter()
            drafted, p = self._draft(state, tokens, k)
            draft_ms = _ms_since(t0, dev)
            t0 = time.perf_counter()
            old_len = len(tokens)
            n, new = self._verify(tokens, [d.token_id for d in drafted], p)
            verify_ms = _ms_since(t0, dev)
            assert len(new) <= remaining, (len(new), remaining)
            if new[-1] in pair.eos_ids:
                stop = "eos"

            acc.update(n, len(drafted))
            rec = self._record(step, old_len - n_prompt, action, drafted, new, min(n, len(new)),
                               draft_ms, verify_ms, decide_ms, old_len)
            self.policy.observe(rec)
            yield self._emit(rec)

        wall_ms = (time.perf_counter() - t_start) * 1e3
        assert self.token_ids == tokens[n_prompt:]
        self.summary = _summarize(self.records, wall_ms, ttft, stop)

    def _draft(self, state: DecodeState, tokens: list[int], k: int) -> tuple[list[DraftToken], torch.Tensor | None]:
        """k tokens one at a time, each chosen from p_i; returns them and p: [k, V]."""
        drafted, p_rows = [], []
        if k and self._d_cache is None:  # the prompt alone first, as a trace reads it
            _, self._d_cache = self._forward(self.pair.draft, self.prompt_ids, None, keep=1)
            self._d_len = len(self.prompt_ids)
        feed = tokens[self._d_len:]  # what the draft has not read yet, ending at tokens[-1]
        for j in range(k):
            logits, self._d_cache = draft_read(self.pair, feed, self._d_cache)
            x, p_j = self._choose(logits[0])  # p_j: [V]
            drafted.append(DraftToken(x, float(signals.entropy_bits(p_j)), float(signals.confidence(p_j))))
            p_rows.append(p_j)
            if j + 1 < k and not self.policy.keep_drafting(state, j, drafted[-1]):
                break
            feed = [x]
        return drafted, torch.stack(p_rows) if p_rows else None

    def _verify(self, tokens: list[int], draft: list[int], p: torch.Tensor | None) -> tuple[int, list[int]]:
        """One target forward over [last, d_1..d_k] gives q_0..q_k; accept, append the emitted
        tokens to `tokens` (cut at EOS), roll both caches back. Returns (accepted n, emitted)."""
        pair = self.pair
        with invariance.verifying() if pair.exact_verify else contextlib.nullcontext():
            logits, self._t_cache = self._forward(pair.target, [tokens[-1]] + draft, self._t_cache, len(draft) + 1)
        if self.greedy:
            n, nxt = greedy_accept(draft, logits.argmax(-1).tolist())  # logits: [k+1, V]
        else:
            q = warp(logits, self.cfg.temperature, self.cfg.top_p)  # [k+1, V]
            n, nxt = rejection_sample(draft, p if p is not None else q[:0], q, self._gen)
        new = draft[:n] + [nxt]
        eos = next((i for i, x in enumerate(new) if x in pair.eos_ids), None)
        if eos is not None:  # EOS ends the run where it stands
            new = new[: eos + 1]
        old_len = len(tokens)
        tokens.extend(new)
        # Roll back: the target keeps everything but the newest token (it is the next input);
        # the draft keeps the prefix of what it read that is still in `tokens`.
        crop_to(self._t_cache, len(tokens) - 1)
        if draft:
            self._d_len = old_len + min(n, len(draft) - 1)
            crop_to(self._d_cache, self._d_len)
        return n, new

    def _record(self, step, position, action, drafted, new, accepted, draft_ms, verify_ms,
                decide_ms, context_len) -> StepRecord:
        ents = [d.entropy for d in drafted]
        confs = [d.confidence for d in drafted]
        return StepRecord(
            step=step, position=position, k_chosen=action.k, k_drafted=len(drafted),
            accepted=accepted, emitted=len(new), token_ids=list(new),
            **signals.summarize(ents, confs), entropies=ents, confidences=confs,
            draft_ms=draft_ms, verify_ms=verify_ms, decide_ms=decide_ms, context_len=context_len,
            target_tier=self.pair.target_tier, kv_tier=self.cfg.kv_tier, reuse=action.reuse,
        )

    def _emit(self, rec: StepRecord) -> StepRecord:
        self.records.append(rec)
        self.token_ids.extend(rec.token_ids)
        return rec

    def run(self) -> "Generation":
        """Run to the end without streaming."""
        for _ in self:
            pass
        return self


def _summarize(records: list[StepRecord], wall_ms: float, ttft_ms: float, stop: str) -> RunSummary:
    n_tokens = sum(r.emitted for r in records)
    steps = records[1:]
    drafted = [r for r in steps if r.k_drafted > 0]
    n_drafted = sum(r.k_drafted for r in drafted)
    return RunSummary(
        n_tokens=n_tokens,
        n_steps=len(steps),
        wall_ms=wall_ms,
        ttft_ms=ttft_ms,
        tokens_per_s=n_tokens / (wall_ms / 1e3) if wall_ms > 0 else 0.0,
        tokens_per_step=sum(r.emitted for r in steps) / len(steps) if steps else 0.0,
        mean_accepted=sum(r.accepted for r in drafted) / len(drafted) if drafted else 0.0,
        acceptance_rate=sum(r.accepted for r in drafted) / n_drafted if n_drafted else None,
        stop_reason=stop,
    )


def run_row(gen: Generation, prompt: str, policy_spec: str, chat: bool, task: str | None = None) -> dict:
    """The `runs` row for a finished generation (the store's schema)."""
    s, pair, cfg = gen.summary, gen.pair, gen.cfg
    assert s is not None, "the generation has not run"
    return dict(
        target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
        kv_tier=cfg.kv_tier, device=str(pair.device), policy=policy_spec, prompt=prompt, task=task,
        chat=chat, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
        max_new_tokens=cfg.max_new_tokens,
        output=pair.tokenizer.decode(gen.token_ids, skip_special_tokens=True),
        token_ids=list(gen.token_ids), n_tokens=s.n_tokens, n_steps=s.n_steps,
        tokens_per_s=s.tokens_per_s, ttft_ms=s.ttft_ms, wall_ms=s.wall_ms,
        tokens_per_step=s.tokens_per_step, mean_accepted=s.mean_accepted,
        acceptance_rate=s.acceptance_rate, stop_reason=s.stop_reason, error=None,
        config=dict(asdict(cfg), draft_tier=pair.draft_tier, n_prompt_tokens=len(gen.prompt_ids)),
    )
