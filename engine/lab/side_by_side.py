"""Comparisons: two to four policies on the same prompts, run one after another on one loaded
pair (never two decodes at once: each run takes the process's decode slot, engine/lab/decode_lock.py), and
the figures the Compare page draws from them: a summary per policy, the γ each chose per step,
and where their outputs differ. Also the what-if table over stored traces.

Torch-free at import, like engine/service/: the generation modules are imported inside the
function that decodes, so the pages and tests can use the pure helpers without loading torch."""
from __future__ import annotations

import datetime as dt
import random
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import pandas as pd

from engine.base.helpers import first_difference as pairwise_difference
from engine.decode.policies import NEEDS_CONTEXT, make_policy, parse_policy

MIN_POLICIES, MAX_POLICIES = 2, 4
MAX_PROMPTS = 16  # one after another on 2 CPU cores: more is a sweep (the Profile page)
SUMMARY_COLUMNS = ["policy", "prompts", "tokens", "tokens_per_s", "ttft_ms", "acceptance_rate",
                   "mean_accepted", "tokens_per_step", "proposers"]
# The proposers every pair has (an EAGLE head is the pair's own: `proposers_of`), offered by the
# policy selectors before a pair is loaded.
BASE_PROPOSERS = ("draft", "ngram", "suffix")


@dataclass
class Result:
    """One live run of a comparison: the `runs` row and `steps` rows it is stored as."""

    policy: str
    prompt: str
    prompt_index: int  # which of the comparison's prompts (prompts may repeat)
    row: dict[str, Any]  # generation.run_row's
    steps: list[dict[str, Any]] = field(default_factory=list)  # asdict(StepRecord) per step

    @property
    def token_ids(self) -> list[int]:
        return list(self.row["token_ids"])


# -- inputs ----------------------------------------------------------------------------------------
def parse_prompts(text: str) -> list[str]:
    """One prompt per non-empty line; at least one, at most MAX_PROMPTS."""
    prompts = [line.strip() for line in (text or "").splitlines() if line.strip()]
    if not prompts:
        raise ValueError("enter at least one prompt (one per line)")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{len(prompts)} prompts; compare at most {MAX_PROMPTS} at once "
                         "(a longer set is a sweep: use the Profile page)")
    return prompts


def check_policies(policies: Sequence[str]) -> list[str]:
    """2–4 distinct, parseable policy specs, in the order given (one-line ValueError otherwise)."""
    specs = [p.strip() for p in policies if p and p.strip()]
    if len(set(specs)) != len(specs):
        raise ValueError(f"choose each policy once, got {', '.join(specs)}")
    if not MIN_POLICIES <= len(specs) <= MAX_POLICIES:
        raise ValueError(f"choose {MIN_POLICIES} to {MAX_POLICIES} policies to compare, got {len(specs)}")
    for spec in specs:  # arguments too (fixed:99), where that needs no cost table or controller
        if parse_policy(spec)[0] not in NEEDS_CONTEXT:
            make_policy(spec)
    return specs


def proposers_of(pair) -> tuple[str, ...]:
    """The proposers a loaded pair offers (engine.oracles.available), for the selectors."""
    from engine.oracles import available

    return tuple(available(pair))


def policy_options(examples: Sequence[str], proposers: Sequence[str] | None = None) -> list[str]:
    """The selectors' policies: `examples`, then the `@proposer` forms for `proposers` (the
    pair's, BASE_PROPOSERS before one is loaded): a fixed γ with each proposer other than the
    draft model (which `fixed:4` already is), and `rakv` restricted to each one, beside plain
    `rakv`, which chooses among them all."""
    names = tuple(proposers or BASE_PROPOSERS)
    forms = [f"fixed:4@{p}" for p in names if p != "draft"]
    if len(names) > 1:
        forms += [f"rakv@{p}" for p in names]
    return list(dict.fromkeys([*examples, *forms]))


def compare_label(now: dt.datetime | None = None) -> str:
    """A name shared by the runs of one comparison (kept in each run's config as `compare`), so
    they can be found together again."""
    return f"compare-{(now or dt.datetime.now()):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def shared_seed(cfg):
    """The config with a seed: a sampling comparison draws one seed for every policy, else each
    run would draw its own and their differences would say nothing about the policies."""
    if cfg.seed is None and cfg.temperature > 0:
        return replace(cfg, seed=random.randrange(2**31))
    return cfg


# -- figures ---------------------------------------------------------------------------------------
def summary_rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row per policy over all its runs, in the order the policies ran: tokens/s as all
    tokens over all wall time (a long prompt weighs what it cost), TTFT the mean, acceptance and
    tokens per step from the steps (as engine/decode/step.py's summarize defines them per run)."""
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    rows = []
    for policy, rs in by.items():
        tokens = sum(r.row["n_tokens"] for r in rs)
        wall = sum(r.row["wall_ms"] for r in rs)
        decode = [s for r in rs for s in r.steps if s["step"] > 0]
        drafted = [s for s in decode if s["k_drafted"] > 0]
        n_drafted = sum(s["k_drafted"] for s in drafted)
        accepted = sum(s["accepted"] for s in drafted)
        rows.append(dict(
            policy=policy, prompts=len(rs), tokens=tokens,
            tokens_per_s=tokens / (wall / 1e3) if wall > 0 else 0.0,
            ttft_ms=sum(r.row["ttft_ms"] for r in rs) / len(rs),
            acceptance_rate=accepted / n_drafted if n_drafted else None,
            mean_accepted=accepted / len(drafted) if drafted else 0.0,
            tokens_per_step=sum(s["emitted"] for s in decode) / len(decode) if decode else 0.0,
            proposers=mix_label(proposer_mix(decode)),
        ))
    return rows


def _drafter(step: dict[str, Any]) -> str:
    """Who drafted a stored step ("" for a plain one); steps stored before proposers had names
    were the draft model's."""
    return (step.get("proposer") or "draft") if step["k_drafted"] > 0 else ""


def proposer_mix(steps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Share of the drafting steps each proposer drafted, largest first (ties in the order
    they first drafted); empty when nothing was drafted."""
    counts: dict[str, int] = {}
    for s in steps:
        if name := _drafter(s):
            counts[name] = counts.get(name, 0) + 1
    total = sum(counts.values())
    return {p: n / total for p, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def mix_label(mix: dict[str, float]) -> str:
    """`proposer_mix` in one cell: "draft 75% · ngram 25%", "—" when nothing was drafted."""
    return " · ".join(f"{p} {share:.0%}" for p, share in mix.items()) or "—"


def gamma_series(results: Sequence[Result], prompt_index: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """Per policy, for one prompt: (decode step numbers, γ chosen at each). The prefill (step 0)
    chooses nothing and is left out."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for r in results:
        if r.prompt_index == prompt_index:
            steps = [s for s in r.steps if s["step"] > 0]
            out[r.policy] = ([s["step"] for s in steps], [s["k_chosen"] for s in steps])
    return out


def proposer_series(results: Sequence[Result], prompt_index: int = 0) -> dict[str, list[str]]:
    """Per policy, for one prompt: who drafted each decode step of `gamma_series` ("" plain)."""
    return {r.policy: [_drafter(s) for s in r.steps if s["step"] > 0]
            for r in results if r.prompt_index == prompt_index}


def first_difference(token_lists: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Where token lists first disagree: {identical, position (None when identical), tokens (each
    list's token there, None past its end), lengths}. A list that ends while another goes on
    differs at its end."""
    lists = [list(t) for t in token_lists]
    lengths = [len(t) for t in lists]
    # Where every list agrees with the first, all agree: the first split is the earliest of those.
    splits = [p for t in lists[1:] if (p := pairwise_difference(lists[0], t)) is not None]
    if not splits:
        return dict(identical=True, position=None, tokens=[], lengths=lengths)
    pos = min(splits)
    return dict(identical=False, position=pos, tokens=[t[pos] if pos < len(t) else None for t in lists],
                lengths=lengths)


def differences_from_first(token_lists: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Each list against the first: its first differing position (None if the same) and how
    many positions differ (a missing token counts as different), so a sampling comparison shows
    how far apart the outputs are, not only where they part."""
    lists = [list(t) for t in token_lists]
    ref = lists[0] if lists else []
    out = []
    for t in lists:
        n = max(len(t), len(ref))
        differing = sum((t[p] if p < len(t) else None) != (ref[p] if p < len(ref) else None) for p in range(n))
        out.append(dict(first_difference=pairwise_difference(ref, t), differing=differing, length=len(t)))
    return out


def output_differences(results: Sequence[Result], decode: Callable[[list[int]], str] | None = None
                       ) -> list[dict[str, Any]]:
    """Per prompt: the policies' first difference (with the tokens there as text when `decode`
    is given) and each policy against the first one."""
    by: dict[int, list[Result]] = {}
    for r in results:
        by.setdefault(r.prompt_index, []).append(r)
    out = []
    for i, rs in sorted(by.items()):
        lists = [r.token_ids for r in rs]
        d = first_difference(lists)
        shown = [None if t is None else (decode([t]) if decode else str(t)) for t in d["tokens"]]
        out.append(dict(prompt_index=i, prompt=rs[0].prompt, policies=[r.policy for r in rs], **d,
                        token_text=shown, versus_first=differences_from_first(lists)))
    return out


def greedy(results: Sequence[Result]) -> bool:
    return all((r.row.get("temperature") or 0.0) == 0.0 for r in results)


# -- what-if -----------------------------------------------------------------------------------------
def whatif_table(rows: Sequence[dict[str, Any]], value: str = "tokens_per_s") -> pd.DataFrame:
    """service.replay_rows' rows as (tier, task) × policy, one figure per cell (modelled tokens/s
    by default), policies in the order they were asked for; "all" last within a tier."""
    df = pd.DataFrame(list(rows))
    if not len(df):
        return pd.DataFrame()
    policies = list(dict.fromkeys(df["policy"]))
    table = df.pivot_table(index=["tier", "task"], columns="policy", values=value, aggfunc="first")
    order = sorted(table.index, key=lambda k: (k[0], k[1] == "all", k[1]))
    return table.reindex(index=order, columns=[p for p in policies if p in table.columns])


def whatif_best(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """The fastest policy per (tier, task) in modelled tokens/s (tokens/step where no cost table)."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for r in rows:
        v = r.get("tokens_per_s") or r.get("tokens_per_step") or 0.0
        key = (r["tier"], r["task"])
        if v > best.get(key, (-1.0, ""))[0]:
            best[key] = (v, r["policy"])
    return {k: p for k, (_, p) in best.items()}
