"""γ controllers against their peers, measured in one run.

    decision   median ms of one `speckv` decision (our numpy MLP over the candidate γs, the
               objective included) vs sklearn's `predict` on the same rows, the paper's way
               (and its published 0.336 ms); the MLP is trained on the SpecKV file
    live       per target tier, on held-out prompts never trained on: `ar`, `fixed:k@p` for every
               proposer p the pair has (--proposers), `speckv` and `rakv` end to end (wall clock,
               same run, policies interleaved per prompt in a rotating order, each (prompt,
               policy) run --repeats times, its median counted); `speckv` is first retrained from
               acceptance traces (every proposer's) of other held-out prompts (the draft never
               saw either half), the cost table is calibrated against live `ar`/`fixed:1,2,4`
               steps on those same training prompts, and each adaptive policy is reported
               against max(ar, best fixed proposer × γ) of its tier; the suffix proposer's
               cross-request history is the training prompts' outputs (never a tested prompt's)

Run: python bench/controllers.py decision|live [--json]   or   python -m engine bench controllers …"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.base.names import DATA_DIR
from engine.datasets.prompts import first_per_task

VERIFY = ("auto", "exact", "fast")  # engine.base.flags.VERIFY_MODES (imported there with torch)

PAPER_DECISION_MS = 0.336
CALIBRATION_POLICIES = ("ar", "fixed:1", "fixed:2", "fixed:4")
# Each other proposer's `fixed:4@p` on this many training prompts a task: enough steps of its own
# for its own cost factor (engine/decode/costs.calibrate), which the draft's steps do not tell.
OTHER_CALIBRATION_PROMPTS = 1
SPECKV_CSV = DATA_DIR / "speckv-phase2" / "phase2_step_results.csv"


def decision(csv: Path, n: int = 5000) -> dict:
    from sklearn.neural_network import MLPRegressor

    from engine.base.helpers import median_ms
    from engine.datasets.speckv_csv import import_speckv
    from engine.decode.acceptance import PAPER_CANDIDATES, feature_rows, tokens_from_rate
    from engine.decode.policies.learned import SpeckvPolicy
    from engine.decode.records import DecodeState
    from engine.training.retrain import fit_mlp, from_speckv_steps
    from store import Store

    with Store(":memory:") as st:
        import_speckv(st, csv)
        ex = from_speckv_steps(st.steps(), st.runs())
    ours = SpeckvPolicy(fit_mlp(ex.x, ex.y), None, objective="paper")
    ref = MLPRegressor(hidden_layer_sizes=(16,), max_iter=500, random_state=42).fit(ex.x, ex.y)
    state = DecodeState(step=1, position=1, context_len=64, remaining=100, target_tier="int8", kv_tier="native")

    def sklearn_decision() -> int:  # the paper's loop: one predict per candidate γ
        sig = ours.predictor.defaults
        best, val = 0, -1.0
        for g in PAPER_CANDIDATES:
            e = tokens_from_rate(g, float(np.clip(ref.predict(feature_rows(sig, "int8", (g,)))[0], 0, 1)))
            best, val = (g, e) if e > val else (best, val)
        return best

    ms = median_ms(lambda: ours.choose(state), n - n // 10, warmup=n // 10)
    sk_n = max(200, n // 10)
    sk = median_ms(sklearn_decision, sk_n - sk_n // 10, warmup=sk_n // 10)
    return dict(decision_ms_median=ms, sklearn_decision_ms_median=sk, speedup_vs_sklearn=sk / ms,
                paper_decision_ms=PAPER_DECISION_MS, vs_paper=ms / PAPER_DECISION_MS, decisions=n)


def split_heldout(prompts: list[tuple[str, str]], n_train: int, n_eval: int) -> tuple[list, list]:
    """The controller must learn from prompts the draft never saw (on its own training prompts
    the draft is far more often right, and a controller trained there over-speculates), and be
    judged on others: per task, held-out prompts alternate between its traces and the live test."""
    by_task: dict[str, list[str]] = {}
    for task, prompt in prompts:
        by_task.setdefault(task, []).append(prompt)
    train = [(t, p) for t, ps in by_task.items() for p in ps[0::2][:n_train]]
    test = [(t, p) for t, ps in by_task.items() for p in ps[1::2][:n_eval]]
    return train, test


def live(a: argparse.Namespace) -> dict:
    from engine.base.flags import VERIFY_MODES
    from engine.datasets import prompts as P
    from engine.runtime.models import load_pair
    from engine.service import (
        calibrate_costs,
        cost_key,
        cost_table,
        policy_context,
        retrain,
        suffix_history,
        sweep_table,
        trace_prompts,
    )
    from engine.service.generation import Request, generate
    from store import Store

    db = a.db or str(Path(tempfile.mkdtemp(prefix="speclab-bench-")) / "controllers.duckdb")
    tiers = a.tiers.split(",")
    # Held-out prompts alternate between training and test: twice the larger count a task (real ones past the file's 10).
    train_prompts, held = split_heldout(P.heldout(2 * max(a.per_task, a.train_per_task)), a.train_per_task, a.per_task)
    sweep = f"bench-{int(time.time())}"
    exact = VERIFY_MODES[getattr(a, "verify", "auto")]
    load = lambda tier: load_pair(a.target, a.draft, tier, a.draft_tier, a.device,  # noqa: E731
                                  exact_verify=exact, eagle=getattr(a, "eagle", None))
    policies: list[str] = []
    with Store(db) as st:
        factors, own_factors = {}, {}
        for tier in tiers:  # per tier, on the training prompts: costs, traces, calibration runs
            pair = load(tier)
            policies = policies or live_policies(pair, a.ks, getattr(a, "proposers", None))
            cost_table(st, pair)
            trace_prompts(st, pair, train_prompts, a.max_new_tokens)
            others = calibration_others(policies, train_prompts)
            for task, prompt in train_prompts:  # live steps the costs are calibrated with (not judged)
                for pol in CALIBRATION_POLICIES + others.get((task, prompt), ()):
                    generate(pair, Request(prompt, pol, task=task, max_new_tokens=a.max_new_tokens,
                                           sweep=f"{sweep}-calibration"), st, context=None)
            cal = calibrate_costs(st, cost_key(pair))
            factors[tier], own_factors[tier] = cal.step_factor, cal.proposer_factor
            own = "".join(f"; {p}'s own at k=4 {f[4]:.2f}" for p, f in cal.proposer_factor.items())
            print(f"{tier}: {len(train_prompts)} traces for the controller; live / measured step time k=0..8: "
                  + " ".join(f"{f:.2f}" for f in factors[tier]) + own, file=sys.stderr)
            del pair
        report = retrain(st, "traces", "prompt")
        print(f"speckv v{report.version}: test corr {report.test_corr:.3f}, replay gain vs fixed:4 "
              f"{report.whatif_gain_vs_fixed4:+.1%}", file=sys.stderr)
        for tier in tiers:
            pair = load(tier)
            ctx = policy_context(st, pair)
            # What a server would have seen: the training prompts' outputs, never a held-out one's (frozen:
            # a policy must not find another policy's output of the same prompt).
            history = suffix_history(st, pair, prompts={p for _, p in train_prompts}).snapshot()
            for rep in range(a.repeats):
                for i, (task, prompt) in enumerate(held):
                    # Policies interleaved per prompt, their order rotated: drift hits all alike.
                    shift = (i + rep) % len(policies)
                    for pol in policies[shift:] + policies[:shift]:
                        generate(pair, Request(prompt, pol, task=task, max_new_tokens=a.max_new_tokens, sweep=sweep),
                                 st, context=ctx, history=history)
            print(f"{tier}: {len(held)} held-out prompts × {len(policies)} policies × {a.repeats} done", file=sys.stderr)
            del pair
        runs = st.runs(sweep=sweep)
        table = sweep_table(runs)
        steps = st.steps()
        adaptive = [p for p in policies if p.startswith(("rakv", "speckv"))]
        where = {f"{pol} vs {t['peer_policy']}": where_time_goes(runs[runs.target_tier == tier], steps, pol, t["peer_policy"])
                 for tier, t in table.items() for pol in adaptive}
    for t in table.values():  # the best fixed γ of each proposer (sweep_table's best_fixed is the best of all)
        fixed = {p: v for p, v in t["tokens_per_s"].items() if p.startswith("fixed:")}
        by: dict[str, str] = {}
        for p, v in fixed.items():
            who = p.partition("@")[2] or "draft"
            if who not in by or v > fixed[by[who]]:
                by[who] = p
        t["best_fixed_by_proposer"] = by
    return dict(db=db, sweep=sweep, controller=report.to_dict(), step_factor=factors, proposer_factor=own_factors,
                tiers=table, where=where,
                policies=policies, verify=getattr(a, "verify", "auto"))


STEP_KINDS = {  # a step's kind, for where an adaptive policy's time goes
    "plain": lambda s: s.k_drafted == 0,
    "probe (γ 1, rejected)": lambda s: (s.k_drafted == 1) & (s.accepted == 0),
    "draft, all rejected": lambda s: (s.k_drafted > 1) & (s.accepted == 0),
    "draft, some accepted": lambda s: (s.k_drafted > 0) & (s.accepted > 0),
}


def where_time_goes(runs, steps, policy: str, against: str = "ar") -> dict:
    """Per tier, where `policy`'s time goes against `against` on the same prompts (stored runs and
    steps of one sweep): each kind of step's tokens and milliseconds, and its excess over what its
    tokens cost `against` (its ms per token on that prompt), plus the decisions and what the step
    clock does not see (prefill, bookkeeping). The excesses add up to the policy's total loss."""
    out = {}
    for tier, df in runs.groupby("target_tier"):
        mine, theirs = df[df.policy == policy], df[df.policy == against]
        rate = (theirs.groupby("prompt").wall_ms.sum() / theirs.groupby("prompt").n_tokens.sum()).to_dict()
        st = steps[steps.run_id.isin(mine.run_id)].merge(mine[["run_id", "prompt"]], on="run_id")
        st = st[st.step > 0]
        st = st.assign(ms=st.draft_ms + st.verify_ms, cost_there=st.emitted * st.prompt.map(rate))
        rows = {}
        for kind, pick in STEP_KINDS.items():
            sel = st[pick(st)]
            rows[kind] = dict(steps=len(sel), tokens=int(sel.emitted.sum()), ms=float(sel.ms.sum()),
                              excess_ms=float((sel.ms - sel.cost_there).sum()))
        rows["decisions"] = dict(steps=len(st), tokens=0, ms=float(st.decide_ms.sum()), excess_ms=float(st.decide_ms.sum()))
        first = mine.wall_ms.sum() - st.ms.sum() - st.decide_ms.sum()  # prefill and what no step clock sees
        there = sum(r.n_tokens * rate[r.prompt] for r in mine.itertuples()) - st.cost_there.sum()
        rows["prefill and the rest"] = dict(steps=len(mine), tokens=int(mine.n_tokens.sum() - st.emitted.sum()),
                                            ms=float(first), excess_ms=float(first - there))
        total = float(mine.wall_ms.sum())
        out[tier] = dict(policy=policy, against=against, total_ms=total, rows=rows,
                         loss_ms=sum(r["excess_ms"] for r in rows.values()))
    return out


def format_where(where: dict) -> str:
    lines = []
    for tier, w in where.items():
        lines.append(f"{tier}: where {w['policy']}'s {w['total_ms'] / 1e3:.1f} s go against {w['against']} on the same "
                     f"prompts (excess: ms over what those tokens cost {w['against']}); net {w['loss_ms'] / 1e3:+.1f} s "
                     f"({w['loss_ms'] / w['total_ms']:+.1%} of its time)")
        for kind, r in w["rows"].items():
            lines.append(f"  {kind:24} {r['steps']:6d} steps {r['tokens']:6d} tokens {r['ms'] / 1e3:8.1f} s   "
                         f"excess {r['excess_ms'] / 1e3:+7.1f} s ({r['excess_ms'] / w['total_ms']:+.1%})")
    return "\n".join(lines)


def calibration_others(policies: list[str], prompts: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[str, ...]]:
    """(task, prompt) → the `fixed:4@p` calibration runs of the proposers other than the draft
    model among `policies`, on the first OTHER_CALIBRATION_PROMPTS prompts of each task."""
    others = tuple(dict.fromkeys(f"fixed:4@{p.partition('@')[2]}" for p in policies
                                 if p.startswith("fixed:") and p.partition("@")[2] not in ("", "draft")))
    return {tp: others for tp in first_per_task(prompts, OTHER_CALIBRATION_PROMPTS)}


def live_policies(pair, ks: str, proposers: str | None) -> list[str]:
    """ar, fixed:k@p for every k and proposer p (default: every one the pair has), speckv and
    rakv (choosing among those proposers: `rakv@draft+ngram` when they are not all the pair's)."""
    from engine.oracles import available, check_proposers

    have = available(pair)
    names = check_proposers(pair, tuple(x for x in proposers.split(",") if x)) if proposers else have
    at = "" if names == have else "@" + "+".join(names)
    return (["ar"] + [f"fixed:{k}@{p}" for p in names for k in ks.split(",") if k.strip()]
            + [f"speckv{at}", f"rakv{at}"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench controllers", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("decision", "live"))
    p.add_argument("--csv", default=str(SPECKV_CSV), help="SpecKV step CSV (decision)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--draft-tier", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--eagle", default=None, help="an EAGLE head directory (default: the embedded target's shipped head; off: none)")
    p.add_argument("--verify", default="auto", choices=VERIFY, help="the target's verify mode "
                   "(auto: exact at bf16/fp16; see `python -m engine generate --help`)")
    p.add_argument("--proposers", default=None, help="proposers of the fixed:k@p policies, and the ones speckv/rakv "
                   "choose among (default: every one the pair has)")
    p.add_argument("--tiers", default="fp32,bf16")
    p.add_argument("--ks", default="1,2,3,4,6")
    p.add_argument("--per-task", type=int, default=2, help="held-out prompts per task run live (odd ones)")
    p.add_argument("--train-per-task", type=int, default=4, help="held-out prompts per task traced to train speckv (even ones)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="runs of each (prompt, policy); the median wall time counts")
    p.add_argument("--db", default=None, help="keep the live data in this DuckDB file (default: a temp file)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = decision(Path(a.csv)) if a.what == "decision" else live(a)
    if a.json:
        print(json.dumps(res, default=str))
    elif a.what == "decision":
        print(f"speckv decision (MLP 16, numpy, all candidates at once): {res['decision_ms_median']:.4f} ms median\n"
              f"  sklearn predict per candidate (the paper's loop):      {res['sklearn_decision_ms_median']:.4f} ms"
              f"  → ours {res['speedup_vs_sklearn']:.1f}× faster\n"
              f"  paper's published figure:                            {PAPER_DECISION_MS} ms → ours {res['vs_paper']:.3f}× of it")
    else:
        from engine.service import format_sweep

        print(format_sweep(res["tiers"]))
        for tier, t in res["tiers"].items():
            print(f"{tier}: best fixed per proposer: " + ", ".join(
                f"{p} {t['best_fixed_by_proposer'][p]} {t['tokens_per_s'][t['best_fixed_by_proposer'][p]]:.2f} tok/s"
                for p in t["best_fixed_by_proposer"]))
        for w in res["where"].values():
            print(format_where(w))
        print(f"(data in {res['db']}, sweep {res['sweep']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
