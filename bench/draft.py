"""Do the proposers pay? On the held-out prompts (never trained on), in ONE run, per tier:

    per proposer (draft, eagle when the pair has a head, ngram) and task
      agreement          the draft model: teacher-forced greedy agreement with the target on its
                         own responses; eagle, ngram: live first-token acceptance at γ = 4 (the
                         share of its drafting steps whose first drafted token stood)
      tau_at_4           τ, tokens per target step including the target's own, over every step
                         of live `fixed:4@<proposer>` runs (the EAGLE papers' "acceptance length";
                         an n-gram step without a match counts as the plain step it is); the suffix
                         proposer cold (no history) and "suffix warm": its cross-request history
                         the greedy outputs of --suffix-history other held-out prompts per task,
                         never the timed prompt's own (greedy outputs repeat exactly)
      cost_ratio         ms per drafted token / the target's ms per plain step, from the cost
                         table measured for the setting (engine/profiling.measure_costs)
    live tok/s, per tier and verify mode (bf16: exact and fast, named), wall clock, policies
    interleaved per prompt in a rotating order, of
      ar, fixed:k@<proposer> for each k of --ks and each proposer, rakv (and speckv when --db
      holds a trained controller), and as peers on the same prompts and max_new_tokens: HF
      `generate` (ar's peer), HF assisted generation with our draft model at each of a few
      settings (constant γ, HF's heuristic schedule; its best one is the peer) and HF prompt
      lookup (`prompt_lookup_num_tokens`)
    each output against HF `generate`'s (token-identical fraction, first differing position): the
    divergence of the fast verify at bf16, and the exactness check of every other policy

rakv weighs the setting's cost table: measured once per tier and verify mode (the verify's price
is what the modes differ in), calibrated against the live steps of short runs of ar and every
fixed policy on a held-out prompt that is not timed. HF assisted gets the draft with HF's own
forward (the row-invariant reads a live SpecLab run needs are SpecLab's cost, not HF's).

Per tier, `ar` tok/s, and plain decoding by tier against fp32's (`ar_vs_fp32`, timed at the end
with every tier in one rotation, `ar_tok_s_one_rotation`); int8 and int4
(`Options.ar_tiers`) are timed for that, their exactness and one speculative setting (ar,
fixed:4@draft, rakv; HF generate). Exact settings are also run with prefix reuse on (untimed,
`with_prefix_reuse`); the exit code is 1 when any exact setting's output differs from HF
generate's, reuse on or off. HF generate reads the target as the tier loads it (its kernels: the
exactness reference), `hf_generate:stock` through torch's own.

Run: python bench/draft.py [--json]   or   python -m engine bench draft [--json]
Defaults (3 held-out prompts per task, 64 tokens, γ 4 per proposer, fp32 and bf16 in both verify
modes, int8 and int4) fit 20 minutes on a 2-core CPU (the JSON's `elapsed_s` says what a run
took); `--long` times the headline settings (ar, fixed:4@draft, rakv; HF generate) at fp32 and bf16
exact on 50 prompts per task (about an hour), `--ks 2,4` adds γ 2."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from bench.draft_runners import (
    HF_ASSISTED,
    HF_ASSISTED_KNOWN,
    HF_STOCK,
    KERNELS,
    agreement,
    check_hf_assisted,
    draft_step_ms,
    hf_assistant,
    hf_runner,
    per_token_ms,
    reuse_check,
    speclab_runner,
)
from bench.draft_tables import GAMMA, format_report, headline, setting_table, tier_table, tok_s_of, warm_stats
from engine.base.flags import add_model_args
from engine.base.names import EXACT_VERIFY_TIERS
from engine.datasets.prompts import first_per_task, heldout
from engine.decode.policies import PolicyContext
from engine.lab.generation import encode_prompt
from engine.oracles import available
from engine.runtime.models import ModelPair, load_pair
from engine.service.costs.kernels import kernel_report
from engine.service.generation import Request, greedy_history, open_generation

# --long: timed prompts per task (the held-out file's 10, then real prompts never trained on): a
# 95% interval within ±3% needs ~150–180 prompts drawn task by task at this machine's spread
LONG_PER_TASK = 50
SUFFIX_WARM = f"fixed:{GAMMA}@suffix warm"  # the entry of fixed:4@suffix reading the warm history



@dataclass
class Options:
    per_task: int = 3  # held-out prompts per task, timed (12 in all; --long: LONG_PER_TASK)
    max_new: int = 64  # the defaults fit 20 minutes on a 2-core CPU (the JSON's elapsed_s)
    ks: tuple[int, ...] = (GAMMA,)  # fixed γ per proposer (GAMMA is always among them; --ks 2,4 adds 2)
    proposers: tuple[str, ...] | None = None  # None: every proposer the pair has
    hf_assisted: tuple[str, ...] = HF_ASSISTED
    # tiers timed for their plain step against fp32's (ar_vs_fp32), exactness and one speculative
    # setting (ar, fixed:γ@draft, rakv; HF generate), not the whole proposer sweep
    ar_tiers: tuple[str, ...] = ("int8", "int4")
    hf_lookup: tuple[int, ...] = (4,)  # prompt_lookup_num_tokens values
    cost_buckets: tuple[int, ...] = (64,)  # contexts the cost table is measured at (held-out contexts: 40–190)
    cost_reps: int = 3
    calibrate_tokens: int = 24  # max_new_tokens of the calibration runs (0: the bare measured costs)
    agreement_per_task: int | None = None  # held-out prompts per task for the draft's agreement (None: the timed ones)
    repeats: int = 1  # runs of each (prompt, policy); the median time counts
    forward_reps: int = 24  # timed forwards of the draft's and the target's raw per-token cost
    controller: Callable | None = None  # speckv's controller loader (service.controller_loader); None: rakv only
    speckv_note: str = "speckv not run: no stored controller (pass --db FILE holding one, e.g. from `bench controllers live --db FILE`)"
    prompts: list[tuple[str, str]] | None = None  # (task, prompt); None: engine.datasets.prompts.heldout()
    suffix_history: int = 2  # untimed held-out prompts per task whose outputs are suffix's warm history (0: none)
    # every proposer's fixed γ, HF's assisted and lookup peers and the tiers' ar rotation; False
    # (--long): ar, fixed:γ@draft, rakv and HF generate (the exactness reference), on many prompts
    sweep: bool = True
    say: Callable[[str], None] = field(default_factory=lambda: _stamped(time.perf_counter()))


def _stamped(t0: float) -> Callable[[str], None]:
    """Progress on stderr, each line with the minutes since the run began (where the time goes)."""
    return lambda m: print(f"[{(time.perf_counter() - t0) / 60:5.1f} min] {m}", file=sys.stderr, flush=True)


# -- settings -----------------------------------------------------------------------------------------
MODES = {"auto": None, "exact": True, "fast": False}


def settings_for(tiers: list[str], verify: str) -> list[tuple[str, str]]:
    """(tier, verify mode) to time: `auto` times both modes where they differ (bf16, fp16), the
    loader's default elsewhere; `exact`/`fast` that mode at every tier."""
    out = []
    for tier in tiers:
        modes = ["exact", "fast"] if verify == "auto" and tier in EXACT_VERIFY_TIERS else [verify]
        out += [(tier, m) for m in modes]
    return out


def label(tier: str, mode: str) -> str:
    return tier if mode == "auto" else f"{tier}/{mode}"


def policies_for(pair: ModelPair, opts: Options, speckv: bool) -> list[str]:
    names = _proposers(pair, opts)
    if pair.target_tier in opts.ar_tiers:  # a tier timed for its plain step: ar, rakv, one fixed γ
        names = names[:1]
    fixed = [f"fixed:{k}@{p}" for p in (names if opts.sweep else names[:1]) for k in _ks(opts)]
    at = "" if names == available(pair) else "@" + "+".join(names)
    return ["ar", *fixed, f"rakv{at}"] + ([f"speckv{at}"] if speckv else [])


def _proposers(pair: ModelPair, opts: Options) -> tuple[str, ...]:
    """The proposers timed: --proposers (a known one the pair lacks, eagle without a head, is
    left out) or every one the pair has."""
    from engine.decode.records import PROPOSER_NAMES

    have = available(pair)
    if opts.proposers is None:
        return have
    unknown = [p for p in opts.proposers if p not in PROPOSER_NAMES]
    if unknown:
        raise ValueError(f"unknown proposer(s) {', '.join(unknown)}; known: {', '.join(PROPOSER_NAMES)}")
    names = tuple(p for p in have if p in opts.proposers)
    if not names:
        raise ValueError(f"none of the proposers {', '.join(opts.proposers)} is available; this pair has: {', '.join(have)}")
    return names


def _ks(opts: Options) -> list[int]:
    return sorted(set(opts.ks) | {GAMMA})


def hf_settings(opts: Options, tier: str = "fp32") -> list[str]:
    # generate alone: at the ar tiers HF has no CPU kernels of its own; --long needs only its reference
    if tier in opts.ar_tiers or not opts.sweep:
        return ["hf_generate"]
    # each HF assisted setting twice: as shipped (torch's linears, HF's modules) and like for like,
    # through the kernels SpecLab's runs read (the target's, and the draft's fused int8 body; HF
    # has no reduced-vocabulary draft head, so its draft keeps the full one)
    return ["hf_generate", HF_STOCK, *(f"hf_assisted:{s}{w}" for s in opts.hf_assisted for w in ("", KERNELS)),
            *(f"hf_lookup:{n}" for n in opts.hf_lookup)]


# -- running ------------------------------------------------------------------------------------------
def setting_context(pair: ModelPair, tier: str, opts: Options, calib: tuple[str, str]) -> tuple[PolicyContext, dict]:
    """rakv's (and speckv's) context on this pair: the cost table measured here (the verify
    mode's own), calibrated against live steps of ar and every fixed policy on a prompt not
    timed, through a temporary store as `python -m engine` builds it (service.policy_context).
    Also returns what was measured, for the report."""
    from engine.decode.costs import CostTable
    from engine.lab.profiling import measure_costs
    from engine.service import calibrate_costs, cost_key, policy_context
    from engine.service.generation import Request, generate
    from store import Store

    t0 = time.perf_counter()
    bare: CostTable = measure_costs(pair, buckets=opts.cost_buckets, reps=opts.cost_reps)
    info = dict(buckets=bare.buckets, verify_ms=bare.verify_ms, calibrated=False,
                draft_ms={p: bare.drafting(p).ms for p in bare.proposers}, measure_s=time.perf_counter() - t0)
    with Store(":memory:") as st:
        st.add_costs(bare.to_rows(opts.cost_reps))
        if opts.calibrate_tokens > 0:
            task, prompt = calib
            for pol in [p for p in policies_for(pair, opts, False) if p.startswith(("ar", "fixed:"))]:
                generate(pair, Request(prompt, pol, task=task, max_new_tokens=opts.calibrate_tokens,
                                       sweep="bench-draft-calibration"), st, context=None)
            try:
                info["step_factor"] = calibrate_costs(st, cost_key(pair)).step_factor
                info["calibrated"] = True
            except ValueError as e:
                info["calibration_note"] = str(e)
        # the newest table (calibrated when it could be), priors from those steps; read as measured, its
        # slope past the last bucket (measure=True would time every bucket up to the model's context)
        ctx = policy_context(st, pair, measure=False)
    if opts.controller is not None:
        ctx = replace(ctx, controller=opts.controller)
    info["priors"] = dict(ctx.priors)
    return ctx, info


@dataclass
class Entry:
    name: str  # policy or HF setting
    where: str  # the setting label (SpecLab) or the tier (HF peers)
    run: Callable[[list[int], int], tuple[list[int], list | None, float]]


def time_tier(entries: list[Entry], timed: list[list[int]], opts: Options, say=lambda m: None) -> dict:
    """(where, name) → per prompt {tokens, seconds: [per repeat], output, steps}: every entry on
    every prompt, interleaved per prompt in a rotating order (drift hits all alike)."""
    for e in entries:  # first calls (allocations, lazy inits) off the clock
        e.run(timed[0], min(4, opts.max_new))
    out: dict[tuple[str, str], list[dict]] = {(e.where, e.name): [{} for _ in timed] for e in entries}
    for rep in range(opts.repeats):
        for i, ids in enumerate(timed):
            shift = (i + rep) % len(entries)
            for e in entries[shift:] + entries[:shift]:
                tokens, steps, seconds = e.run(ids, opts.max_new)
                r = out[(e.where, e.name)][i]
                r.setdefault("seconds", []).append(seconds)
                if "output" not in r:
                    r.update(tokens=len(tokens), output=tokens, steps=steps)
            say(f"  prompt {i + 1}/{len(timed)} × {len(entries)} (repeat {rep + 1}/{opts.repeats})")
    return out


# -- the whole run ------------------------------------------------------------------------------------
def measure(load: Callable[[str, bool | None], ModelPair], settings: list[tuple[str, str]], opts: Options) -> dict:
    """The benchmark: `load(tier, exact_verify)` gives each setting's pair (a tier's pairs are
    held together, its policies and HF peers interleaved); returns the report (module doc)."""
    t_start = time.perf_counter()
    say = opts.say
    for s in opts.hf_assisted:
        check_hf_assisted(s)
    prompts = opts.prompts or heldout(max(10, opts.per_task + 1))  # one more than timed: the calibration prompt
    timed_prompts = first_per_task(prompts, opts.per_task)
    rest = [tp for tp in prompts if tp not in timed_prompts]
    calib = rest[0] if rest else timed_prompts[0]
    tasks = [t for t, _ in timed_prompts]
    tiers: dict[str, list[str]] = {}
    for tier, mode in settings:
        tiers.setdefault(tier, []).append(mode)
    res: dict = dict(settings={}, tiers={}, timed_prompts=len(timed_prompts), max_new_tokens=opts.max_new,
                     ks=_ks(opts), repeats=opts.repeats, calibration_prompt=calib[1][:60],
                     speckv=None if opts.controller is not None else opts.speckv_note)
    first, warm = True, None
    for tier, modes in tiers.items():
        pairs = {label(tier, m): load(tier, MODES[m]) for m in modes}
        labels = list(pairs)
        if first:  # what the pair is, and the draft model's own figures, once
            p0 = pairs[labels[0]]
            res.update(target=p0.target_name, draft=p0.draft_name, draft_tier=p0.draft_tier, eagle=p0.eagle_name or None,
                       device=str(p0.device), threads=torch.get_num_threads(), proposers_available=list(available(p0)),
                       kernels=kernel_report(p0))
        timed = [encode_prompt(pairs[labels[0]].tokenizer, p, chat=True) for _, p in timed_prompts]
        if warm is None and opts.suffix_history > 0 and "suffix" in _proposers(pairs[labels[0]], opts):
            say(f"suffix: the warm history, outputs of {opts.suffix_history} untimed prompt(s) per task…")
            warm = greedy_history(pairs[labels[0]], [p for _, p in first_per_task(rest, opts.suffix_history)], opts.max_new)
        entries, contexts, policies, ctxs = [], {}, {}, {}
        for where, pair in pairs.items():
            say(f"{where}: measuring costs{' and calibrating them' if opts.calibrate_tokens else ''}…")
            ctx, info = setting_context(pair, tier, opts, calib)
            contexts[where], ctxs[where] = info, ctx
            policies[where] = policies_for(pair, opts, opts.controller is not None)
            entries += [Entry(p, where, speclab_runner(pair, p, ctx)) for p in policies[where]]
            if warm is not None and f"fixed:{GAMMA}@suffix" in policies[where]:
                entries.append(Entry(SUFFIX_WARM, where, speclab_runner(pair, f"fixed:{GAMMA}@suffix", ctx, warm)))
        # HF generate, the exactness reference, and the @kernels peers on the exact setting's pair
        # (the tier's kernels); the stock peers on the pair whose target runs HF's own forward (the
        # fast or default mode's)
        hf_where = next((w for w, m in zip(labels, modes) if m != "exact"), labels[0])
        ref_where = next((w for w, m in zip(labels, modes) if m == "exact"), hf_where)
        assisted = opts.hf_assisted and tier not in opts.ar_tiers
        assistants = {w: hf_assistant(pairs[w]) for w in {hf_where, ref_where}} if assisted else {}
        for s in hf_settings(opts, tier):
            w = ref_where if s == "hf_generate" or s.endswith(KERNELS) else hf_where
            entries.append(Entry(s, tier, hf_runner(pairs[w], s, assistants.get(w))))
        say(f"{tier}: timing {len(entries)} policies and peers on {len(timed)} prompts × {opts.repeats}…")
        results = time_tier(entries, timed, opts, say)
        hf = {s: results[(tier, s)] for s in hf_settings(opts, tier)}
        tables = {w: setting_table(w, tier, m, pairs[w], policies[w], results, tasks, hf["hf_generate"], contexts[w])
                  for w, m in zip(labels, modes)}
        for w, t in tables.items():
            if (w, SUFFIX_WARM) in results:
                t["proposers"]["suffix warm"] = warm_stats(t["proposers"]["suffix"], results[(w, SUFFIX_WARM)], tasks)
        for w, m in zip(labels, modes):
            if m != "fast":  # exactness with prefix reuse on (the timed runs had none): untimed
                best = tables[w]["best_policy"]  # and rakv, the default adaptive policy (a context of its own)
                rakv = next(p for p in policies[w] if p.startswith("rakv"))
                tables[w]["with_prefix_reuse"] = reuse_check(pairs[w], ctxs[w], ["ar", best, rakv], timed,
                                                             [r["output"] for r in hf["hf_generate"]], opts.max_new, say)
        res["settings"].update(tables)
        res["tiers"][tier] = tier_table(tier, tables, hf, tasks)
        if first:
            res.update(_draft_figures(pairs[labels[0]], prompts, timed_prompts, results, labels[0], opts))
            first = False
        del pairs, entries, assistants
    if "fp32" in tiers and len(tiers) > 1 and opts.sweep:
        res["ar_tok_s_one_rotation"] = ar_rotation(load, list(tiers), timed, opts)
    res.update(headline(res))
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


def ar_rotation(load: Callable[[str, bool | None], ModelPair], tiers: list[str], timed: list[list[int]],
                opts: Options) -> dict[str, float]:
    """Plain decoding (`ar`) at every tier, {tier: tok/s}, the tiers interleaved prompt by prompt
    in one rotation (time_tier): a machine whose speed drifts slows every tier alike, which tiers
    timed minutes apart in their own rotations do not promise (`ar_vs_fp32` is read from here)."""
    opts.say(f"plain decoding of {', '.join(tiers)} in one rotation…")
    pairs = {t: load(t, None) for t in tiers}  # each tier's default verify mode: exact on a CPU
    entries = [Entry("ar", t, speclab_runner(p, "ar", None)) for t, p in pairs.items()]
    runs = time_tier(entries, timed, opts, opts.say)
    return {t: tok_s_of(runs[(t, "ar")], list(range(len(timed)))) for t in tiers}


def _draft_figures(pair: ModelPair, prompts, timed_prompts, results, where: str, opts: Options) -> dict:
    """The draft model's teacher-forced agreement (along ar's outputs: the target's greedy ones)
    and its raw forward cost against the target's, as this benchmark reported them before."""
    n = opts.agreement_per_task or opts.per_task
    chosen = first_per_task(prompts, max(n, 1))
    ar_out = {p: r["output"] for (_, p), r in zip(timed_prompts, results[(where, "ar")])}
    by_task: dict[str, list[int]] = {}
    for task, p in chosen:
        ids = encode_prompt(pair.tokenizer, p, chat=True)
        resp = ar_out.get(p)
        if resp is None:  # a prompt not timed: the target's greedy response, untimed
            resp = open_generation(pair, Request(p, "ar", max_new_tokens=opts.max_new), context=None,
                                   prompt_ids=ids).run().token_ids
        h, k = agreement(pair, ids, resp)
        tally = by_task.setdefault(task, [0, 0])
        tally[0], tally[1] = tally[0] + h, tally[1] + k
    hits, total = (sum(col) for col in zip(*by_task.values()))
    ctx = encode_prompt(pair.tokenizer, timed_prompts[0][1], chat=True) * 2  # a mid-length context
    draft_ms = draft_step_ms(pair, ctx, opts.forward_reps)
    target_ms = per_token_ms(pair.target, ctx, pair.device, opts.forward_reps)
    return dict(agreement=hits / max(total, 1), agreement_positions=total, agreement_prompts=len(chosen),
                agreement_by_task={t: h / max(k, 1) for t, (h, k) in by_task.items()},
                draft_ms=draft_ms, target_ms=target_ms, draft_cost_ratio=draft_ms / target_ms)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench draft", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tiers", default=None, help="target tiers timed (supersedes --target-tier); "
                   "with --verify auto (the default) bf16/fp16 are timed in both verify modes, exact and fast; "
                   f"{', '.join(Options.ar_tiers)} for their plain step, exactness and one speculative setting")
    p.add_argument("--long", action="store_true", help=f"{LONG_PER_TASK} held-out prompts per task, fp32 and bf16 "
                   "exact (unless --tiers/--verify say otherwise), ar, fixed γ with the draft, rakv and HF generate: "
                   "intervals near ±3%% (about an hour)")
    p.add_argument("--max-new-tokens", type=int, default=Options.max_new)
    p.add_argument("--prompts-per-task", type=int, default=Options.per_task, help="held-out prompts per task for timing")
    p.add_argument("--ks", default=",".join(map(str, Options.ks)),
                   help=f"fixed γ values per proposer (γ = {GAMMA} always runs: τ)")
    p.add_argument("--proposers", default=None, help="proposers to time (default: every one the pair has)")
    p.add_argument("--hf-assisted", default=",".join(HF_ASSISTED), help=f"HF assisted settings: {HF_ASSISTED_KNOWN}")
    p.add_argument("--hf-lookup", default="4", help="HF prompt_lookup_num_tokens values ('' for none)")
    p.add_argument("--cost-buckets", default="64", help="contexts the cost table is measured at")
    p.add_argument("--cost-reps", type=int, default=3, help="timed repetitions per cost point (after the warm-up rounds)")
    p.add_argument("--calibrate-tokens", type=int, default=24, help="length of the calibration runs (0: none)")
    p.add_argument("--agreement-per-task", type=int, default=None,
                   help="held-out prompts per task for the draft's agreement (default: the timed ones; 10: all)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--suffix-history", type=int, default=2, help="untimed held-out prompts per task whose greedy "
                   "outputs are the suffix proposer's warm history (0: cold only)")
    p.add_argument("--db", default=None, help="a DuckDB file holding a trained speckv controller: speckv is timed too")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from engine.service import parse_tiers

    if a.long:
        a.prompts_per_task, a.suffix_history = LONG_PER_TASK, 0
        a.tiers = a.tiers or "fp32,bf16"
    opts = Options(per_task=a.prompts_per_task, max_new=a.max_new_tokens, ks=_ints(a.ks),
                   proposers=tuple(x for x in a.proposers.split(",") if x) if a.proposers else None,
                   hf_assisted=tuple(x for x in a.hf_assisted.split(",") if x), hf_lookup=_ints(a.hf_lookup),
                   cost_buckets=_ints(a.cost_buckets), cost_reps=a.cost_reps, calibrate_tokens=a.calibrate_tokens,
                   agreement_per_task=a.agreement_per_task, repeats=a.repeats, suffix_history=a.suffix_history,
                   sweep=not a.long)
    for s in opts.hf_assisted:
        check_hf_assisted(s)
    if a.db:
        opts.controller, opts.speckv_note = _controller(a.db)
    settings = settings_for(parse_tiers(a.tiers or "fp32,bf16,int8,int4"), a.verify)
    if a.long and a.verify == "auto":  # the exact verify's intervals: the fast one drifts from the target
        settings = [(t, m) for t, m in settings if m != "fast"]

    def load(tier: str, exact: bool | None) -> ModelPair:
        return load_pair(a.target, a.draft, tier, a.draft_tier, a.device, a.trust_remote_code,
                         exact_verify=exact, eagle=a.eagle)

    res = measure(load, settings, opts)
    print(json.dumps(res, default=str) if a.json else format_report(res))
    same = res["exact_identical_to_hf_generate"]
    if same is not None and same < 1.0:
        print(f"error: an exact setting's output differs from HF generate's (identical on {same:.0%} of runs "
              "at the worst policy): see first_divergence", file=sys.stderr)
        return 1
    return 0


def _controller(db: str) -> tuple[Callable | None, str | None]:
    """speckv's controller loader from `db` (loaded now, the file closed after), or why not."""
    from engine.service import controller_loader
    from store import Store

    try:
        with Store(db, read_only=True) as st:
            load = controller_loader(st)
            load("speckv", None)  # the active version, cached while the file is open
    except Exception as e:  # noqa: BLE001 - no file, no controller: rakv alone, and the report says why
        return None, f"speckv not run: no speckv controller in {db} ({' '.join(str(e).split())[:160]})"
    return load, None


if __name__ == "__main__":
    sys.exit(main())
