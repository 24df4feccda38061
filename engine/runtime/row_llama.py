"""A Llama target on the row-invariant kernels (runtime/kernels/rowdot.py), whole: its norms, MLPs and
attention blocks compute through the kernels' own elementwise steps, and a plain step or verify
reads each decoder layer in two native calls (`TargetBody`).

Why: once the linears are fast, a CPU step's remaining time is the ~25 small torch calls per
layer between them (norms, rotary, SiLU, residual adds, views), a quarter of a step. They cannot
simply be fused against HF's torch ops: torch's vectorized mean, SiLU and exp round as torch
chooses, which a native loop cannot promise to match. So the converted modules change class
(RowNorm, RowMLP, RowAttention: subclasses whose forward calls the kernels' `rms_norm`, `rope`
and `silu_mul`), and HF's forward over the model — HF `generate`, the exactness reference — runs
the very functions the fused `layer_pre`/`layer_post` run, in the same order, rounding where each
module hands on its dtype. The lean read's logits and cache are then HF's bit for bit (tested at
every tier). A draft on the kernels (rowdot.convert_draft) reads the same way (`DraftBody`).
Under torch's own kernels (verify_kernels.stock_kernels: the HF peers as shipped) or with
gradients on, each module runs HF's forward unchanged."""
from __future__ import annotations

from functools import lru_cache

import torch

from engine.runtime import preempt
from engine.runtime.forward import BODY, TARGET_BODY
from engine.runtime.kernels.verify import stock


def _torch_path() -> bool:
    return torch.is_grad_enabled() or stock()


def _ops():
    return torch.ops.speclab_rowdot


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


@lru_cache(maxsize=1)
def _classes() -> tuple:
    """The subclasses, made once transformers is imported."""
    ml = _llama()

    class RowNorm(ml.LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            if _torch_path():
                return super().forward(hidden_states)
            x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [rows, H]
            return _ops().rms_norm(x, self.weight, self.variance_epsilon).view(hidden_states.shape)

    class RowMLP(ml.LlamaMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if _torch_path():
                return super().forward(x)
            return self.down_proj(_ops().silu_mul(self.gate_proj(x), self.up_proj(x)))

    class RowAttention(ml.LlamaAttention):
        """HF's LlamaAttention.forward with the kernels' rotary embedding (the attention itself is
        the model's interface, as in HF: rowdot.attention where it serves)."""

        def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                    **kwargs):
            cache = kwargs.pop("past_key_values", cache)  # HF's older name for it
            if _torch_path():
                return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
            b, s, d = *hidden_states.shape[:-1], self.head_dim
            cos, sin = (t.reshape(b * s, d) for t in position_embeddings)  # [B·S, D]

            def heads(proj, rotate: bool) -> torch.Tensor:
                t = proj(hidden_states).view(b * s, -1, d)  # [B·S, heads, D]
                t = _ops().rope(t, cos, sin) if rotate else t
                return t.view(b, s, -1, d).transpose(1, 2)  # [B, heads, S, D]

            q, k, v = heads(self.q_proj, True), heads(self.k_proj, True), heads(self.v_proj, False)
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
            interface = ml.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                  ml.eager_attention_forward)
            out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                     self.attention_dropout, scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(b, s, -1).contiguous()), weights

    return RowNorm, RowMLP, RowAttention


def refuses(model: torch.nn.Module) -> str | None:
    """None where `model` is a plain Llama whose every step the fused read replicates; else why not."""
    ml = _llama()
    if type(model) is not ml.LlamaForCausalLM or type(model.get_decoder()) is not ml.LlamaModel:
        return f"{type(model).__name__} is not a plain Llama"
    cfg = model.config
    if cfg.hidden_act != "silu" or cfg.attention_bias or cfg.mlp_bias:
        return "a Llama with another activation or biases"
    body = model.get_decoder()
    parts = [body.norm] + [m for layer in body.layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                 layer.mlp, layer.self_attn)]
    if any(type(p) not in (ml.LlamaRMSNorm, ml.LlamaMLP, ml.LlamaAttention, *_classes()) for p in parts):
        return "a Llama with replaced modules"
    return None


def install(model: torch.nn.Module, draft: bool = False) -> bool:
    """Turns a converted Llama's modules into the kernels' and gives it the fused read (a target's
    logits, or a draft's last state); returns whether it did (only a plain Llama: `refuses`)."""
    if refuses(model) is not None:
        return False
    row_norm, row_mlp, row_attention = _classes()
    body = model.get_decoder()
    body.norm.__class__ = row_norm
    for layer in body.layers:
        layer.input_layernorm.__class__ = row_norm
        layer.post_attention_layernorm.__class__ = row_norm
        layer.mlp.__class__ = row_mlp
        layer.self_attn.__class__ = row_attention
    if draft:
        setattr(model, BODY, DraftBody(model))
    else:
        setattr(model, TARGET_BODY, TargetBody(model))
    return True


def _read_layers(body: torch.nn.Module, ids: list[int], cache, tree: tuple[list[int], torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """x [S, H] after every decoder layer (before the final norm) for `ids` read after `cache`,
    which it updates: per layer one native call before the cache's update (norm, q/k/v, rotary)
    and one after (attention, o_proj, residual, norm, gate/up, SiLU·up, down, residual).
    tree: (position per row, allowed [S, T] bool over the last T keys) for a token tree's read
    (forward_tree_logits, forward_tree_states), each row at its depth's position, attending to the
    keys before those and to the ones its mask names."""
    ops = _ops()
    s, past = len(ids), cache.get_seq_length()
    x = body.embed_tokens.forward(torch.tensor(ids, device=body.embed_tokens.weight.device))  # [S, H]
    at = tree[0] if tree is not None else range(past, past + s)
    positions = torch.tensor([list(at)], device=x.device)  # [1, S]
    allowed = tree[1] if tree is not None else None
    cos, sin = (t[0] for t in body.rotary_emb.forward(x[None], positions))  # [S, D] each
    for layer in body.layers:
        preempt.point()  # a long turn may wait here for a session's first (preempt.py)
        a, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        q, k, v = ops.layer_pre(x, n1.weight, n1.variance_epsilon, a.q_proj.tensors, a.k_proj.tensors,
                                a.v_proj.tensors, cos, sin)  # q [heads, S, D]; k, v [kv heads, S, D]
        k, v = cache.update(k[None], v[None], a.layer_idx)  # [1, kv heads, past + S, D]
        x = ops.layer_post(x, q, k[0], v[0], a.scaling, a.o_proj.tensors, n2.weight, n2.variance_epsilon,
                           mlp.gate_proj.tensors, mlp.up_proj.tensors, mlp.down_proj.tensors, allowed)  # [S, H]
    return x


class TargetBody:
    """A converted Llama target read without HF's module machinery. The final norm is called as a
    module, so forward hooks on it (eagle_head.FeatureTap) see every read."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.body, self.head = model.get_decoder(), model.get_output_embeddings()

    def __call__(self, ids: list[int], cache, keep: int, tree: tuple[list[int], torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Logits [1, keep, V] for the last `keep` of `ids`, read after `cache` (updated); `tree`
        as `_read_layers` takes it."""
        x = self.body.norm(_read_layers(self.body, ids, cache, tree)[None])  # [1, S, H]; a module call: its hooks run
        return self.head.forward(x[:, -keep:, :])  # [1, keep, V]


class DraftBody:
    """A converted draft's body read (forward.BODY): the final-norm state of the last id, [1, H]
    contiguous, as `forward_last_state` returns through HF's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.body = model.get_decoder()

    def __call__(self, ids: list[int], cache) -> torch.Tensor:
        return self.body.norm(_read_layers(self.body, ids, cache)[-1:])  # [1, H]

    def tree(self, ids: list[int], cache, tree: tuple[list[int], torch.Tensor]) -> torch.Tensor:
        """The final-norm state of every row of a token tree's read [S, H] (`_read_layers`' tree)."""
        return self.body.norm(_read_layers(self.body, ids, cache, tree))
