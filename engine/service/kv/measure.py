"""The memory side measured in one run, on held-out real text (ShareGPT V3, even-numbered
conversations through the chat template), the target at bf16 by default:

- bits per scalar of the coded stream (window headers and checksums counted) for the native
  cache against each predictor, fp8 and int8 alone and coded; zstd level 19 on the same bytes
  as the peer; whether every round trip is bit-exact;
- encode and decode MB/s of raw KV (the stored bytes), one core's codec, the predictor apart;
  the predictor's cost against the target's own prefill of the same tokens, timed in turns;
- restore time from a slow tier against a raw transfer of the stored bytes, at link bandwidths
  0.1–100 Gbit/s (the measured per-window μ and decode times through the pipeline model, checked
  against one real pipelined restore over a sleeping link), and the break-even bandwidth;
- ratio and throughput against W and against the context length;
- acceptance and best γ by (weight tier × KV tier), from traces of held-out prompts replayed
  exactly under each fixed γ with the cost table of that tier and KV tier.

The result is stored (`kv_measurements`, for the tuner and the workbench) and printed.

Run by `python -m engine bench kv` (bench/kv.py prints it) and by the KV & prefetch page's
"Measure now" (service.measure_kv)."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.names import EMBEDDED_LABEL

BANDWIDTHS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # Gbit/s
CHECK_GBIT_S = 1.0  # the bandwidth of the one real, sleeping-link restore that checks the model
GAMMAS = (0, 1, 2, 4, 6)  # fixed γ replayed over the traces (0 = ar)
COST_BUCKETS, COST_REPS = (64,), 4  # held-out chat prompts and their answers stay near 100–250 tokens


def _zstd_bits(kv, scalars: int) -> float:
    import numpy as np
    import zstandard

    data = np.ascontiguousarray(kv.codes).tobytes() + (b"" if kv.side is None else np.ascontiguousarray(kv.side).tobytes())
    return 8 * len(zstandard.ZstdCompressor(level=19).compress(data)) / scalars


def _tier_kv(target, ids: list[int], tier: str):
    """The target's cache over `ids` at `tier`, as a served prefill stores it."""
    import torch

    from engine.runtime.forward import forward_logits
    from engine.runtime.kv.cache import new_cache
    from engine.runtime.prefix.cache import kv_of

    with torch.inference_mode():
        _, cache = forward_logits(target, ids, new_cache(target, tier), 1)
    return kv_of(cache, len(ids))


class TimedMu:
    """A μ stream that adds up the seconds its `next` calls take: the encode's own predictor time,
    taken off the encode's wall time so that encode MB/s is the codec's alone, as decode MB/s is.
    Only its own: the restore's μ seconds belong to another pass, run beside the fetch thread, and
    can exceed a fast encode's whole time."""

    def __init__(self, mu) -> None:
        self.mu, self.seconds = mu, 0.0

    def __getattr__(self, name: str):  # tier, read, … as the stream has them
        return getattr(self.mu, name)

    def next(self, ids: list[int]):
        t0 = time.perf_counter()
        try:
            return self.mu.next(ids)
        finally:
            self.seconds += time.perf_counter() - t0


def code_once(kv, ids, tier: str, kit, window: int) -> dict:
    """Offload `kv` coded in windows of `window` into host memory and restore it: sizes, times
    per window, exactness."""
    from engine.runtime.kv.offload import SlowTier, Timing, offload, restore, tier_kv

    slow = SlowTier()
    mu = TimedMu(kit.mu(tier))
    t0 = time.perf_counter()
    off = offload(kv, ids, tier, slow, "bench", window, kit.codec(tier), mu)
    encode_s = time.perf_counter() - t0 - mu.seconds
    if encode_s <= 0:  # a rate needs a time: never a floor that turns no time into 1e10 MB/s
        raise RuntimeError(f"the encode of {off.raw_bytes} bytes at {tier} timed {encode_s:.3g} s after its μ")
    timing = Timing()
    back = restore(off, slow, kit.codec(tier), kit.mu(tier), timing)
    exact = tier_kv(back, tier).equals(tier_kv(kv, tier))
    scalars = tier_kv(kv, tier).codes.size
    return dict(off=off, slow=slow, bits=8 * off.stored_bytes / scalars, raw_bits=8 * off.raw_bytes / scalars,
                exact=exact, encode_s=encode_s, encode_mu_s=mu.seconds, mu_s=timing.mu, decode_s=timing.decode,
                encode_mb_s=off.raw_bytes / encode_s / 1e6,
                decode_mb_s=off.raw_bytes / sum(timing.decode) / 1e6, scalars=scalars)


def restore_model(res: dict, latency_ms: float = 0.0) -> dict:
    """Restore seconds at each bandwidth, coded (the pipeline) against raw (the stored bytes)."""
    from engine.runtime.kv.pipeline import Link, breakeven_gbit_s, pipelined_seconds

    off = res["off"]
    raw_sizes = [off.raw_bytes * (hi - lo) // len(off.tokens) for lo, hi in off.windows()]
    rows = []
    for b in BANDWIDTHS:
        link = Link(b, latency_ms)
        rows.append(dict(gbit_s=b, coded_s=pipelined_seconds([link.seconds(n) for n in off.sizes], res["mu_s"], res["decode_s"]),
                         raw_s=sum(link.seconds(n) for n in raw_sizes)))
    return dict(rows=rows, breakeven_gbit_s=breakeven_gbit_s(off.sizes, raw_sizes, res["mu_s"], res["decode_s"], latency_ms))


def checked_restore(res: dict, kit) -> dict:
    """One real pipelined restore over a link sleeping CHECK_GBIT_S, against the model's figure."""
    from engine.runtime.kv.offload import SlowTier, Timing, restore
    from engine.runtime.kv.pipeline import Link, pipelined_seconds

    off, link = res["off"], Link(CHECK_GBIT_S)
    slow = SlowTier(link=link)
    for i in range(len(off.sizes)):
        slow.put(off.part(i), res["slow"].get(off.part(i)))
    timing = Timing()
    restore(off, slow, kit.codec(off.tier), kit.mu(off.tier), timing)
    modelled = pipelined_seconds([link.seconds(n) for n in off.sizes], timing.mu, timing.decode)
    return dict(gbit_s=CHECK_GBIT_S, measured_s=timing.wall, modelled_s=modelled)


def predictor_cost(target, kit, ids: list[int], window: int, reps: int = 2) -> float:
    """The predictor's reads of the context (in windows, as the codec runs it) over the target's
    prefill of the same tokens, timed in turns."""
    import torch

    from engine.base.helpers import medians_ms
    from engine.runtime.forward import forward_logits
    from engine.runtime.kv.cache import new_cache

    def mu() -> None:
        m = kit.mu()
        for lo in range(0, len(ids), window):
            m.next(ids[lo: lo + window])

    def prefill() -> None:
        with torch.inference_mode():
            forward_logits(target, ids, new_cache(target), 1)

    ms = medians_ms([mu, prefill], reps)
    return ms[0] / ms[1]


def coding(a: KVOptions, target, tokenizer) -> dict:
    """Everything but acceptance: per predictor and tier at the main context and W, then the
    W and context sweeps with the best predictor."""
    from engine.runtime.kv.calibration import codec_kit, conversation_ids
    from engine.runtime.kv.offload import tier_kv
    from engine.runtime.kv.tiers import KV_TIERS

    n_max = max([a.context] + a.contexts)
    ids_all = conversation_ids(tokenizer, n_max, "heldout")
    ids = ids_all[: a.context]
    kvs = {tier: _tier_kv(target, ids, tier) for tier in KV_TIERS}
    out: dict = dict(context_tokens=a.context, window=a.window, predictors={}, tiers={})
    kits, results = {}, {}
    # The first predictor (q8_0 by default, the best here) codes every KV tier; the others the
    # native one, which ranks them: a second-best predictor's lossy tiers are not worth the minutes.
    for i, kind in enumerate(a.predictors):
        t0 = time.perf_counter()
        kits[kind] = codec_kit(target, kind, a.target, tokenizer)
        tiers = KV_TIERS if i == 0 else ("native",)
        for tier in tiers:  # fitted (or loaded) before anything is timed
            kits[kind].codec(tier)
        print(f"  predictor {kind}: fitted in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        results[kind] = {tier: code_once(kvs[tier], ids, tier, kits[kind], a.window) for tier in tiers}
        r = results[kind]
        t1 = time.perf_counter()
        out["predictors"][kind] = dict(
            native_bits=r["native"]["bits"], fp8_bits_coded=r["fp8"]["bits"] if "fp8" in r else None,
            int8_bits_coded=r["int8"]["bits"] if "int8" in r else None,
            encode_mb_s=r["native"]["encode_mb_s"], decode_mb_s=r["native"]["decode_mb_s"],
            exact=all(x["exact"] for x in r.values()), predictor_frac=predictor_cost(target, kits[kind], ids, a.window))
        print(f"  predictor {kind}: coded in {t1 - t0:.0f} s, its cost timed in {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    best = min(out["predictors"], key=lambda k: out["predictors"][k]["native_bits"])
    kit, r = kits[best], results[best]
    for tier in KV_TIERS:  # a best predictor that was not the first: its lossy tiers now
        if tier not in r:
            r[tier] = code_once(kvs[tier], ids, tier, kit, a.window)
            out["predictors"][best][f"{tier}_bits_coded"] = r[tier]["bits"]
    scalars = r["native"]["scalars"]
    zstd = {tier: _zstd_bits(tier_kv(kvs[tier], tier), scalars) for tier in KV_TIERS}
    restores = {tier: restore_model(r[tier]) for tier in KV_TIERS}
    for tier in KV_TIERS:
        per_token = lambda xs: sum(xs) / a.context  # noqa: E731
        off = r[tier]["off"]
        out["tiers"][tier] = dict(bits=r[tier]["raw_bits"], bits_coded=r[tier]["bits"], zstd19_bits=zstd[tier],
                                  bytes_per_token=off.raw_bytes / a.context, coded_bytes_per_token=off.stored_bytes / a.context,
                                  mu_s_per_token=per_token(r[tier]["mu_s"]), decode_s_per_token=per_token(r[tier]["decode_s"]),
                                  decode_mb_s=r[tier]["decode_mb_s"], encode_mb_s=r[tier]["encode_mb_s"],
                                  breakeven_gbit_s=restores[tier]["breakeven_gbit_s"])
    out["restore"] = [dict(gbit_s=row["gbit_s"], **{f"{tier}_{k}": restores[tier]["rows"][i][k] for tier in KV_TIERS
                                                    for k in ("raw_s", "coded_s")})
                      for i, row in enumerate(restores["native"]["rows"])]
    t0 = time.perf_counter()
    out["restore_check"] = checked_restore(r["native"], kit)
    print(f"  a real restore at {CHECK_GBIT_S:g} Gbit/s in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    p = out["predictors"][best]
    out.update(best_predictor=best, native_bits=p["native_bits"], fp8_bits=r["fp8"]["raw_bits"],
               fp8_bits_coded=p["fp8_bits_coded"], int8_bits=r["int8"]["raw_bits"], int8_bits_coded=p["int8_bits_coded"],
               zstd19_native_bits=zstd["native"], zstd19_fp8_bits=zstd["fp8"], zstd19_int8_bits=zstd["int8"],
               encode_mb_s=p["encode_mb_s"], decode_mb_s=p["decode_mb_s"], predictor_frac=p["predictor_frac"],
               breakeven_gbit_s=restores["native"]["breakeven_gbit_s"],
               roundtrip_exact=all(x["exact"] for rr in results.values() for x in rr.values()))
    # W: the same context in other windows; context: other lengths at the main W.
    out["by_window"] = []
    for w in sorted({w for w in a.windows + [a.window] if w <= a.context}):
        # native only: fp8's bits do not move with W either (2.339 at W 256, 2.341 at 512 … 2048)
        rn = r["native"] if w == a.window else code_once(kvs["native"], ids, "native", kit, w)
        out["by_window"].append(dict(window=w, native_bits=rn["bits"], decode_mb_s=rn["decode_mb_s"], exact=rn["exact"],
                                     restore_s_1gbit=restore_model(rn)["rows"][BANDWIDTHS.index(1.0)]["coded_s"]))
        out["roundtrip_exact"] &= out["by_window"][-1]["exact"]
    print(f"  the W sweep in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    out["by_context"] = []
    for n in a.contexts:
        sub = ids_all[:n]
        kn = kvs["native"] if n == a.context else _tier_kv(target, sub, "native")
        kf = kvs["fp8"] if n == a.context else _tier_kv(target, sub, "fp8")
        rn, rf = (r["native"], r["fp8"]) if n == a.context else \
            (code_once(kn, sub, "native", kit, min(a.window, n)), code_once(kf, sub, "fp8", kit, min(a.window, n)))
        out["by_context"].append(dict(context=n, native_bits=rn["bits"], fp8_bits_coded=rf["bits"],
                                      decode_mb_s=rn["decode_mb_s"], exact=rn["exact"] and rf["exact"]))
        out["roundtrip_exact"] &= out["by_context"][-1]["exact"]
    print(f"  the context sweep in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def acceptance(a: KVOptions) -> list[dict]:
    """Per (weight tier × KV tier): traces of held-out prompts, replayed under each fixed γ with
    that tier's cost table; acceptance is the share of positions whose first drafted token the
    target kept (what α a controller sees)."""
    from engine.lab.profiling import measure_costs
    from engine.runtime.kv.tiers import KV_TIERS
    from engine.runtime.models import load_pair
    from engine.service import prompt_set, replay_all, trace_prompts
    from store import Store

    prompts = prompt_set("heldout", a.prompts_per_task)
    rows = []
    with Store(":memory:") as st:
        for tier in a.acceptance_tiers:
            pair = load_pair(a.target, a.draft, tier)
            for kv_tier in KV_TIERS:
                t0 = time.perf_counter()
                st.add_costs(measure_costs(pair, COST_BUCKETS, COST_REPS, kv_tier=kv_tier).to_rows(COST_REPS))
                t1 = time.perf_counter()
                trace_prompts(st, pair, prompts, a.max_new_tokens, kv_tier=kv_tier)
                print(f"  {tier}/{kv_tier}: costs {t1 - t0:.0f} s, traces {time.perf_counter() - t1:.0f} s", file=sys.stderr)
            del pair
        positions = st.trace_positions()
        traces = st.traces()
        first = positions.merge(traces[["trace_id", "target_tier", "kv_tier"]], on="trace_id")
        reps = replay_all(st, ["ar"] + [f"fixed:{g}" for g in GAMMAS if g])
        for tier in a.acceptance_tiers:
            for kv_tier in KV_TIERS:
                sel = first[(first.target_tier == tier) & (first.kv_tier == kv_tier)]
                tps = {}
                for spec in ["ar"] + [f"fixed:{g}" for g in GAMMAS if g]:
                    rr = [r for r in reps if r.policy == spec and r.target_tier == tier and r.kv_tier == kv_tier]
                    tokens, ms = sum(r.n_tokens - 1 for r in rr), sum(r.decode_ms or 0 for r in rr)
                    tps[spec] = tokens / (ms / 1e3) if ms else None
                best = max(tps, key=lambda s: tps[s] or 0)
                rows.append(dict(target_tier=tier, kv_tier=kv_tier, positions=len(sel),
                                 acceptance=float((sel.accept_len > 0).mean()) if len(sel) else None,
                                 mean_accept_len_at_4=float(sel.accept_len.clip(upper=4).mean()) if len(sel) else None,
                                 best_gamma=0 if best == "ar" else int(best.split(":")[1]),
                                 best_vs_ar=(tps[best] / tps["ar"]) if tps.get("ar") else None, tokens_per_s=tps))
    return rows


@dataclass
class KVOptions:
    """What one measurement covers; `bench kv`'s flags (bench/kv.py) and the KV page's buttons build it."""
    target: str | None = None  # HF id or local dir; None: the embedded model
    draft: str | None = None  # the draft of the acceptance table; None: the target's own
    target_tier: str = "bf16"  # the weight tier whose KV is coded
    device: str | None = None  # None: CUDA if present
    predictors: list[str] = field(default_factory=lambda: ["q8_0", "int8", "nf4"])  # the codec's μ candidates
    context: int = 2048  # tokens of held-out text coded
    window: int = 512  # the prefetch window W
    windows: list[int] = field(default_factory=lambda: [256, 1024, 2048])  # the W sweep, beside `window`
    contexts: list[int] = field(default_factory=lambda: [512, 1024, 2048])  # the context sweep
    acceptance_tiers: list[str] = field(default_factory=lambda: ["fp32", "bf16"])  # [] skips the acceptance table
    prompts_per_task: int = 1  # held-out prompts per task traced per tier pair
    max_new_tokens: int = 24  # per traced prompt
    db: str = ""  # the DuckDB file the result is stored in; '' stores nothing

    @classmethod
    def quick(cls, **kw) -> "KVOptions":
        """The workbench's short run: q8_0 only, 1024 tokens, no acceptance."""
        return cls(**{**dict(predictors=["q8_0"], context=1024, windows=[256, 1024], contexts=[512, 1024],
                             acceptance_tiers=[]), **kw})

    @classmethod
    def full(cls, **kw) -> "KVOptions":
        """The long sweep: 8K context, W up to 4096, more prompts."""
        return cls(**{**dict(context=8191, windows=[256, 1024, 2048, 4096], contexts=[512, 1024, 2048, 4096, 8191],
                             prompts_per_task=4), **kw})

    def check(self) -> "KVOptions":
        from engine.base.names import WEIGHT_TIERS

        if self.target_tier not in WEIGHT_TIERS:
            raise ValueError(f"unknown weight tier {self.target_tier!r}: one of {', '.join(WEIGHT_TIERS)}")
        if not 1 <= self.window <= self.context or any(w < 1 for w in self.windows) or any(n < 2 for n in self.contexts):
            raise ValueError(f"W must be between 1 and the context ({self.context}); windows ≥ 1; contexts ≥ 2")
        return self


def run(a: KVOptions) -> dict:
    """Measures, stores (unless `a.db` is ''), and returns the result."""
    import torch

    from engine.runtime.models import load_model, load_tokenizer, resolve_device
    from store import Store, StoreError

    a.check()
    device = resolve_device(a.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(a.target)
    target = load_model(a.target, a.target_tier, device)
    limit = int(getattr(target.config.get_text_config(), "max_position_embeddings", 1 << 30))
    if max([a.context] + a.contexts) > limit:
        raise ValueError(f"a context of {max([a.context] + a.contexts)} tokens is over the target's {limit}")
    name = Path(a.target).name if a.target else EMBEDDED_LABEL
    res = dict(target=name, target_tier=a.target_tier, device=str(device), threads=torch.get_num_threads())
    res.update(coding(a, target, tokenizer))
    del target
    res["acceptance"] = acceptance(a) if a.acceptance_tiers else []
    res["seconds"] = time.perf_counter() - t0
    if a.db:
        row = dict(device=res["device"], target=name, target_tier=a.target_tier, kind="bench", result=res)
        try:
            with Store(a.db, wait_s=10.0) as st:
                res["measurement_id"] = st.add_kv_measurement(row)
        except StoreError as e:  # a minutes-long measurement is never lost to a locked file
            keep = Path(f"{a.db}.kv-{time.strftime('%Y%m%d-%H%M%S')}.json")
            keep.write_text(json.dumps(row))
            print(f"not stored ({e}); the measurement is kept in {keep}", file=sys.stderr)
    return res
