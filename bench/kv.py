"""`python -m engine bench kv`: the memory side measured in one run (engine/service/kv/measure.py
says what), stored for the tuner, printed as text or JSON.

Run: python bench/kv.py [--json] [--full] [--quick]   or   python -m engine bench kv …"""
from __future__ import annotations

import argparse
import json
import sys

from engine.base.flags import add_db_arg
from engine.base.names import WEIGHT_TIERS
from engine.service.kv.measure import KVOptions, run


def parse(argv: list[str] | None) -> KVOptions:
    """`bench kv`'s flags as the measurement's options; a bad value exits in one line (argparse's)."""
    d = KVOptions()
    p = argparse.ArgumentParser(prog="bench kv", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="HF id or local dir (default: the embedded model)")
    p.add_argument("--draft", default=None, help="the draft for the acceptance table (default: the target's own)")
    p.add_argument("--target-tier", default=d.target_tier, choices=WEIGHT_TIERS, help="the tier whose KV is coded")
    p.add_argument("--device", default=None)
    p.add_argument("--predictors", default=",".join(d.predictors), help="comma-separated: q8_0, int8, nf4")
    p.add_argument("--context", type=int, default=None, help=f"tokens of held-out text coded (default {d.context})")
    p.add_argument("--window", type=int, default=d.window, help="the prefetch window W")
    p.add_argument("--windows", default=None, help="the W sweep, comma-separated (beside --window)")
    p.add_argument("--contexts", default=None, help="the context sweep, comma-separated")
    p.add_argument("--acceptance-tiers", default=None, help="weight tiers for the acceptance table ('' skips it)")
    p.add_argument("--prompts-per-task", type=int, default=None, help="held-out prompts per task traced per tier pair")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--full", action="store_true", help="the long sweep: " + KVOptions.full.__doc__.split(": ", 1)[1])
    p.add_argument("--quick", action="store_true", help="the workbench's short run: " + KVOptions.quick.__doc__.split(": ", 1)[1])
    p.add_argument("--json", action="store_true")
    add_db_arg(p, "DuckDB file the measurement is stored in ('' stores nothing)")
    a = p.parse_args(argv)
    base = KVOptions.quick if a.quick else KVOptions.full if a.full else KVOptions
    given = dict(target=a.target, draft=a.draft, target_tier=a.target_tier, device=a.device, window=a.window,
                 max_new_tokens=a.max_new_tokens, db=a.db)
    if not a.quick:  # the quick run codes one predictor
        given["predictors"] = [k for k in a.predictors.split(",") if k]
    try:
        for key, value, cast in (("windows", a.windows, int), ("contexts", a.contexts, int),
                                 ("acceptance_tiers", a.acceptance_tiers, str)):
            if value is not None:
                given[key] = [cast(x) for x in value.split(",") if x]
    except ValueError:
        p.error("--windows and --contexts take comma-separated integers")
    for key in ("context", "prompts_per_task"):
        if getattr(a, key) is not None:
            given[key] = getattr(a, key)
    try:
        return base(**given).check()
    except ValueError as e:
        p.error(str(e))


def report(res: dict) -> str:
    lines = [f"KV coding, {res['target']} ({res['target_tier']}) on {res['device']}, {res['context_tokens']} held-out "
             f"ShareGPT tokens, W = {res['window']}; bits per scalar with headers and checksums"]
    for kind, p in res["predictors"].items():
        lossy = "  ".join(f"{t}+coding {p[f'{t}_bits_coded']:.3f}" for t in ("fp8", "int8") if p.get(f"{t}_bits_coded"))
        lines.append(f"  predictor {kind:5} native {p['native_bits']:.3f}  {lossy + '  ' if lossy else ''}encode {p['encode_mb_s']:.1f} MB/s  decode "
                     f"{p['decode_mb_s']:.1f} MB/s  predictor {p['predictor_frac']:.2f}× the target's prefill  exact {p['exact']}")
    for tier, t in res["tiers"].items():
        lines.append(f"  {tier:6} alone {t['bits']:.3f} bits  coded {t['bits_coded']:.3f} ({t['bits'] / t['bits_coded']:.2f}×)  "
                     f"zstd-19 {t['zstd19_bits']:.3f} (coded {t['zstd19_bits'] / t['bits_coded']:.2f}× better)  "
                     f"{t['coded_bytes_per_token'] / 1024:.2f} KiB/token coded  break-even {t['breakeven_gbit_s']:.3g} Gbit/s")
    lines.append("  restore s (coded / raw):  " + "  ".join(
        f"{r['gbit_s']:g} Gbit/s native {r['native_coded_s']:.2f}/{r['native_raw_s']:.2f} fp8 {r['fp8_coded_s']:.2f}/{r['fp8_raw_s']:.2f}"
        for r in res["restore"]))
    c = res["restore_check"]
    lines.append(f"  a real pipelined restore at {c['gbit_s']:g} Gbit/s: {c['measured_s']:.2f} s measured, {c['modelled_s']:.2f} s modelled")
    lines.append("  by W:        " + "  ".join(f"W {r['window']}: {r['native_bits']:.3f} bits "
                                             f"{r['decode_mb_s']:.1f} MB/s" for r in res["by_window"]))
    lines.append("  by context:  " + "  ".join(f"{r['context']}: {r['native_bits']:.3f}/{r['fp8_bits_coded']:.3f} bits "
                                             f"{r['decode_mb_s']:.1f} MB/s" for r in res["by_context"]))
    for r in res["acceptance"]:
        tps = "  ".join(f"{k} {v:.1f}" for k, v in r["tokens_per_s"].items() if v)
        lines.append(f"  acceptance {r['target_tier']}/{r['kv_tier']:6} {r['acceptance']:.3f} (L≤4 mean {r['mean_accept_len_at_4']:.2f}) "
                     f"best γ {r['best_gamma']} ({r['best_vs_ar']:.3f}× ar)  tok/s {tps}")
    lines.append(f"native_bits {res['native_bits']:.3f}  fp8_bits_coded {res['fp8_bits_coded']:.3f}  zstd19 "
                 f"{res['zstd19_native_bits']:.3f}/{res['zstd19_fp8_bits']:.3f}  decode {res['decode_mb_s']:.1f} MB/s  "
                 f"roundtrip_exact {res['roundtrip_exact']}  breakeven {res['breakeven_gbit_s']:.3g} Gbit/s  "
                 f"({res['seconds']:.0f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    res = run(parse(argv))
    print(json.dumps(res) if "--json" in (argv if argv is not None else sys.argv[1:]) else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
