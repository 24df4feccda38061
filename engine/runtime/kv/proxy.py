"""The KV codec's predictor: a cheap copy of the target that both the encoder and the decoder run
over the same tokens, whose KV is the codec's μ (docs/architecture.md, "KV coding").

Kinds:
- `q8_0`: the target's linear weights as int8 in blocks of 32 with one absmax scale each (GGUF's
  Q8_0), computed in float32. Weight-only: activations are not quantized, so its KV errs by the
  weights' rounding alone. Measured on the embedded target's bf16 cache (`bench kv`: 2048
  held-out ShareGPT tokens, coded bytes): 4.65 bits a scalar, against 6.63 for `int8` and 8.19
  for `nf4`.
- `int8`, `nf4`: the target loaded at that bitsandbytes weight tier (LLM.int8 quantizes the
  activations too; the blog post's prototype predictor).

The predictor is a function of the target's weights only, so a codec needs no weights of its
own; `fingerprint` names the target it was built from, and each window's μ checksum catches any
other source of difference (a kernel, a thread count)."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

PREDICTORS = ("q8_0", "int8", "nf4")
Q8_BLOCK = 32  # weights per scale, as GGUF's Q8_0


def fingerprint(model: torch.nn.Module) -> str:
    """A short digest of the target's first attention's key projection and its embedding shape: a
    codec fitted on one target refuses another."""
    k = next(m for n, m in model.named_modules() if n.endswith("k_proj"))
    w = k.weight.detach().float().cpu().numpy()
    head = np.ascontiguousarray(w.ravel()[:4096])
    return hashlib.blake2b(head.tobytes() + str(w.shape).encode(), digest_size=8).hexdigest()


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] rounded to int8 per block of Q8_BLOCK inputs, returned dequantized (float32)."""
    w32 = w.detach().float()
    pad = (-w32.shape[1]) % Q8_BLOCK
    blocks = torch.nn.functional.pad(w32, (0, pad)).reshape(w32.shape[0], -1, Q8_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-127, 127)
    return (q * scale).reshape(w32.shape[0], -1)[:, : w32.shape[1]]


def predictor_of(target: torch.nn.Module, kind: str, source: str | None = None) -> torch.nn.Module:
    """The predictor for `target`: `q8_0` is built from the loaded target's own weights (a float32
    copy, its linears rounded to Q8_0; the LM head is never run); `int8`/`nf4` load the target's
    source at that bitsandbytes tier."""
    import copy

    from engine.runtime.models import load_model

    if kind not in PREDICTORS:
        raise ValueError(f"unknown KV predictor {kind!r}; known: {', '.join(PREDICTORS)}")
    if kind in ("int8", "nf4"):
        return load_model(source, kind, target.device)
    model = copy.deepcopy(target).float().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings():
                m.weight.copy_(q8_0(m.weight))
    return model
