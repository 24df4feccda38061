"""A feature-level draft head (EAGLE, Li et al. 2024): one decoder layer that drafts from the
target's own last hidden states instead of re-reading the text with a small model.

Row i of the head reads the pair (f_i, x_{i+1}): the target's final-norm hidden state at
position i and the token that came after it, fused by one linear layer; the layer's output f̂ is
its guess at f_{i+1}, and the LM head on f̂ guesses x_{i+2}. While drafting, the guessed f̂ stands
in for the feature the target has not computed yet; after the verify the real ones replace it.

The LM head is the target's own (tied embedding rows), restricted to the `draft_vocab` most
frequent tokens of the training data (FR-Spec, 2025): the head's matmul shrinks from 49,152 rows to
a few thousand, and the target still verifies over the full vocabulary, so the output is exact.

A head directory holds `eagle.safetensors` (fc, the layer, the vocabulary map; bf16 matrices),
and `speclab_eagle.json` (which target it is for, how it was made, what it measured)."""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.runtime import draft_model as draftlib

MARKER = "speclab_eagle.json"
WEIGHTS = "eagle.safetensors"


@dataclass(frozen=True)
class HeadShape:
    """The head's dimensions: the target's, so its last layer can seed the head."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    eps: float
    draft_vocab: int  # rows of the restricted LM head

    @classmethod
    def of(cls, config, draft_vocab: int) -> "HeadShape":
        t = config.get_text_config()
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        theta = getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(t.hidden_size, t.num_attention_heads, t.num_key_value_heads, head_dim, t.intermediate_size,
                   float(theta), float(t.rms_norm_eps), draft_vocab)


class Rows:
    """A growing block of rows [T, ...] in a buffer that doubles: appending copies only the new
    rows, and rolling back is a length change (the head's keys and values, the target's features)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Appends rows [S, ...]; returns all rows held."""
        need = self.length + rows.shape[0]
        if self.buf is None or need > self.buf.shape[0]:
            grown = rows.new_empty((max(need, 2 * (0 if self.buf is None else self.buf.shape[0]), 64), *rows.shape[1:]))
            if self.buf is not None:
                grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length: need] = rows
        self.length = need
        return self.buf[:need]

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def view(self) -> torch.Tensor | None:
        return None if self.buf is None else self.buf[: self.length]


class HeadCache:
    """The head's keys and values: [T, kv_heads, head_dim] each."""

    def __init__(self) -> None:
        self.k, self.v = Rows(), Rows()

    @property
    def length(self) -> int:
        return self.k.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [kv_heads, S, d] → the whole cache [kv_heads, T, d]
        return self.k.append(k.transpose(0, 1)).transpose(0, 1), self.v.append(v.transpose(0, 1)).transpose(0, 1)

    def crop(self, length: int) -> None:
        self.k.crop(length)
        self.v.crop(length)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding (rotate-half form) of x [..., S, d] at positions pos [S]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[:, None] * inv[None]  # [S, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-b, a], -1) * sin


class EagleHead(torch.nn.Module):
    """fc([e(x_{i+1}); f_i]) → one pre-norm decoder layer → f̂_{i+1}; logits over `vocab_map`."""

    def __init__(self, shape: HeadShape, embedding: torch.Tensor, vocab_map: torch.Tensor) -> None:
        super().__init__()
        s = self.shape = shape
        assert vocab_map.numel() == s.draft_vocab, (vocab_map.numel(), s.draft_vocab)
        H, kv = s.hidden, s.kv_heads * s.head_dim
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.q, self.k, self.v = (torch.nn.Linear(H, n, bias=False) for n in (s.heads * s.head_dim, kv, kv))
        self.o = torch.nn.Linear(s.heads * s.head_dim, H, bias=False)
        self.gate, self.up = (torch.nn.Linear(H, s.intermediate, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(s.intermediate, H, bias=False)
        self.attn_norm = torch.nn.Parameter(torch.ones(H))
        self.mlp_norm = torch.nn.Parameter(torch.ones(H))
        self.out_norm = torch.nn.Parameter(torch.ones(H))  # f̂ lives where f does: after the target's final norm
        # Frozen, the target's own: never stored with the head (the map is).
        self.register_buffer("embedding", embedding.detach(), persistent=False)  # [V, H]
        self.register_buffer("vocab_map", vocab_map.long())  # [Vd] target ids of the head's rows
        self.register_buffer("lm_rows", embedding.detach()[vocab_map.long()].clone(), persistent=False)  # [Vd, H]

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, start: int = 0,
                cache: HeadCache | None = None) -> torch.Tensor:
        """Rows (f_i, x_{i+1}) at positions start … start + S − 1: feats [B, S, H], tokens [B, S]
        (B = 1 with a cache). Returns f̂ [B, S, H]. Without a cache the rows attend causally to each
        other; with one, to the cache and causally among themselves."""
        s = self.shape
        B, S, _ = feats.shape
        h = self.fc(torch.cat([self.embedding[tokens].to(feats.dtype), feats], dim=-1))  # [B, S, H]
        x = _rms(h, self.attn_norm, s.eps)
        pos = torch.arange(start, start + S, device=feats.device)
        q = _rope(self.q(x).view(B, S, s.heads, s.head_dim).transpose(1, 2), pos, s.rope_theta)  # [B, h, S, d]
        k = _rope(self.k(x).view(B, S, s.kv_heads, s.head_dim).transpose(1, 2), pos, s.rope_theta)
        v = self.v(x).view(B, S, s.kv_heads, s.head_dim).transpose(1, 2)
        if cache is not None:
            assert B == 1, B  # `start` is absolute; a cache may begin after a prefix-cache hit's positions
            past = cache.length
            k, v = (t[None] for t in cache.append(k[0], v[0]))  # [1, kv, past + S, d]
            mask = None if S == 1 else torch.ones(S, past + S, dtype=torch.bool, device=feats.device).tril(past)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(a.transpose(1, 2).reshape(B, S, -1))
        return self.finish(h)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP half of the layer and the output norm: h [.., H] after attention → f̂."""
        x = _rms(h, self.mlp_norm, self.shape.eps)
        return _rms(h + self.down(F.silu(self.gate(x)) * self.up(x)), self.out_norm, self.shape.eps)

    def logits(self, fhat: torch.Tensor) -> torch.Tensor:
        """[..., H] → [..., Vd]: the target's LM head on the head's rows."""
        return fhat @ self.lm_rows.to(fhat.dtype).T

    def own_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def seed_from_target(head: EagleHead, target: torch.nn.Module) -> None:
    """Start the head's layer as a copy of the target's last layer (its attention and MLP already
    map late-layer states), its output norm as the target's final norm, and fc as "half the
    feature + the embedding" so the first steps are not noise."""
    last = target.get_decoder().layers[-1]
    pairs = dict(q=last.self_attn.q_proj, k=last.self_attn.k_proj, v=last.self_attn.v_proj, o=last.self_attn.o_proj,
                 gate=last.mlp.gate_proj, up=last.mlp.up_proj, down=last.mlp.down_proj)
    H = head.shape.hidden
    with torch.no_grad():
        for name, lin in pairs.items():
            getattr(head, name).weight.copy_(lin.weight.float())
        head.attn_norm.copy_(last.input_layernorm.weight.float())
        head.mlp_norm.copy_(last.post_attention_layernorm.weight.float())
        head.out_norm.copy_(target.get_decoder().norm.weight.float())
        head.fc.weight.zero_()
        head.fc.weight[:, :H].copy_(torch.eye(H) * 0.5)
        head.fc.weight[:, H:].copy_(torch.eye(H))


# -- storage --------------------------------------------------------------------------------------
def is_head_dir(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MARKER).is_file()


def save_head(head: EagleHead, out: Path, meta: dict) -> None:
    """Matrices and norms as bf16 (a head's numerics only change what is proposed), the map as
    int32: about 8 MB for SmolLM2's 576-wide layer."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.int32) if k == "vocab_map" else v.to(torch.bfloat16)) for k, v in head.own_state().items()}
    save_file(tensors, str(out / WEIGHTS))
    (out / MARKER).write_text(json.dumps(dict(meta, shape=asdict(head.shape)), indent=2) + "\n")


def load_head(path: str | Path, embedding: torch.Tensor, device: torch.device,
              dtype: torch.dtype = torch.float32) -> EagleHead:
    """The head at `path` for a target whose input embedding is `embedding` ([V, H])."""
    path = Path(path)
    try:
        meta = json.loads((path / MARKER).read_text())
        state = load_file(str(path / WEIGHTS))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the EAGLE head at {path}: {e}") from None
    want = meta.get("target_fingerprint")
    if want and want != draftlib.fingerprint(embedding):
        raise ValueError(f"EAGLE head {path} was trained for target {meta.get('target', '?')!r}, not for this one "
                         "(embedding fingerprint differs)")
    shape = HeadShape(**meta["shape"])
    if shape.hidden != embedding.shape[1]:
        raise ValueError(f"EAGLE head {path} is {shape.hidden} wide, the target {embedding.shape[1]}")
    head = EagleHead(shape, embedding.to(device=device, dtype=torch.float32), state["vocab_map"].long().to(device))
    missing = set(head.own_state()) - set(state)
    if missing:
        raise ValueError(f"EAGLE head {path} is incomplete: {len(missing)} tensors missing (e.g. {min(missing)})")
    head.load_state_dict({k: v.long() if k == "vocab_map" else v.float() for k, v in state.items()})
    head.lm_rows = head.lm_rows.to(device)
    return head.to(device=device, dtype=dtype).eval()


def label(path: str | Path) -> str:
    meta = json.loads((Path(path) / MARKER).read_text())
    return f"{Path(path).name} (EAGLE head, {meta['shape']['draft_vocab']}-token LM head)"


# -- the target's features ------------------------------------------------------------------------
class FeatureTap:
    """Keeps the output of the target's final norm (the hidden states its LM head reads) from the
    last forward: [S, H] for batch 1. A forward hook, so every path through the model (prefill,
    plain step, batched or row-by-row verify) feeds it the same way. Per thread: the workbench
    shares one loaded pair between sessions and a background sweep, and a forward in another
    thread must never stand in for the one this thread just ran (a sweep's 3-row verify would be
    read as a live run's 256-token prefill features)."""

    def __init__(self, target: torch.nn.Module) -> None:
        self._local = threading.local()
        self._handle = target.get_decoder().norm.register_forward_hook(self._keep)

    @property
    def last(self) -> torch.Tensor | None:
        return getattr(self._local, "last", None)

    def __getstate__(self) -> dict:  # a copied model (deepcopy) gets a tap of its own, empty
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _keep(self, module, args, output) -> None:
        self._local.last = output[0].detach()  # [S, H] of batch row 0

    def close(self) -> None:
        self._handle.remove()


def rough_cost(shape: HeadShape, target_params: int) -> float:
    """Multiply-adds of one head row against one target token (a sanity figure for the card)."""
    H = shape.hidden
    head = 2 * H * H + 2 * H * shape.heads * shape.head_dim + 2 * H * shape.kv_heads * shape.head_dim \
        + 3 * H * shape.intermediate + shape.draft_vocab * H
    return head / max(target_params, 1)


def build_head(target: torch.nn.Module, embedding: torch.Tensor, vocab_map: torch.Tensor) -> EagleHead:
    """A fresh head for `target` over `vocab_map`, seeded from the target's last layer."""
    head = EagleHead(HeadShape.of(target.config, vocab_map.numel()), embedding.float(), vocab_map)
    seed_from_target(head, target)
    return head
