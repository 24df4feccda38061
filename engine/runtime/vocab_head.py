"""Reduced-vocabulary draft heads (FR-Spec): the draft scores only the K target tokens that real
text uses most, so its LM head costs K/V of the full one. The target still verifies over the full
vocabulary, so output stays exact: under greedy decoding a token the draft cannot propose is simply
never accepted; under sampling the draft's law is zero off its vocabulary, and rejection sampling
follows the target's law for any draft law (the residual max(0, q − p) carries the rest).

The ranking (engine/data/vocab_rank.safetensors, made by `python -m engine vocab`) orders every id
of the embedded model's tokenizer by frequency; a head of size K takes its first K ids, the pair's
EOS ids always among them. Maps follow EAGLE-3 / speculators: for draft index i,
target id = i + d2t[i] (d2t holds offsets), and t2d is a bool mask over the target vocabulary."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.runtime.draft_model import quantize_rows
from engine.runtime.kernels import int8 as int8_kernel
from engine.runtime.kernels import rowdot

RANK_FILE = Path(__file__).resolve().parents[1] / "data" / "vocab_rank.safetensors"


def load_ranking(path: Path = RANK_FILE) -> torch.Tensor:
    """[V'] int64: token ids, most frequent first (V' = the ranking tokenizer's vocabulary)."""
    if not path.is_file():
        raise ValueError(f"no vocabulary ranking at {path}; `python -m engine vocab` makes it")
    return load_file(str(path))["rank"].long()


def rank_tokens(counts: torch.Tensor, forced) -> torch.Tensor:
    """[V] ids by descending count (ties: lower id first), `forced` ids (EOS, specials) first."""
    key = counts.double().clone()
    key[torch.as_tensor(sorted(set(forced)), dtype=torch.long)] = float("inf")
    return torch.sort(key, descending=True, stable=True).indices


def choose_ids(ranking: torch.Tensor, k: int, vocab: int, forced) -> torch.Tensor:
    """[K] target ids, ascending: `forced` first, then the ranking's order, then (a ranking made
    for a smaller or other tokenizer) the remaining ids in id order. ValueError for a K that is
    not in 1 … vocab."""
    if k > vocab:
        raise ValueError(f"head size {k} exceeds the vocabulary {vocab}")
    if k <= 0:
        raise ValueError(f"head size must be ≥ 1, got {k}")
    place = torch.full((vocab,), float(len(ranking)))  # unranked ids after every ranked one
    ranked = ranking[ranking < vocab]
    place[ranked] = torch.arange(len(ranked), dtype=place.dtype)
    return rank_tokens(-place, [f for f in forced if f < vocab])[:k].sort().values


def maps(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [K] int64 offsets, t2d [V] bool) for the ascending target ids `ids` [K]."""
    d2t = ids.long() - torch.arange(len(ids), device=ids.device)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return d2t, t2d


@dataclass(frozen=True)
class SubHead:
    """A draft's LM head restricted to `ids`: row i of `weight` is the full head's row ids[i]."""

    ids: torch.Tensor  # [K] int64 target ids, ascending
    d2t: torch.Tensor  # [K] int64: target id = draft index + d2t
    t2d: torch.Tensor  # [V] bool: the target ids the head covers
    weight: torch.Tensor  # [K, H], contiguous: a copy, so the matmul streams K rows, not V
    # (int8 rows [K, H], bf16 scales [K]) where the draft reads int8 (engine/runtime/kernels/int8.py):
    # scoring one row reads every weight once, so half the bytes is most of half the time.
    int8: tuple[torch.Tensor, torch.Tensor] | None = None
    # the rows read through the row-invariant kernels (engine/runtime/kernels/rowdot.py) where the draft's
    # body is: bf16 in AMX tiles or fp32, the head's own values, streamed once a scoring
    row: torch.nn.Module | None = None

    @property
    def size(self) -> int:
        return len(self.ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [1, H] (one contiguous row) → [1, K] float32. One row is a gemv (or the int8 kernel's
        one-row product), the same kernel whatever read produced h (the draft's row invariance)."""
        if self.row is not None:
            return self.row(h.float())  # fp32 in, fp32 out: no rounding of the scores to bf16
        if self.int8 is not None:
            return int8_kernel.matmul(h.to(self.int8[1].dtype), self.int8).float()
        return torch.mv(self.weight, h[0].to(self.weight.dtype)).float()[None]

    def to_target(self, i: int) -> int:
        return i + int(self.d2t[i])

    def spread(self, p: torch.Tensor, vocab: int) -> torch.Tensor:
        """A law over the head's K ids [K] → over the target vocabulary [V], zero off the head."""
        return torch.zeros(vocab, dtype=p.dtype, device=p.device).index_copy_(0, self.ids, p)


def build(head_weight: torch.Tensor, k: int, vocab: int, eos_ids, ranking: torch.Tensor | None = None,
          int8: bool = False, row: bool = False) -> SubHead:
    """The size-K sub-head of `head_weight` [≥V, H] (the draft's tied LM head); int8: its rows
    also as int8 for the int8 kernel, where that serves (a draft that reads its body in int8);
    row: read through the row-invariant kernels, where they serve (a draft whose body does)."""
    ids = choose_ids(load_ranking() if ranking is None else ranking, k, vocab, eos_ids).to(head_weight.device)
    d2t, t2d = maps(ids, vocab)
    weight = head_weight.detach()[ids].contiguous()
    fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(weight.dtype)
    if row and fmt is not None and rowdot.unavailable() is None:
        lin = torch.nn.Linear(weight.shape[1], k, bias=False, device="meta")
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
        if rowdot.serves_weight(lin):
            return SubHead(ids, d2t, t2d, weight, row=rowdot.RowLinear(lin, fmt))
    rows = None
    if int8 and int8_kernel.serves(weight.device, weight.dtype, weight.shape[1]):
        rows = int8_kernel.pack(*quantize_rows(weight), weight.dtype)
    return SubHead(ids, d2t, t2d, weight, rows)


def sub_head(pair, k: int) -> SubHead:
    """The pair's draft sub-head of size k, built once per (pair, k) and kept on the pair."""
    heads = pair.vocab_heads
    if k not in heads:
        int8 = any(hasattr(m, "speclab_int8") for m in pair.draft.modules())  # its body reads int8
        row = any(isinstance(m, rowdot.RowLinear) for m in pair.draft.modules())  # its body reads the kernels
        heads[k] = build(pair.draft.get_output_embeddings().weight, k, pair.vocab_size, pair.eos_ids, int8=int8, row=row)
    return heads[k]
