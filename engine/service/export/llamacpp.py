"""The tuned setting as llama.cpp runs it: the draft as a GGUF that llama.cpp loads as a draft
model (written with the `gguf` package: the draft's own layers, the target's embedding as its
tied head, the target GGUF's tokenizer), and the speculative flags of the llama.cpp that
llama-cpp-python 0.3.36 vendors (their names read from its source once:
engine/data/llamacpp_flags.json; that build removed `--draft-max` for `--spec-draft-n-max`).

    python -m engine export --format llamacpp --out DIR     (DIR/draft.gguf, DIR/llamacpp.json)

Torch is imported inside the functions that read the draft."""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.base.names import DATA_DIR, EMBEDDED, EMBEDDED_GGUF, GGUF_FORMATS, SHIPPED_DRAFT
from engine.service.export.tuned_config import TunedConfig, first_proposer, ngram_options, speculative_tokens

FLAGS_FILE = DATA_DIR / "llamacpp_flags.json"
CONFIG_FILE = "llamacpp.json"
DRAFT_FILE = "draft.gguf"
# The draft GGUF's weight format: Q8_0 halves a bf16 file and its read, and a draft's numerics only
# change what is proposed, never what the target emits.
DRAFT_FORMAT = "q8_0"
# llama.cpp drafts while the draft's top probability stays at or above this (--spec-draft-p-min):
# SpecLab's fixed γ drafts every token, so 0; the server's own default is 0.75.
P_MIN_FIXED = 0.0


@functools.cache
def pinned_flags() -> dict[str, Any]:
    return json.loads(FLAGS_FILE.read_text())


def check_flags(args: list[str]) -> None:
    """Every flag of `args` is one the pinned build parses (a removed one is named with its successor)."""
    pinned = pinned_flags()
    for a in (x for x in args if x.startswith("-")):
        if a in pinned["removed"]:
            raise ValueError(f"{a} was removed in {pinned['release']}")
        if a not in pinned["flags"]:
            raise ValueError(f"{a} is not a flag of {pinned['release']}")


def settings(cfg: TunedConfig) -> dict[str, Any]:
    """llama.cpp's speculative settings for `cfg`: the draft model's (n_max, n_min, p_min), or
    its n-gram lookup's (ngram-simple: the lookup n-gram and the drafted m-gram)."""
    if cfg.engine != "llamacpp":  # its γ and draft were tuned on another engine's costs
        raise ValueError(f"the llama.cpp export is of a setting tuned on the llama.cpp engine; this one runs on "
                         f"{cfg.engine} at {cfg.target_tier}: add --engine llamacpp (formats: {', '.join(GGUF_FORMATS)})")
    k = speculative_tokens(cfg)
    proposer = first_proposer(cfg)
    if proposer == "ngram":
        o = ngram_options(cfg)
        return {"type": "ngram-simple", "size_n": o["max"], "size_m": k, "min_hits": 1}
    if proposer not in ("draft", "eagle"):
        raise ValueError(f"llama.cpp has no counterpart of SpecLab's {proposer} proposer: export a policy "
                         "drafting with the draft model or the n-gram lookup")
    return {"type": "draft-simple", "n_max": k, "n_min": 0, "p_min": P_MIN_FIXED}


def server_args(s: dict[str, Any], target: str, draft: str | None) -> list[str]:
    """llama-server's (and llama-cli's) command line for settings `s`."""
    args = ["-m", target]
    if s["type"] == "draft-simple":
        args += ["--spec-draft-model", draft or DRAFT_FILE, "--spec-draft-n-max", str(s["n_max"]),
                 "--spec-draft-n-min", str(s["n_min"]), "--spec-draft-p-min", str(s["p_min"])]
    else:
        args += ["--spec-type", s["type"], "--spec-ngram-simple-size-n", str(s["size_n"]),
                 "--spec-ngram-simple-size-m", str(s["size_m"]), "--spec-ngram-simple-min-hits", str(s["min_hits"])]
    assert s["type"] in pinned_flags()["spec_types"], s  # settings() names only the build's own types
    check_flags(args)
    return args


def _target_gguf(cfg: TunedConfig) -> Path:
    if cfg.target != EMBEDDED:
        path = Path(cfg.target)
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(f"the llama.cpp export needs the target as a .gguf file; {cfg.target!r} is not one")
        return path
    from engine.runtime.embedded import cache_dir, gguf_dir
    from engine.runtime.llamacpp import gguf_at

    return gguf_at(gguf_dir() / EMBEDDED_GGUF, cfg.target_tier, cache_dir() / "gguf")  # as load_llama_pair


# -- the draft as a GGUF -------------------------------------------------------------------------------
# HF llama names → GGUF's (llama.cpp's convert_hf_to_gguf.py for LlamaForCausalLM).
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w, n_head: int):
    """HF's rotary layout (halves) → llama.cpp's (interleaved pairs), per head, as the converter does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict, cfg) -> dict[str, Any]:
    """GGUF name → fp32 numpy array for a llama-family draft's HF state dict (tied head: no output)."""
    out: dict[str, Any] = {"token_embd.weight": state["model.embed_tokens.weight"],
                           "output_norm.weight": state["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        for hf, name in _LAYER.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                w = _permute(w, cfg.num_attention_heads)
            elif name == "attn_k":
                w = _permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{name}.weight"] = w
    return {k: v.float().contiguous().numpy() for k, v in out.items()}


def write_draft_gguf(cfg: TunedConfig, out: Path) -> Path:
    """The draft of `cfg` as a GGUF at DRAFT_FORMAT beside `out` (written at fp32, then quantized
    by llama.cpp in a child process), its tokenizer and chat template the target GGUF's."""
    import gguf
    import torch

    from engine.runtime import draft_model as draftlib
    from engine.runtime import llamacpp
    from engine.runtime.embedded import cache_dir, embedded_dir

    target = _target_gguf(cfg)
    source = Path(cfg.draft) if cfg.draft else SHIPPED_DRAFT
    if cfg.target != EMBEDDED:
        raise ValueError("the llama.cpp export writes the embedded target's SpecLab draft; pass a GGUF draft "
                         "of another target to llama.cpp as it is")
    if not draftlib.is_draft_dir(source):
        raise ValueError(f"the llama.cpp export writes a SpecLab draft as a GGUF; {source} is not one "
                         "(a GGUF draft is passed to llama.cpp as it is)")
    embedding = draftlib.target_embedding(str(embedded_dir()), None)
    draft = draftlib.load_draft(source, embedding, torch.device("cpu"), torch.float32, int8=False)
    c = draft.config
    reader = gguf.GGUFReader(str(target))
    tmp = out.with_suffix(f".f32.tmp{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(f"SpecLab draft ({draftlib.label(source)})")
        w.add_context_length(int(c.max_position_embeddings))
        w.add_embedding_length(int(c.hidden_size))
        w.add_block_count(int(c.num_hidden_layers))
        w.add_feed_forward_length(int(c.intermediate_size))
        w.add_head_count(int(c.num_attention_heads))
        w.add_head_count_kv(int(c.num_key_value_heads))
        w.add_rope_dimension_count(int(c.hidden_size // c.num_attention_heads))
        w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        w.add_vocab_size(int(c.vocab_size))
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        for field in reader.fields.values():  # the target's tokenizer, token for token
            if field.name.startswith("tokenizer."):
                sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        with torch.no_grad():
            for name, arr in gguf_tensors(draft.state_dict(), c).items():
                w.add_tensor(name, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        quantized = llamacpp.gguf_at(tmp, DRAFT_FORMAT, Path(tempfile.mkdtemp(dir=cache_dir())))
        shutil.move(str(quantized), out)
        shutil.rmtree(quantized.parent, ignore_errors=True)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _manifest(cfg: TunedConfig, s: dict[str, Any], made_by: str) -> dict[str, Any]:
    """llamacpp.json for `cfg` and its settings `s`: with a draft GGUF where `s` drafts with the draft model."""
    from engine.runtime.llamacpp import version

    draft = s["type"] == "draft-simple"
    target = _target_gguf(cfg)
    return {"engine": "llama.cpp", "engine_version": f"llama-cpp-python {version()}",
            "release": pinned_flags()["release"], "target": str(target), "target_format": cfg.target_tier,
            "kv_tier": cfg.kv_tier, "settings": s, "draft": DRAFT_FILE if draft else None,
            "server_args": server_args(s, str(target), DRAFT_FILE if draft else None),
            "policy": cfg.policy, "made_by": made_by}


def render_llamacpp(cfg: TunedConfig) -> str:
    """The settings and llama-server's arguments as text (`--out DIR` also writes the draft GGUF)."""
    return json.dumps(_manifest(cfg, settings(cfg), ""), indent=2) + "\n"


def llamacpp_summary(out: str | Path, manifest: dict[str, Any]) -> str:
    """One line: where the export is and the llama-server command that runs it."""
    return f"{out}: llama.cpp ({manifest['engine_version']}): llama-server {' '.join(manifest['server_args'])}"


def write_llamacpp_export(cfg: TunedConfig, out: str | Path, made_by: str = "") -> dict[str, Any]:
    """DIR/llamacpp.json (the settings, llama-server's arguments, the binding's form) and, for a
    draft-model setting, DIR/draft.gguf. Written into a temporary sibling renamed into place."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory: name a new one")
    s = settings(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        if s["type"] == "draft-simple":
            write_draft_gguf(cfg, tmp / DRAFT_FILE)
        manifest = _manifest(cfg, s, made_by)
        (tmp / CONFIG_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
