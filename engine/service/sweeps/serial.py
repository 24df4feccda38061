"""Prompt sets, tracing and profiling sweeps (their jobs, resumable under a sweep name) and their tables."""
from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping

from engine.base.helpers import csv_list, one_line
from engine.base.names import tiers_of
from engine.base.stats import prompts_for, ratio_ci95
from engine.decode.policies import NEEDS_CONTEXT, parse_policy, split_spec
from engine.lab.whatif import tier_label
from engine.service.costs.tables import measure_in_turns, policy_context, reach
from store import Store

TRACE_POLICIES = "ar,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,fixed:8,heuristic,rules,speckv,rakv"


@dataclass(frozen=True)
class Job:
    tier: str  # the target's weight tier
    task: str
    prompt: str
    policy: str
    kv_tier: str = "native"  # the target's KV cache tier

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What a stored run of the sweep is matched on: (tier, KV tier, prompt, policy)."""
        return (self.tier, self.kv_tier, self.prompt, self.policy)


def sweep_jobs(prompts: Iterable[tuple[str, str]], tiers: list[str], policies: list[str],
               kv_tiers: Iterable[str] = ("native",)) -> list[Job]:
    """Tier-major (a tier's models load once), then KV tier (a policy context per KV tier), then
    prompt, then policy."""
    prompts, kv_tiers = list(prompts), list(kv_tiers)
    return [Job(t, task, p, pol, kv) for t, kv, (task, p), pol in itertools.product(tiers, kv_tiers, prompts, policies)]


def pending(jobs: list[Job], done: set[tuple[str, str, str, str]]) -> list[Job]:
    """Jobs whose (tier, KV tier, prompt, policy) has no stored run in this sweep yet: a rerun resumes."""
    return [j for j in jobs if j.key not in done]


def prompt_set(which: str, per_task: int | None) -> list[tuple[str, str]]:
    """(task, prompt) pairs of a named set: heldout, bench or train."""
    from engine.datasets import prompts as P

    sets = {"heldout": lambda: P.heldout(per_task), "bench": lambda: P.bench_prompts(per_task or 2),
            "train": lambda: P.training_prompts(per_task or 10)}
    if which not in sets:
        raise ValueError(f"unknown prompt set {which!r}; use one of {', '.join(sets)}")
    return sets[which]()


def _known(text: str, known: tuple[str, ...], what: str) -> list[str]:
    """Comma-separated names, each one of `known`, at least one."""
    names = csv_list(text)
    bad = [t for t in names if t not in known]
    if bad or not names:
        raise ValueError(f"unknown {what}(s) {', '.join(bad) or '(none)'}; known: {', '.join(known)}")
    return names


def parse_tiers(text: str | None, engine: str | None = "torch") -> list[str]:
    """Comma-separated target tiers of `engine` (None: of any engine, as stored runs and traces
    hold them), checked; None: its default (fp32; q4_1 on llama.cpp)."""
    known = tiers_of(engine)[0]
    return _known(text or known[0], known, "tier")


def parse_kv_tiers(text: str, engine: str | None = "torch") -> list[str]:
    """Comma-separated KV tiers of `engine` (torch: native, fp8, int8; None: any engine's), checked."""
    return _known(text, tiers_of(engine)[1], "KV tier")


# -- traces and sweeps ---------------------------------------------------------------------------
def trace_prompts(st: Store, pair, prompts: list[tuple[str, str]], max_new_tokens: int,
                  temperature: float | None = None, on_start: Callable[[int], None] = lambda n: None,
                  on_trace: Callable[[], None] = lambda: None, kv_tier: str = "native",
                  turns: Callable[[Iterable[Any]], Iterable[Any]] = lambda steps: steps) -> int:
    """Traces the prompts not yet traced for this pair, tier, KV tier and length with every
    proposer the pair has (a rerun resumes; a prompt traced before a proposer existed is traced
    again, and its newest trace is the one replayed); each is stored as it is made. A trace's
    steps are taken through `turns` (the workbench: a hold of its decode slot each). Returns how
    many were made."""
    from engine.lab.profiling import tracing
    from engine.oracles import available

    have = st.traces(target=pair.target_name, draft=pair.draft_name, target_tier=pair.target_tier,
                     kv_tier=kv_tier, max_new_tokens=max_new_tokens)
    held = st.trace_proposers() if len(have) else {}
    need = set(available(pair))
    # A one-token output has no positions to hold proposals: done as it is.
    # A trace from before token trees (its config names no tree_width) is made again too.
    done = {r["prompt"] for r in have.to_dict("records")
            if (need <= set(held.get(r["trace_id"], ())) and "tree_width" in _config(r)) or len(r["token_ids"]) <= 1}
    todo = [(task, prompt) for task, prompt in prompts if prompt not in done]
    on_start(len(todo))
    for task, prompt in todo:
        *_, tr = turns(tracing(pair, prompt, task, max_new_tokens, temperature=temperature, kv_tier=kv_tier))
        st.add_trace(tr.row, tr.positions)
        on_trace()
    return len(todo)


def _config(row: Mapping[str, Any]) -> dict:
    config = row.get("config")
    return json.loads(config) if isinstance(config, str) else config if isinstance(config, dict) else {}


def cell_key(run: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """A stored run's sweep cell, as `profiling.Job.key` names it: (tier, KV tier, prompt, policy);
    a run stored before KV tiers is native."""
    kv_tier = run["kv_tier"] if isinstance(run["kv_tier"], str) else "native"
    return run["target_tier"], kv_tier, run["prompt"], run["policy"]


def stored_keys(st: Store, sweep: str) -> set[tuple[str, str, str, str]]:
    """The cells of every run stored in the sweep: what a rerun skips, serially or on a cluster
    (service/sweeps/cluster_sweep.py)."""
    return {cell_key(r) for r in st.runs(sweep=sweep).to_dict("records")}


def failed_row(job, names: Mapping[str, Any], reason: str, max_new_tokens: int, chat: bool = True) -> dict:
    """The `runs` row of a sweep cell that failed: its key, the pair (`names`: target, draft,
    draft_tier, device) and the one-line reason. A rerun of the sweep skips it like any stored cell."""
    return dict(target=names["target"], draft=names["draft"], target_tier=job.tier, kv_tier=job.kv_tier,
                device=names["device"], policy=job.policy, prompt=job.prompt, task=job.task, chat=chat,
                max_new_tokens=max_new_tokens, n_tokens=0, n_steps=0, stop_reason="error", error=reason,
                config=dict(draft_tier=names.get("draft_tier")))


def profile(st: Store, sweep: str, jobs: list, load: Callable[[str], object], max_new_tokens: int,
            on_start: Callable[[int], None] = lambda n: None, on_run: Callable[[], None] = lambda: None,
            say: Callable[[str], None] = lambda m: None,
            guard: Callable[[Any], ContextManager[Any]] = lambda job: contextlib.nullcontext(),
            turns: Callable[[Iterable[Any]], Iterable[Any]] = lambda steps: steps) -> int:
    """Runs the sweep's jobs that have no stored run in it yet, tier by tier (a tier's pair loads
    once, through `load(tier)`), then KV tier by KV tier (the cost table policies weigh is the
    KV tier's); each run is stored as it finishes, so an interrupted sweep keeps what it did and
    a rerun resumes. A cell that raises (bad input: a prompt over the context, a policy the pair
    cannot run) is stored as failed with its one-line reason and the sweep goes on, as on a
    cluster. Each bucket of a KV tier's cost measurement and each run's opening run inside
    `guard(job)`: the workbench takes its decode slot there, and stops a sweep between runs by
    raising from it (engine/service/sweeps/jobs.py). A run's steps are taken through `turns(gen)`, as
    a trace's are in trace_prompts: the workbench takes the slot a step at a time there
    (engine/lab/decode_lock.stepped), so a session's Generate waits for a step of the sweep's run, not
    for the whole run. Returns how many ran."""
    from engine.lab.generation import encode_prompt
    from engine.runtime.models import pair_device
    from engine.service.generation import Request, keep, open_generation

    todo = pending(jobs, stored_keys(st, sweep))
    on_start(len(todo))
    for tier in dict.fromkeys(j.tier for j in todo):
        pair = load(tier)
        for kv_tier in dict.fromkeys(j.kv_tier for j in todo if j.tier == tier):
            mine = [j for j in todo if j.tier == tier and j.kv_tier == kv_tier]
            learned = any(parse_policy(j.policy)[0] in NEEDS_CONTEXT for j in mine)
            ctx = None
            if learned:  # priced up to the longest prompt's reach (encoded as Request's chat default does)
                longest = max(len(encode_prompt(pair.tokenizer, j.prompt, True)) for j in mine)
                upto = reach(longest, max_new_tokens)
                measure_in_turns(st, pair, kv_tier, upto, lambda: guard(mine[0]), say)
                with guard(mine[0]):
                    ctx = policy_context(st, pair, say, kv_tier, upto)
            for job in mine:
                req = Request(job.prompt, job.policy, task=job.task, max_new_tokens=max_new_tokens,
                              kv_tier=job.kv_tier, sweep=sweep)
                error: Exception | None = None  # one cell's bad input must not end the sweep
                with guard(job):  # a stop is heard here; the slot is held while the run opens
                    try:
                        gen = open_generation(pair, req, None, ctx)
                    except Exception as e:  # noqa: BLE001 - stored as failed below
                        error = e
                if error is None:
                    try:
                        for _ in turns(gen):
                            pass
                    except Exception as e:  # noqa: BLE001 - stored as failed below
                        error = e
                if error is None:
                    keep(gen, req, st)
                else:
                    names = dict(target=pair.target_name, draft=pair.draft_name, draft_tier=pair.draft_tier,
                                 device=pair_device(pair))
                    st.add_run(dict(failed_row(job, names, one_line(error), max_new_tokens), sweep=sweep), [])
                    say(f"{job.policy} on {job.prompt[:30]!r} failed, stored as failed: {one_line(error)}")
                on_run()
        del pair
    return len(todo)


def sweep_table(runs) -> dict:
    """Per tier (`fp32`; `fp32/fp8` for a KV tier off native): tokens/s of each policy (all
    tokens over all wall time of its runs; a prompt run several times counts once, at its median
    wall time, so a passing slowdown of the machine does not land on whichever policy ran then),
    the best fixed γ (any proposer: `fixed:4@ngram` counts as γ 4), and each adaptive policy against
    max(ar, best fixed)."""
    out = {}
    if "error" in runs:  # a cell stored as failed (a cluster sweep goes on past it) has no speed
        runs = runs[runs["error"].isna()]
    kv = runs["kv_tier"].fillna("native").tolist() if "kv_tier" in runs else ["native"] * len(runs)
    labels = [tier_label(t, k) for t, k in zip(runs["target_tier"], kv)]
    for tier, df in runs.assign(_setting=labels).groupby("_setting", sort=True):
        per_prompt = df.groupby(["policy", "prompt"])[["n_tokens", "wall_ms"]].median()
        sums = per_prompt.groupby(level="policy").sum()
        tps = {pol: float(r.n_tokens / (r.wall_ms / 1e3)) for pol, r in sums.iterrows()}
        fixed = {p: v for p, v in tps.items() if p.startswith("fixed:")}
        best_fixed = max(fixed, key=fixed.get) if fixed else None
        peer = max([tps.get("ar", 0.0)] + ([fixed[best_fixed]] if best_fixed else []))
        peer_policy = best_fixed if best_fixed and fixed[best_fixed] >= tps.get("ar", 0.0) else "ar"
        gamma = int(split_spec(best_fixed)[0].split(":")[1]) if best_fixed else None  # `fixed:4@ngram`: 4
        adaptive = [p for p in tps if not p.startswith("fixed:") and p != "ar"]
        n = int(df["prompt"].nunique())
        ci = {p: _ci(per_prompt, p, peer_policy) for p in adaptive if peer_policy in tps}
        out[tier] = dict(tokens_per_s=tps, best_fixed=best_fixed, best_gamma=gamma, peer=peer, peer_policy=peer_policy,
                         vs_peer={p: tps[p] / peer for p in adaptive}, vs_peer_ci95=ci,
                         # what ±3% would take: an interval's width shrinks as 1/√prompts
                         vs_peer_prompts_for_3pct={p: prompts_for(c, tps[p] / peer, n) for p, c in ci.items()},
                         vs_ar={p: tps[p] / tps["ar"] for p in tps if "ar" in tps},
                         vs_ar_ci95={p: _ci(per_prompt, p, "ar") for p in tps if "ar" in tps},
                         prompts=n)
    return out


def _ci(per_prompt, a: str, b: str) -> tuple[float, float]:
    """95% bootstrap interval (over the prompts both ran) of policy a's speed over policy b's."""
    both = per_prompt.loc[a].merge(per_prompt.loc[b], left_index=True, right_index=True, suffixes=("_a", "_b"))
    return ratio_ci95(both["n_tokens_a"], both["wall_ms_a"], both["n_tokens_b"], both["wall_ms_b"])


def format_sweep(table: dict) -> str:
    lines = []
    for tier, t in table.items():
        lines.append(f"{tier}: {t['prompts']} prompts; best fixed γ = {t['best_gamma']}; peer max(ar, best fixed) = {t['peer']:.2f} tok/s")
        for pol, v in sorted(t["tokens_per_s"].items(), key=lambda kv: -kv[1]):
            rel = f"  {t['vs_ar'][pol]:.3f}× ar {_interval(t['vs_ar_ci95'].get(pol))}" if pol in t.get("vs_ar", {}) else ""
            if pol in t["vs_peer"]:
                rel += f"  {t['vs_peer'][pol]:.3f}× peer {_interval(t.get('vs_peer_ci95', {}).get(pol))}"
                if need := t.get("vs_peer_prompts_for_3pct", {}).get(pol):
                    rel += f" (±3% needs ~{need} prompts)"
            lines.append(f"  {pol:14} {v:7.2f} tok/s{rel}")
    return "\n".join(lines)


def _interval(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
