"""The draft's catch-up read: what a probe pays after a streak of plain steps. One run, same
weights, same context, for n = 1, 8, 32, 64 new tokens:

    rowinv     the row-invariant forward reading the n tokens in one go (engine/runtime/invariance.py),
               what the engine does
    rows       the draft's HF forward reading them row by row, batch-invariant (the way before):
               also path-independent, the peer
    hf         HF's own batched read: the floor, but its state depends on the chunking, so a live
               run would not replay its trace

Run: python bench/catchup.py [--json]   or   python -m engine bench catchup [--json]"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys

import torch

from engine.base.flags import add_model_args
from engine.base.helpers import median_ms
from engine.datasets.prompts import heldout
from engine.lab.generation import encode_prompt
from engine.oracles.draft import draft_read
from engine.runtime import invariance
from engine.runtime.forward import crop_to, forward_logits, sync_device
from engine.runtime.kernels import rowdot
from engine.runtime.models import ModelPair, load_pair

SIZES = (1, 8, 32, 64)


@torch.inference_mode()
def measure(pair: ModelPair, reps: int = 9) -> dict:
    if not pair.draft_row_invariant:
        raise ValueError("the load-time probe found no row-invariant forward for this draft on this machine: "
                         "it reads row by row already, there is nothing to compare")
    if rowdot.converted(pair.draft)[0]:
        raise ValueError("this draft reads through the row-invariant kernels (rowdot.convert_draft), whose every "
                         "split of a read computes the same bits: there is no row-by-row read to compare")
    rows_draft = copy.deepcopy(pair.draft)
    invariance.undo_row_invariant(rows_draft)
    invariance.make_verify_exact(rows_draft)
    ways = {
        "rowinv": (pair, draft_read),
        "rows": (dataclasses.replace(pair, draft=rows_draft, draft_row_invariant=False), draft_read),
        "hf": (dataclasses.replace(pair, draft=rows_draft), lambda p, feed, c: forward_logits(p.draft, feed, c, 1, p.vocab_size)),
    }
    ids = encode_prompt(pair.tokenizer, heldout(1)[0][1], chat=True)
    ids = (ids * (1 + (64 + max(SIZES)) // len(ids)))[: 64 + max(SIZES)]  # a 64-token past, then the reads
    out: dict[str, dict[int, float]] = {}
    for name, (p, read) in ways.items():
        _, cache = forward_logits(p.draft, ids[:64], None, 1, p.vocab_size)

        def once(n: int) -> None:
            read(p, ids[64 : 64 + n], cache)
            crop_to(cache, 64)

        out[name] = {n: median_ms(lambda: once(n), reps, warmup=2, sync=lambda: sync_device(p.device)) for n in SIZES}
    return dict(ms=out, rows_vs_rowinv={n: out["rows"][n] / out["rowinv"][n] for n in SIZES},
                rowinv_vs_hf={n: out["rowinv"][n] / out["hf"][n] for n in SIZES})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench catchup", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    pair = load_pair(a.target, a.draft, a.target_tier, a.draft_tier, a.device, a.trust_remote_code)
    res = measure(pair, a.reps)
    res.update(draft=pair.draft_name, draft_tier=pair.draft_tier, device=str(pair.device))
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"draft catch-up read, {pair.draft_name} ({pair.draft_tier}) on {pair.device}, median ms")
    ms = res["ms"]
    for n in SIZES:
        print(f"  {n:3} tokens: row-invariant {ms['rowinv'][n]:6.2f} · row by row {ms['rows'][n]:6.2f} "
              f"= {res['rows_vs_rowinv'][n]:.2f}× it · HF batched {ms['hf'][n]:6.2f} "
              f"= {1 / res['rowinv_vs_hf'][n]:.2f}× it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
