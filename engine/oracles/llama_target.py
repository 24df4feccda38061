"""The target verifier on the llama.cpp engine (engine/runtime/llamacpp.py): the same duty as
TargetVerifier (oracles/target.py) — prefill, one read of [newest token, d_1 … d_k], acceptance,
the rejected positions dropped from the KV cache, rewind — over a llama.cpp context.

llama.cpp's batched read is not its one-token read (other kernels, other rounding): a verify of
k tokens may score a position differently from the plain step at it, so speculative output on
this engine can differ from its plain decoding. That is measured, never assumed
(`bench peers`' `divergence`, Compare's divergence column)."""
from __future__ import annotations

from typing import Callable

import torch

from engine.decode.records import DraftToken
from engine.oracles.sampling import Sampler, greedy_accept
from engine.runtime.prefix.cache import Hit


class LlamaTargetVerifier:
    """Verifier protocol (engine/decode/step.py) over a leased llama.cpp context."""

    feats = None  # no EAGLE features: llama.cpp does not hand out its hidden states
    cache = None  # the KV lives in the context; nothing to offload or store in the prefix cache
    restore_timing = None
    # llama.cpp reuses a read's compute graph when the next read has the same shape, so a plain
    # step after a plain step costs less than one after a verify of several rows or a draft: the
    # cost rigs time plain steps in that steady state, as a run of them meets it.
    plain_reuses_shape = True

    def __init__(self, pair, prompt_ids: list[int], sampler: Sampler, kv_tier: str = "native") -> None:
        self.pair, self.sampler, self.kv_tier = pair, sampler, kv_tier
        self.ctx = pair.target.lease(kv_tier)
        self.tokens = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.ended = False
        self.hit = Hit("off", 0)

    @property
    def reused(self) -> int:
        return 0

    def _accept(self, ids: list[int], drafted: list[DraftToken]) -> tuple[int, int]:
        """Reads `ids` (the newest token and the drafted ones) and judges the draft: (n, next)."""
        logits = self.ctx.read(ids, len(drafted) + 1)[:, : self.pair.vocab_size]  # [k+1, V], numpy
        draft = [d.token_id for d in drafted]
        if self.sampler.greedy:  # numpy's argmax: a torch op here would wake torch's spinning
            return greedy_accept(draft, logits.argmax(-1).tolist())  # threads beside llama.cpp's
        p = torch.stack([d.p for d in drafted]) if drafted else None  # [k, V]
        return self.sampler.accept(draft, p, torch.from_numpy(logits))

    def prefill(self, take: Callable[[int], int] = lambda offered: offered) -> int:
        self.ctx.truncate(0)
        _, first = self._accept(self.tokens, [])
        return self._emit([first])[0]

    def verify(self, drafted: list[DraftToken]) -> tuple[int, list[int]]:
        n, nxt = self._accept([self.tokens[-1]] + [d.token_id for d in drafted], drafted)
        return n, self._emit([d.token_id for d in drafted[:n]] + [nxt])

    def _emit(self, new: list[int]) -> list[int]:
        eos = next((i for i, x in enumerate(new) if x in self.pair.eos_ids), None)
        if eos is not None:
            new, self.ended = new[: eos + 1], True
        self.tokens.extend(new)
        self.ctx.truncate(len(self.tokens) - 1)  # drop what was read past the accepted tokens
        return new

    def rewind(self, length: int) -> None:
        """Back to the first `length` context tokens (cost measurement repeats one step)."""
        del self.tokens[length:]
        self.ctx.truncate(length - 1)
        self.ended = False

    def ensure_cache(self) -> None:
        """Nothing is ever offloaded on this engine."""

    def held_bytes_per_token(self) -> int:
        return self.pair.target.kv_bytes_per_token(self.kv_tier)

    def remember(self, draft_cache) -> bool:
        return False  # the prefix cache holds torch KV; this engine keeps none across requests

    def offload(self, *args, **kwargs):
        raise ValueError("the llama.cpp engine keeps its KV cache in place; offloading is a torch-engine feature")

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            self.ctx = None
            self.pair.target.release(ctx)
