"""Command-line options shared by `python -m engine` and the benchmarks in bench/."""
from __future__ import annotations

import argparse

from engine.common import default_db
from engine.models import TIERS


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target, --draft, their tiers, --device, --trust-remote-code."""
    p.add_argument("--target", default=None, help="HF id or local dir (default: the embedded model)")
    p.add_argument("--draft", default=None, help="HF id or local dir (default: the target's shipped draft, else itself at nf4)")
    p.add_argument("--target-tier", default="fp32", choices=TIERS)
    p.add_argument("--draft-tier", default=None, choices=TIERS)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: CUDA if present)")
    p.add_argument("--trust-remote-code", action="store_true", help="run a model repo's own code")


def add_db_arg(p: argparse.ArgumentParser, help: str = "DuckDB file") -> None:
    p.add_argument("--db", default=default_db(), help=f"{help} (default: $SPECLAB_DB, else speclab.duckdb)")
