"""The row-invariant draft's body read without HF's module machinery.

A draft token is a one-row forward through a few small layers, so on a CPU HF's per-module
overhead (hooks, keyword plumbing, a causal mask built and then unused by the row-invariant
attention) cost about a quarter of it (docs/benchmarks.md, "Cost buckets and the lean body"). This
forward runs the very operations HF's Llama forward runs under `invariance.make_row_invariant`,
in the same order on the same tensors, so its states and cache are HF's bit for bit (tested); it
only skips the machinery between them. Where a layer's q/k/v (or gate/up) matrices all read
int8, they go through one product of their stacked rows: the kernel computes each output column
alone, so the stacked product gives each column's bits (checked at build, kept only if so).

`install` attaches it to a draft (`speclab_body`), which `forward.forward_last_state` and the
draft's `forward_logits` reads then call; the load-time probe runs through it."""
from __future__ import annotations

import torch

from engine.runtime import preempt
from engine.runtime.forward import BODY
from engine.runtime.kernels import int8 as int8_kernel


def _stacked(modules) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int8 rows of `modules` stacked into one product, if they all read int8 without a bias
    and the stacked product gives each one's columns bit for bit (probed on random rows)."""
    packs = [getattr(m, "speclab_int8", None) for m in modules]
    if any(p is None for p in packs) or any(m.bias is not None for m in modules):
        return None
    stacked = (int8_kernel.aligned(torch.cat([p[0] for p in packs])), torch.cat([p[1] for p in packs]))
    gen = torch.Generator(device=stacked[0].device).manual_seed(0)
    for rows in (1, 2, 5):
        x = torch.randn(rows, stacked[0].shape[1], generator=gen, device=stacked[0].device).to(packs[0][1].dtype)
        if not torch.equal(int8_kernel.matmul(x, stacked), torch.cat([int8_kernel.matmul(x, p) for p in packs], -1)):
            return None
    return stacked


class LeanBody:
    """Reads ids after a cache: the final-norm state of the last id, [1, H] contiguous (what
    `forward_last_state` returns through HF's forward)."""

    def __init__(self, model: torch.nn.Module, linear, attention) -> None:
        self.body = model.get_decoder()
        self.linear, self.attention = linear, attention
        self.qkv = [_stacked((b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj)) for b in self.body.layers]
        self.gate_up = [_stacked((b.mlp.gate_proj, b.mlp.up_proj)) for b in self.body.layers]

    def _project(self, h: torch.Tensor, stacked, modules) -> list[torch.Tensor]:
        """h [S, H] through each of `modules`: one stacked product split by columns, or one each."""
        if stacked is None:
            return [self.linear(m, h) for m in modules]
        return list(int8_kernel.matmul(h, stacked).split([m.out_features for m in modules], -1))

    def _rotated_qkv(self, h: torch.Tensor, i: int, a, rotation) -> tuple[torch.Tensor, ...]:
        """h [S, H] → q, k (rotated) and v, each [1, heads, S, D] as HF's view + transpose."""
        s, d, stacked = h.shape[0], a.head_dim, self.qkv[i]
        if stacked is None:
            q, k, v = (t.view(s, -1, d) for t in self._project(h, None, (a.q_proj, a.k_proj, a.v_proj)))
            q, k = _rotate(q, rotation), _rotate(k, rotation)
        else:
            qkv = int8_kernel.matmul(h, stacked).view(s, -1, d)  # [S, q heads + 2 kv heads, D]
            n_q, n_kv = a.q_proj.out_features // d, a.k_proj.out_features // d
            qk = _rotate(qkv[:, : n_q + n_kv], rotation)
            q, k, v = qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv :]
        return tuple(t[None].transpose(1, 2) for t in (q, k, v))

    def __call__(self, ids: list[int], cache) -> torch.Tensor:
        body = self.body
        s, past = len(ids), cache.get_seq_length()
        x = body.embed_tokens.forward(torch.tensor(ids, device=body.embed_tokens.weight.device))  # [S, H]
        positions = torch.arange(past, past + s, device=x.device)[None]  # [1, S]
        cos, sin = body.rotary_emb.forward(x, positions)  # [1, S, D] each, at x's dtype
        # rotate_half(t)·sin = flip(t's halves)·(−sin₁, sin₂): the same products (IEEE negation is
        # exact), in two operations instead of five, on q's and k's heads at once where stacked
        half = cos.shape[-1] // 2
        rotation = (cos[0, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[0, :, None])  # [S, 1, D]
        for i, layer in enumerate(body.layers):
            preempt.point()  # a long turn may wait here for a session's first (preempt.py)
            a, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm.forward(x)
            q, k, v = self._rotated_qkv(h, i, a, rotation)  # [1, heads, S, D] each
            k, v = cache.update(k, v, a.layer_idx)  # [1, kv heads, past + S, D]
            out, _ = self.attention(a, q, k, v, None, scaling=a.scaling)  # [1, S, heads, D]
            x = x + self.linear(a.o_proj, out.reshape(s, -1))
            h = layer.post_attention_layernorm.forward(x)
            gate, up = self._project(h, self.gate_up[i], (mlp.gate_proj, mlp.up_proj))
            x = x + self.linear(mlp.down_proj, mlp.act_fn(gate) * up)
        return body.norm.forward(x)[-1:].contiguous()  # [1, H]


def _rotate(t: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """HF's rotary embedding, t·cos + rotate_half(t)·sin, on t [S, heads, D]."""
    cos, signed_sin = rotation
    s, n, d = t.shape
    return t * cos + t.reshape(s, n, 2, d // 2).flip(2).reshape(s, n, d) * signed_sin


def install(model: torch.nn.Module, linear, attention) -> None:
    """Gives `model` (a Llama draft made row-invariant) the lean body read."""
    setattr(model, BODY, LeanBody(model, linear, attention))


def remove(model: torch.nn.Module) -> None:
    model.__dict__.pop(BODY, None)
