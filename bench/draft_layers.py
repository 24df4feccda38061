"""Choosing a draft's layers by measurement: for each candidate initialisation, a short training
run on the same distillation data, then held-out agreement and the draft's cost per token
against the target's, measured in the same run.

Run after `python -m engine distill --stage data`:
    python bench/draft_layers.py --work distill-work --steps 60 --candidates "0,1,2,29;0,1,2,3,28,29" """
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.draft_runners import per_token_ms
from engine.runtime.draft_model import build_draft
from engine.runtime.models import load_model
from engine.training import distill


class _Quiet:
    def __init__(self, it=None, **_):
        self.it = it

    def __iter__(self):
        return iter(self.it)

    def update(self, k):
        pass

    def set_postfix(self, **_):
        pass

    def close(self):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench draft_layers", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--work", default="distill-work", help="where `distill --stage data` wrote its shards")
    p.add_argument("--candidates", default="0,1,2,29;0,1,2,3,28,29;0,5,10,15,20,25,29;0,1,2,3,4,5,28,29")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    data = Path(a.work) / "data"
    target = load_model(a.target, "fp32", torch.device("cpu"))
    held = distill.load_examples(data, "heldout")
    ctx = held[0].tokens[: held[0].label_start] * 2
    target_ms = per_token_ms(target, ctx, torch.device("cpu"))
    rows = []
    for spec in a.candidates.split(";"):
        layers = [int(x) for x in spec.split(",")]
        draft = build_draft(target, layers)
        before = distill.agreement(draft, held)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "data").symlink_to(data.resolve())
            cfg = distill.DistillConfig(work=tmp, layers=layers, steps=a.steps, batch_tokens=a.batch_tokens,
                                        warmup=min(20, a.steps // 4), eval_every=10**9, ckpt_every=10**9)
            after = distill.train(cfg, draft, Path(tmp) / "data", _Quiet, say=lambda m: None)["heldout_agreement"]
        draft_ms = per_token_ms(draft.to(torch.bfloat16), ctx, torch.device("cpu"))
        rows.append(dict(layers=layers, agreement_init=before, agreement_trained=after,
                         draft_ms_bf16=draft_ms, target_ms=target_ms, cost_ratio=draft_ms / target_ms))
        if not a.json:
            r = rows[-1]
            print(f"{spec:>24}: agreement {before:.3f} → {after:.3f} after {a.steps} steps; "
                  f"draft {draft_ms:.2f} ms/token (bf16) vs target {target_ms:.2f} (fp32): {r['cost_ratio']:.3f}")
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
