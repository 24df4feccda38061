"""Can the target, compressed, draft for itself? In ONE run at fp32, per candidate draft:

    shipped      the pair's own draft (the embedded pair: the distilled 6-layer one), the peer
    LAYERS       the target's own layers LAYERS (`all`, or ranges such as 0-7,24-29) stored as a
                 SpecLab draft is (int8 matrices with a scale per row, the target's embedding and
                 LM head shared) and read as the shipped one is (the int8 kernel, the pair's sub-head)

each with `bench heads`' figures at the pair's default head: cost ratio (a draft step over a plain
target step, timed in turns), teacher-forced agreement with the target's greedy continuations of
held-out prompts, τ at γ = 4 and tok/s of live `fixed:4@draft` runs beside `ar`'s. For each
self-draft, where its time goes: its matrix products alone, one pass over every layer's (q/k/v
and gate/up stacked, as the draft reads them) through the int8 kernel and through torch's int4
weight-only kernel (groups of 32; the kernel's time, not its accuracy), and the cost ratio the
draft would have with int4 products (its measured step less the int8 products plus the int4 ones:
arithmetic on measured parts, labelled so).

Run: python -m engine bench self_draft [--json]   (defaults: ~4 minutes on the idle 2-core CPU)"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from bench import heads
from engine.base.flags import add_model_args
from engine.base.helpers import medians_ms
from engine.runtime import draft_model as draftlib
from engine.runtime.models import EMBEDDED_LABEL, ModelPair, load_model, load_pair, resolve_device

SHIPPED = "shipped"
INT4_GROUP = 32  # torch's CPU int4 kernel takes groups of 32, 64, 128… along the input; 32 is the finest


def parse_layers(spec: str, n_layers: int) -> list[int] | None:
    """`shipped` → None; `all` → every layer; `0-7,24-29` → those indices (each in [0, n_layers))."""
    spec = spec.strip()
    if spec == SHIPPED:
        return None
    if spec == "all":
        return list(range(n_layers))
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"a candidate is 'shipped', 'all' or layer ranges such as 0-7,24-29; got {spec!r}") from None
    if not out or any(not 0 <= i < n_layers for i in out):
        raise ValueError(f"candidate {spec!r}: layers must lie in [0, {n_layers})")
    return out


def write_self_draft(target: torch.nn.Module, layers: list[int], out: Path, target_name: str) -> Path:
    """The target's own `layers` as a SpecLab draft directory (draft_model.save_draft: int8 rows)."""
    draft = draftlib.build_draft(target, layers)
    meta = dict(target=target_name, target_fingerprint=draftlib.fingerprint(target.get_input_embeddings().weight),
                init_layers=layers, made_by="bench self_draft (the target's own layers, untrained)")
    draftlib.save_draft(draft, out, meta)
    return out


def _shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one layer's products as the lean body reads them: q/k/v stacked, o, gate/up
    stacked, down."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kv, f = cfg.hidden_size, cfg.num_key_value_heads * d, cfg.intermediate_size
    return [(cfg.num_attention_heads * d + 2 * kv, h), (h, cfg.num_attention_heads * d), (2 * f, h), (h, f)]


@torch.inference_mode()
def products_ms(cfg, n_layers: int, reps: int) -> dict[str, float] | None:
    """ms of one pass over `n_layers` layers' products (distinct weights, so each pass streams them
    from memory as a draft step does), int8 and int4 timed in turns, on the CPU (torch's int4
    kernel here is the CPU one). None where it cannot take these shapes (an input width not a
    multiple of the group)."""
    shapes = _shapes(cfg)
    if any(i % INT4_GROUP for _, i in shapes):
        return None
    gen = torch.Generator().manual_seed(0)
    x = {i: torch.randn(1, i, generator=gen).to(torch.bfloat16) for _, i in shapes}  # [1, in]

    def bf16(*size: int) -> torch.Tensor:
        return torch.rand(*size, generator=gen).to(torch.bfloat16)

    def codes(lo: int, hi: int, o: int, i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(lo, hi, (o, i), generator=gen, dtype=dtype)  # [out, in]

    # int8 with a scale per row; int4 packed by torch with a (scale, zero) per row and group of 32
    int8 = [(codes(-127, 128, o, i, torch.int8), bf16(o), i) for _ in range(n_layers) for o, i in shapes]
    int4 = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes(0, 16, o, i, torch.int32), 1),
             bf16(i // INT4_GROUP, o, 2), i) for _ in range(n_layers) for o, i in shapes]

    def pass8() -> None:
        for w, s, i in int8:
            torch.ops.aten._weight_int8pack_mm(x[i], w, s)

    def pass4() -> None:
        for w, sz, i in int4:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x[i], w, INT4_GROUP, sz)

    ms8, ms4 = medians_ms([pass8, pass4], reps, warmup=3)
    return dict(int8_ms=ms8, int4_ms=ms4)


def candidate_row(pair: ModelPair, spec: str, layers: list[int] | None, opts: argparse.Namespace, say) -> dict:
    size = pair.draft_vocab or 0
    res = heads.measure(pair, (size,), opts.agreement_per_task, opts.live_prompts, opts.max_new_tokens,
                        opts.agreement_tokens, opts.reps, say=say)
    r = res["rows"][0]
    row = dict(candidate=spec, layers=len(layers) if layers is not None else pair.draft.config.num_hidden_layers,
               head=r["head"], draft_ms=r["draft_ms"], target_ms=res["target_ms"], cost_ratio=r["cost_ratio"],
               agreement=r["agreement"], tau_at_4=r["tau_at_4"], tok_s=r["tok_s"], ar_tok_s=res["ar"]["tok_s"],
               fixed4_vs_ar=r["tok_s"] / res["ar"]["tok_s"])
    if layers is not None and pair.device.type == "cpu":
        prod = products_ms(pair.draft.config, len(layers), opts.reps)
        if prod is not None:
            est = (r["draft_ms"] - prod["int8_ms"] + prod["int4_ms"]) / res["target_ms"]
            row.update(products_int8_ms=prod["int8_ms"], products_int4_ms=prod["int4_ms"], int4_cost_ratio_estimate=est)
    return row


def measure(load: Callable[[str | None], ModelPair], target: torch.nn.Module, target_name: str, specs: list[str],
            opts: argparse.Namespace, say=lambda m: None) -> dict:
    """`load(draft_dir)` gives the pair with that draft (None: its own)."""
    t0 = time.perf_counter()
    n = target.config.get_text_config().num_hidden_layers
    candidates = [(s, parse_layers(s, n)) for s in specs]  # every spec checked before anything runs
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec, layers in candidates:
            say(f"candidate {spec}")
            made = None if layers is None else write_self_draft(target, layers, Path(tmp) / str(len(rows)), target_name)
            rows.append(candidate_row(load(None if made is None else str(made)), spec, layers, opts, say))
    return dict(rows=rows, target_layers=n, max_new=opts.max_new_tokens, live_prompts=opts.live_prompts,
                elapsed_s=time.perf_counter() - t0)


def format_report(res: dict) -> str:
    lines = [f"the target's own layers as its draft (target {res['target_layers']} layers; "
             f"τ over {res['live_prompts']} held-out prompts × {res['max_new']} tokens, fp32)",
             f"{'candidate':>12} {'layers':>6} {'draft ms':>9} {'cost':>6} {'agree':>6} {'τ@4':>5} {'×ar':>6} "
             f"{'int8 mm':>8} {'int4 mm':>8} {'cost@int4 (est.)':>16}"]
    for r in res["rows"]:
        prod = (f"{r['products_int8_ms']:8.2f} {r['products_int4_ms']:8.2f} {r['int4_cost_ratio_estimate']:16.3f}"
                if "products_int8_ms" in r else "")
        lines.append(f"{r['candidate']:>12} {r['layers']:6d} {r['draft_ms']:9.2f} {r['cost_ratio']:6.3f} "
                     f"{r['agreement']:6.3f} {r['tau_at_4']:5.2f} {r['fixed4_vs_ar']:6.3f} {prod}")
    lines.append(f"({res['elapsed_s']:.0f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench self_draft", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--candidates", default="shipped;all;0-7,24-29",
                   help="';'-separated: 'shipped' (the pair's draft), 'all' or layer ranges of the target")
    heads.add_measure_args(p, agreement_per_task=1, agreement_tokens=48)
    a = p.parse_args(argv)
    specs = [s for s in a.candidates.split(";") if s.strip()]
    target = load_model(a.target, "fp32", resolve_device(a.device), a.trust_remote_code)

    def load(draft: str | None) -> ModelPair:
        return load_pair(a.target, draft or a.draft, "fp32", a.draft_tier, a.device, a.trust_remote_code)

    res = measure(load, target, a.target or EMBEDDED_LABEL, specs, a,
                  say=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res) if a.json else format_report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
