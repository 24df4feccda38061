"""`python -m engine bench kv`: the memory side measured in one run (engine/service/kv_measure.py
says what), stored for the tuner, printed as text or JSON.

Run: python bench/kv.py [--json] [--full] [--quick]   or   python -m engine bench kv …"""
from __future__ import annotations

import json
import sys

from engine.service.kv_measure import run


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
    res = run(argv)
    print(json.dumps(res) if "--json" in (argv if argv is not None else sys.argv[1:]) else report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
