"""The one model forward every part of the engine calls (decode, traces, cost measurement, the
invariance probes), cache roll-back, and the device clock."""
from __future__ import annotations

import contextvars
import time

import torch

from engine.runtime import preempt
from engine.runtime.kernels.verify import stock
from engine.runtime.kv.cache import GrowingCache, new_cache

BODY = "speclab_body"  # a draft's lean body read, where it has one (engine/runtime/lean_body.py)
TARGET_BODY = "speclab_target_body"  # a target's fused read on the row-invariant kernels (row_llama.py)
# During a tree read (forward_tree_logits), per query row the key indices it attends: every layer's
# attention reads the same, so it is worked out once per read, and attention that must keep a
# chain read's bits reads each row over exactly those keys (invariance.py).
TREE_ROWS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("speclab_tree_rows", default=None)


def forward_logits(model: torch.nn.Module, ids: list[int], cache, keep: int, vocab: int | None = None,
                   gather: bool = False) -> tuple[torch.Tensor, object]:
    """Reads `ids` after what `cache` holds (a new cache when None). Returns logits [keep, V]
    (float32, the first `vocab` ids) for the last `keep` of `ids`, and the cache.

    gather: copy the kept rows into a block of their own before the LM head, for the draft's
    reads. HF slices them out of [1, S, H] as a view, and the head's matmul then depends on the
    read's length: for a 1-row view a kernel that rounds differently, for several rows a bmm
    path that first copies the whole transposed head (49152 × 576 on SmolLM2). A gathered block
    takes one path whatever the read's length, which the draft's row invariance needs."""
    if cache is None:
        cache = new_cache(model)
    if gather and keep == 1 and (body := getattr(model, BODY, None)) is not None:  # a lean draft (lean_body.py)
        return model.get_output_embeddings()(body(ids, cache)[None])[0, :, :vocab].float(), cache
    if (lean := getattr(model, TARGET_BODY, None)) is not None and not gather and not stock() \
            and not torch.is_grad_enabled():  # row_llama.py
        return lean(ids, cache, keep)[0, :, :vocab].float(), cache
    x = torch.tensor([ids], device=model.device)  # [B=1, S]
    rows = torch.arange(len(ids) - keep, len(ids), device=model.device) if gather else keep
    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=rows)
    return out.logits[0, :, :vocab].float(), out.cache  # [keep, V]


def forward_tree_logits(model: torch.nn.Module, ids: list[int], cache, allowed: list[list[bool]],
                        positions: list[int], vocab: int | None = None) -> tuple[torch.Tensor, object]:
    """Reads a token tree after what `cache` holds, in one pass (engine/decode/tree.py): row r of
    `ids` attends to the whole cache and to the rows allowed[r] names, at position positions[r].
    Returns logits [S, V] (float32) for every row, and the cache, which holds every row until the
    caller keeps the accepted path (GrowingCache.keep_rows). The mask goes to attention as a 4-D
    boolean (True: attend), which HF passes through as it stands; the row-invariant attention
    kernel reads causal masks only, so invariance.py reads a tree's rows one at a time (TREE_ROWS). A
    target on the fused read (row_llama.py) reads the tree in it, each row over its context and path."""
    assert isinstance(cache, GrowingCache), "a tree read needs SpecLab's growing cache (keep_rows)"
    s = len(ids)
    allowed_rows = torch.tensor(allowed, dtype=torch.bool, device=model.device)  # [S, S]
    if (lean := getattr(model, TARGET_BODY, None)) is not None and not stock() and not torch.is_grad_enabled():
        return lean(ids, cache, s, (positions, allowed_rows))[0, :, :vocab].float(), cache  # row_llama.py: fused
    out = _tree_call(model, ids, cache, allowed_rows, positions, logits_to_keep=s)
    return out.logits[0, :, :vocab].float(), cache  # [S, V]


def forward_tree_states(model: torch.nn.Module, ids: list[int], cache, allowed: list[list[bool]],
                        positions: list[int], rows: list[int]) -> list[torch.Tensor]:
    """As forward_tree_logits, through the body only: the final-norm state of each of `rows`, each
    copied into a contiguous [1, H] block (as forward_last_state). `allowed` is [S, T], over the
    last T keys: a tree grown level by level has its earlier levels in the cache (T − S rows),
    which a row reads only where they are its ancestors."""
    assert isinstance(cache, GrowingCache), "a tree read needs SpecLab's growing cache (keep_rows)"
    allowed_rows = torch.tensor(allowed, dtype=torch.bool, device=model.device)  # [S, T]
    lean = getattr(getattr(model, BODY, None), "tree", None)  # a draft on the kernels' fused read (row_llama.py)
    if lean is not None and not stock() and not torch.is_grad_enabled():
        x = lean(ids, cache, (positions, allowed_rows))  # [S, H]
    else:
        x = _tree_call(model.get_decoder(), ids, cache, allowed_rows, positions).last_hidden_state[0]  # [S, H]
    return [x[r : r + 1].contiguous() for r in rows]  # [1, H] each


def _tree_call(module: torch.nn.Module, ids: list[int], cache, allowed: torch.Tensor, positions: list[int], **kw):
    """HF's forward of `module` (a causal LM or its body) over a tree's rows: the mask [S, T] over
    the last T keys (every row reads the rest of the cache), as a 4-D boolean, and each row's key
    indices for invariance.py (TREE_ROWS)."""
    device = allowed.device
    past, s, t = cache.get_seq_length(), len(ids), allowed.shape[1]
    assert s <= t <= past + s, (s, t, past)
    mask = torch.ones(1, 1, s, past + s, dtype=torch.bool, device=device)  # [B, 1, S, past + S]
    mask[0, 0, :, past + s - t :] = allowed
    x = torch.tensor([ids], device=device)  # [B=1, S]
    pos = torch.tensor([positions], device=device)  # [B=1, S]
    token = TREE_ROWS.set([row.nonzero()[:, 0] for row in mask[0, 0]])
    try:
        return module(input_ids=x, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, **kw)
    finally:
        TREE_ROWS.reset(token)


def forward_last_state(model: torch.nn.Module, ids: list[int], cache) -> tuple[torch.Tensor, object]:
    """Reads `ids` after `cache` through the model's body only (no LM head): the final-norm state
    of the last id, copied into a contiguous [1, H] block (as forward_logits' gather), and the
    cache. For a reduced-vocabulary head, which must not pay for the full head first."""
    if cache is None:
        cache = new_cache(model)
    if (body := getattr(model, BODY, None)) is not None:  # a lean draft (lean_body.py)
        return body(ids, cache), cache
    x = torch.tensor([ids], device=model.device)  # [1, S]
    out = model.get_decoder()(input_ids=x, cache=cache, use_cache=True)
    return out.last_hidden_state[0, -1:].contiguous(), out.cache  # [1, H]


def crop_to(cache, length: int) -> None:
    """Roll `cache` back to its first `length` tokens."""
    extra = cache.get_seq_length() - length
    assert extra >= 0, (cache.get_seq_length(), length)
    if extra:
        cache.crop(-extra)  # transformers ≥ 5: a negative count removes that many trailing tokens


def sync_device(device: torch.device) -> None:
    # CUDA runs asynchronously: read a clock only once the queued kernels are done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WallClock:
    """Milliseconds on the wall, read after the device has finished its queued work, less the time
    this thread was paused mid-forward while another decode ran (preempt.py): a run's own time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> float:
        sync_device(self.device)
        return time.perf_counter() * 1e3 - preempt.away_ms()
