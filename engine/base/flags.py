"""The command-line flags `python -m engine` and the benchmarks in bench/ share, declared once. The
parsers themselves are built in engine/cli/ and bench/: these functions take one (anything with
argparse's `add_argument`) and read what it parsed."""
from __future__ import annotations

from typing import Any

from engine.base.helpers import default_db
from engine.base.names import ENGINES, GGUF_FORMATS, WEIGHT_TIERS


def add_model_args(p: Any) -> None:
    """--target, --draft, their tiers, --device, --trust-remote-code."""
    p.add_argument("--target", default=None, help="HF id or local dir (default: the embedded model)")
    p.add_argument("--draft", default=None, help="HF id or local dir (default: the target's shipped draft, else itself at nf4)")
    p.add_argument("--engine", default="torch", choices=ENGINES,
                   help="what runs the target: torch (transformers) or llamacpp (its GGUF through llama.cpp)")
    p.add_argument("--target-tier", default=None, choices=WEIGHT_TIERS + tuple(f for f in GGUF_FORMATS if f not in WEIGHT_TIERS),
                   help="torch: a weight tier (default fp32); llamacpp: a GGUF format (default q4_1, as shipped)")
    p.add_argument("--draft-tier", default=None, choices=WEIGHT_TIERS)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if present)")
    p.add_argument("--trust-remote-code", action="store_true", help="run a model repo's own code")
    p.add_argument("--verify", default="auto", choices=tuple(VERIFY_MODES),
                   help="exact: verify forwards batch-invariant, so greedy output equals plain decoding bit for bit "
                   "(auto does this at bf16/fp16); fast: one batched forward, exact only against its own logits "
                   "(`divergence` measures the distance)")
    p.add_argument("--eagle", default=None, help="an EAGLE head directory for proposer `eagle` "
                   "(default: the embedded target's shipped head; off: none)")


VERIFY_MODES = {"auto": None, "exact": True, "fast": False}  # → load_pair(exact_verify=…)


def exact_verify(a: Any) -> bool | None:
    return VERIFY_MODES[getattr(a, "verify", "auto")]


# The target's KV cache tier (engine/runtime/kv/tiers.py); checked where it is used (GenConfig,
# service.parse_kv_tiers), so an unknown one is refused in one line naming the known ones.
KV_TIER_ARG = ("--kv-tier", dict(default="native", help="the target's KV cache tier: native (the model's dtype), "
                                 "fp8 (e4m3 × a power of two per token and head) or int8 (× a bf16 scale)"))
KV_TIERS_ARG = ("--kv-tiers", dict(default="native", help="comma-separated KV tiers of the target's cache: "
                                   "native, fp8, int8"))


def add_db_arg(p: Any, help: str = "DuckDB file") -> None:
    p.add_argument("--db", default=default_db(), help=f"{help} (default: $SPECLAB_DB, else speclab.duckdb)")
