"""SpecLab drafts: a few transformer layers of the target's own architecture that share its
tokenizer, embedding and LM head (frozen, read from the target, never stored again).

A draft directory holds `config.json` (the target's config with fewer layers),
`draft.safetensors` (the draft's own layers and final norm) and `speclab_draft.json` (which
target it belongs to, how it was made, what it measured)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.runtime import invariance
from engine.runtime.kernels import int8 as int8_kernel

MARKER = "speclab_draft.json"
WEIGHTS = "draft.safetensors"


def is_draft_dir(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MARKER).is_file()


def label(path: str | Path) -> str:
    """How runs and the UI name a SpecLab draft."""
    meta = json.loads((Path(path) / MARKER).read_text())
    return f"{Path(path).name} ({len(meta.get('init_layers', []))}-layer SpecLab draft)"


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.get_decoder().layers


def _shared_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys of the embedding and LM head: the target's, never the draft's."""
    ids = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in ids}


def fingerprint(embedding: torch.Tensor) -> str:
    """A cheap identity for the target's embedding: its shape and a few sums to 3 significant
    digits (equal for the same weights at any tier, different for another model). A draft
    trained against one target refuses another: its proposals would be silently poor."""
    w = embedding.detach().float()
    return f"{tuple(w.shape)}:{float(w.sum()):.2e}:{float(w[::97].abs().sum()):.2e}"


def draft_config(target_config, n_layers: int):
    cfg = copy.deepcopy(target_config)
    text = cfg.get_text_config()
    text.num_hidden_layers = n_layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:n_layers]
    cfg.tie_word_embeddings = True
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    return cfg


def build_draft(target: torch.nn.Module, init_layers: list[int]) -> torch.nn.Module:
    """A fresh draft whose layer i starts as a copy of target layer init_layers[i]; embedding
    and head are the target's own tensors, frozen."""
    n = len(_layers(target))
    bad = [i for i in init_layers if not -n <= i < n]
    if bad or not init_layers:
        raise ValueError(f"draft layers must be target layer indices in [0, {n}), got {init_layers}")
    cfg = draft_config(target.config, len(init_layers))
    draft = type(target)(cfg).to(dtype=next(target.parameters()).dtype)
    with torch.no_grad():
        for mine, theirs in zip(_layers(draft), (_layers(target)[i] for i in init_layers)):
            mine.load_state_dict(theirs.state_dict())
        draft.get_decoder().norm.load_state_dict(target.get_decoder().norm.state_dict())
    share_embeddings(draft, target.get_input_embeddings().weight)
    return draft


def share_embeddings(draft: torch.nn.Module, embedding: torch.Tensor) -> None:
    weight = torch.nn.Parameter(embedding.detach(), requires_grad=False)
    draft.get_input_embeddings().weight = weight
    draft.get_output_embeddings().weight = weight


def own_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    shared = _shared_keys(draft)
    return {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k not in shared}


SCALE = ".q8_scale"  # suffix of a per-row scale beside an int8-stored matrix


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per output row (absmax / 127)."""
    scale = (w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [rows]
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def save_draft(draft: torch.nn.Module, out: Path, meta: dict) -> None:
    """Writes the draft's own weights: matrices as int8 with per-row scales (a quarter of fp32;
    keeps a 6-layer draft of SmolLM2 near 21 MB), vectors as bf16. A draft's numerics only
    change what is proposed, never what is emitted, and agreement is measured after the round
    trip (bench/draft.py loads the saved draft)."""
    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(out)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in own_state(draft).items():
        if v.dim() == 2:
            tensors[k], tensors[k + SCALE] = quantize_rows(v)
        else:
            tensors[k] = v.to(torch.bfloat16)
    save_file(tensors, str(out / WEIGHTS))
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")


def dequantize(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A stored draft's tensors at `dtype`: int8 matrices times their row scales (save_draft)."""
    out = {}
    for k, v in state.items():
        if k.endswith(SCALE):
            continue
        scale = state.get(k + SCALE)
        out[k] = (v.float() * scale[:, None] if scale is not None else v.float()).to(dtype)
    return out


def attach_int8(draft: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Gives each linear whose matrix is stored int8, where the int8 kernel serves it
    (engine/runtime/kernels/int8.py), its int8 weight and scales (`speclab_int8`, read by
    invariance's draft linears; `weight` stays, dequantized, for whatever reads weights)."""
    for key, scale in state.items():
        if not key.endswith(SCALE):
            continue
        module = draft.get_submodule(key[: -len(SCALE)].removesuffix(".weight"))
        w = module.weight
        if type(module) is torch.nn.Linear and int8_kernel.serves(w.device, w.dtype, module.in_features):
            module.speclab_int8 = int8_kernel.pack(state[key[: -len(SCALE)]], scale, w.dtype)


def load_draft(path: str | Path, embedding: torch.Tensor, device: torch.device,
               dtype: torch.dtype = torch.float32, int8: bool = False) -> torch.nn.Module:
    """The draft at `path`, sharing `embedding` ([V, H], the target's input embedding). int8:
    keep the int8-stored matrices for the int8 kernel where it serves (`attach_int8`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    meta = json.loads((path / MARKER).read_text())
    want = meta.get("target_fingerprint")
    if want and want != fingerprint(embedding):
        raise ValueError(
            f"draft {path} was trained for target {meta.get('target', '?')!r}, not for this one "
            "(embedding fingerprint differs)"
        )
    cfg = AutoConfig.from_pretrained(path)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=invariance.register())
    stored = load_file(str(path / WEIGHTS))
    state = dequantize(stored, dtype)
    missing = set(own_state(draft)) - set(state)
    if missing:
        raise ValueError(f"draft {path} is incomplete: {len(missing)} tensors missing (e.g. {min(missing)})")
    draft.load_state_dict(state, strict=False)
    share_embeddings(draft, embedding.to(device=device, dtype=dtype))
    draft = draft.to(device).eval()
    if int8:
        attach_int8(draft, stored)
    return draft


def target_embedding(source: str, target: torch.nn.Module) -> torch.Tensor:
    """The target's input embedding at full precision: read from its safetensors files when it
    is a local directory (the target may run at a quantized tier), else taken from the model."""
    from safetensors import safe_open

    for f in sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.endswith("embed_tokens.weight"):
                    return st.get_tensor(key).float()
    return target.get_input_embeddings().weight.detach().float()
