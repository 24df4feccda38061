"""A KV codec for a target: its predictor, its statistics fitted on calibration text, and the
codec file that keeps them (docs/architecture.md, "KV coding").

Calibration and measurement read real conversations (ShareGPT V3), rendered through the chat
template as a served request would be, from two disjoint halves: odd-numbered conversations
calibrate, even-numbered ones are held out for `bench kv`. A codec file is fitted once per
(target, weight tier, predictor) and cached under the model cache, named by the target's
fingerprint, so a file from another target is never picked up; one handed in by path is
checked against the target and refused in one line."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.runtime.kv import proxy as kvp
from engine.runtime.kv.codec import KVCodec, Stats, fit
from engine.runtime.kv.offload import MuStream

CALIBRATION_TOKENS = 2048  # enough for σ per (K/V, layer, head, channel): 2048 samples each
FIT_WINDOW = 512  # the predictor reads calibration text in windows of this many tokens


def conversation_ids(tokenizer, n_tokens: int, split: str) -> list[int]:
    """`n_tokens` of real chat text: ShareGPT conversations of one half (`calibration`: odd
    numbers, `heldout`: even), each through the chat template, one after another."""
    from engine.datasets import sharegpt

    if split not in ("calibration", "heldout"):
        raise ValueError(f"unknown text split {split!r}: calibration or heldout")
    parity = 1 if split == "calibration" else 0
    ids: list[int] = []
    for i, msgs in enumerate(sharegpt.conversations(min_turns=2)):
        if i % 2 != parity:
            continue
        text = tokenizer.apply_chat_template(msgs[:4], tokenize=False) if getattr(tokenizer, "chat_template", None) \
            else "\n\n".join(m["content"] for m in msgs[:4])
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"ShareGPT holds fewer than {n_tokens} tokens of {split} text")


def _kv_along(model: torch.nn.Module, ids: list[int], tier: str) -> np.ndarray:
    """The keys and values `model` computes over `ids` with its cache at `tier` (before the
    tier rounds them), read in windows: [2, L, H, S, D] float32."""
    mu = MuStream(model, tier)
    return np.concatenate([mu.next(ids[lo: lo + FIT_WINDOW]) for lo in range(0, len(ids), FIT_WINDOW)], 3)


def fit_codec(target: torch.nn.Module, predictor: torch.nn.Module, kind: str, ids: list[int], tier: str) -> KVCodec:
    """Statistics of the target's KV against the predictor's over `ids`, both with their caches
    at `tier`: at a lossy tier each attends to rounded keys and values, and their KV drift apart
    along that path more than along the native one (fitted per tier, the embedded target's fp8
    cache codes in 2.16 bits a scalar instead of 3.15 with the native statistics, on 1024
    held-out tokens)."""
    stats = fit(_kv_along(target, ids, tier), _kv_along(predictor, ids, tier), kvp.fingerprint(target), kind)
    stats.meta.update(calibration="ShareGPT V3, odd-numbered conversations", tokens=len(ids), tier=tier)
    return KVCodec(stats)


def codec_path(target: torch.nn.Module, kind: str, tier: str) -> Path:
    from engine.runtime.embedded import cache_dir

    return cache_dir() / "kvcodec" / f"{kvp.fingerprint(target)}-{kind}-{tier}.npz"


def load_codec(path: Path | str, target: torch.nn.Module, tier: str | None = None) -> KVCodec:
    """A codec file, refused in one line if it was fitted on another target (or KV tier)."""
    stats = Stats.load(Path(path))
    if stats.fingerprint != kvp.fingerprint(target):
        raise ValueError(f"{path} is a KV codec for another target (fingerprint {stats.fingerprint}, "
                         f"this target's {kvp.fingerprint(target)})")
    if tier is not None and stats.meta.get("tier", "native") != tier:
        raise ValueError(f"{path} is a KV codec for the {stats.meta.get('tier')} KV tier, not {tier}")
    return KVCodec(stats)


@dataclass
class CodecKit:
    """What coding a target's KV needs: the predictor model that gives μ, and a codec per KV
    tier (fitted on calibration text the first time a tier is asked for, then cached)."""

    kind: str
    target: torch.nn.Module
    predictor: torch.nn.Module
    calibration: Callable[[], list[int]]
    codecs: dict[str, KVCodec] = field(default_factory=dict)

    def codec(self, tier: str) -> KVCodec:
        if tier not in self.codecs:
            path = codec_path(self.target, self.kind, tier)
            if path.exists():
                self.codecs[tier] = load_codec(path, self.target, tier)
            else:
                self.codecs[tier] = fit_codec(self.target, self.predictor, self.kind, self.calibration(), tier)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.codecs[tier].stats.save(path)
        return self.codecs[tier]

    def mu(self, tier: str = "native") -> MuStream:
        """μ for a cache at `tier` (the predictor attends to its own KV at that tier)."""
        return MuStream(self.predictor, tier)


def codec_kit(target: torch.nn.Module, kind: str, source: str | None = None, tokenizer=None,
              calibration_ids: list[int] | None = None) -> CodecKit:
    """The predictor of `kind` for `target` and its codecs; calibration text is
    `calibration_ids`, else ShareGPT through `tokenizer`."""
    if calibration_ids is None and tokenizer is None:
        raise ValueError("fitting a KV codec needs calibration text: a tokenizer or token ids")
    ids = (lambda: calibration_ids) if calibration_ids is not None else \
        (lambda: conversation_ids(tokenizer, CALIBRATION_TOKENS, "calibration"))
    return CodecKit(kind, target, kvp.predictor_of(target, kind, source), ids)
