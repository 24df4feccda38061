"""One generation, from a request to a stored run: the one owner of "run one generation", which the
CLI's `generate`, the Live page, Compare, profiling sweeps and the benchmarks all call, so a run's
row is the same whoever made it. Also the newest live run (the Export page starts from it).

    req = Request(prompt, policy="rakv", task="code")
    gen = open_generation(pair, req, db)         # parse, context, policy, Generation (no decode yet)
    for rec in gen: ...                          # stream (the page, the CLI), or gen.run()
    kept = keep(gen, req, db)                    # the run row and steps, stored
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Collection, Sequence

from engine.base.helpers import one_line
from engine.decode.policies import DEFAULT_POLICY, NEEDS_CONTEXT, make_policy, parse_policy
from engine.lab.decode_lock import decode_slot, stepped
from engine.lab.side_by_side import Result, check_policies, shared_seed
from engine.oracles.suffix import SUFFIX_BUDGET, SuffixHistory, check_budget, prompt_key
from engine.service.costs.tables import context_for, measure_in_turns, reach
from store import Store

AUTO = object()  # open_generation's context: read it from the database (context_for)


@dataclass(frozen=True)
class Request:
    """One generation as a user asks for it. The policy is stored as typed (its spec, options
    included), so a run names exactly what ran; `task` labels it for the Runs page and retraining."""
    prompt: str
    policy: str = DEFAULT_POLICY  # a policy spec: `fixed:4`, `rakv@draft+ngram`, …
    chat: bool = True  # apply the tokenizer's chat template
    task: str | None = None  # code, math, chat, summarization, or None when unknown
    max_new_tokens: int = 128  # generated tokens, EOS included
    temperature: float = 0.0  # 0 = greedy; > 0 = exact speculative sampling
    top_p: float = 1.0  # nucleus filter on both laws
    seed: int | None = None  # drawn (and stored) when None
    kv_tier: str = "native"  # the target's KV cache tier
    reuse: bool = True  # take a stored prefix from the prefix cache, when the run has one
    sweep: str | None = None  # the profiling sweep the run belongs to
    label: str | None = None  # a comparison's name, kept in the run's config as `compare`

    def config(self, engine: str = "torch"):
        """The GenConfig of this request on `engine`, checked (a bad value fails before any model
        work; the KV tiers are the engine's)."""
        from engine.lab.generation import GenConfig

        cfg = GenConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                        seed=self.seed, kv_tier=self.kv_tier, reuse=self.reuse)
        cfg.validate(engine)
        return cfg


@dataclass
class Kept:
    """A finished generation as stored: its `runs` row, its `steps` rows, and where it went."""
    row: dict[str, Any]
    steps: list[dict[str, Any]]
    run_id: str | None = None  # None: not stored (no database)
    staged: bool = False  # the file was busy: staged as Parquet, ingested on the next open
    note: str = ""


def check(req: Request, engine: str = "torch") -> None:
    """Everything about a request that can fail without a model, in milliseconds: the policy's
    spec (made, where it needs no context: `fixed:99` is refused here, not in a decode thread)
    and the generation settings on `engine`."""
    name, _ = parse_policy(req.policy)
    if name not in NEEDS_CONTEXT:
        make_policy(req.policy)
    req.config(engine)


def open_generation(pair, req: Request, db: str | None = None, context: Any = AUTO, prefix=None,
                    say: Callable[[str], None] = lambda m: None, prompt_ids: list[int] | None = None, history=None,
                    measure: bool = True):
    """The request's Generation, ready to stream or run: the prompt encoded (or `prompt_ids`, the
    same prompt encoded once by a benchmark that hands the ids to a peer too), the policy made with
    its context (`context`, or read from `db` for the policies that weigh costs; `measure` False:
    a missing cost table is probed in seconds instead of measured, see costs.tables.cost_table).
    `history`: the cross-request SuffixHistory the suffix proposer reads (a live one is fed the
    output at the end)."""
    from engine.lab.generation import Generation, encode_prompt

    parse_policy(req.policy)  # check(req), keeping the config it makes
    cfg = req.config(pair.engine)
    ids = prompt_ids if prompt_ids is not None else encode_prompt(pair.tokenizer, req.prompt, req.chat)
    if context is AUTO:
        context = context_for(db or "", pair, req.policy, say, req.kv_tier, reach(len(ids), cfg.max_new_tokens),
                              measure)
    return Generation(pair, ids, make_policy(req.policy, context), cfg, prefix, history)


def run_row(gen, req: Request) -> dict[str, Any]:
    """The `runs` row of a finished (or stopped) generation, the same whoever ran it."""
    from engine.lab.generation import run_row as generation_row

    row = generation_row(gen, req.prompt, req.policy, req.chat, req.task)
    if req.sweep:
        row["sweep"] = req.sweep
    if req.label:
        row["config"] = dict(row["config"], compare=req.label)
    return row


def keep(gen, req: Request, db: "str | Store | None" = None, wait_s: float = 10.0) -> Kept:
    """Its row and steps, stored in `db` (a path, opened for this write only; an open Store; or
    None/'' to store nothing)."""
    kept = Kept(run_row(gen, req), [asdict(r) for r in gen.records])
    if isinstance(db, Store):
        kept.run_id = db.add_run(kept.row, kept.steps)
    elif db:
        kept.run_id, kept.staged, kept.note = store_run(db, kept.row, kept.steps, wait_s)
    return kept


def comparison_contexts(db: str, pair, specs: Sequence[str], prompts: Sequence[str], req: "Request",
                        on_wait: Callable[[str], None] = lambda busy: None) -> dict[str, Any]:
    """spec → the PolicyContext it needs (None for most) for a comparison of `prompts` under `req`
    (its chat template, max new tokens and KV tier): what the store lacks of the cost table up to
    the longest run's reach is measured first, a context bucket per hold of the decode slot, and
    the contexts are read inside one hold (`on_wait(holder)` when another decode holds it)."""
    from engine.lab.generation import encode_prompt

    longest = max(len(encode_prompt(pair.tokenizer, p, req.chat)) for p in prompts)
    upto = reach(longest, req.max_new_tokens)
    hold = lambda: decode_slot("a comparison (cost tables)", on_wait)  # noqa: E731
    if any(parse_policy(spec)[0] in NEEDS_CONTEXT for spec in specs):
        measure_in_turns(db, pair, req.kv_tier, upto, hold)
    with hold():
        return {spec: context_for(db, pair, spec, kv_tier=req.kv_tier, context=upto) for spec in specs}


def run_policies(pair, prompts: Sequence[str], policies: Sequence[str], req: Request, ctx_for: Callable[[str], Any],
                 prefix=None, on_run: Callable[[Result], None] = lambda r: None,
                 on_wait: Callable[[str], None] = lambda busy: None, history=None) -> list[Result]:
    """Compare's runs: every policy on every prompt, prompt-major, one run at a time, each taking
    the decode slot step by step (decode_lock.stepped; `on_wait(holder)` is called when another decode
    holds it at a run's first step), each from `req` with its prompt and policy. `ctx_for(spec)`
    gives the PolicyContext a spec needs (None for most). Each policy gets a fresh Policy per run
    (adaptive ones learn within a run) and the same config, seed included. `on_run` sees each run
    as it ends (the page stores it there). A prefix cache, if given, is shared by the runs: the
    later policies would then find the earlier ones' prompts, so the page passes None for a fair
    TTFT. A suffix history, if given, is read by every run as it stood before the comparison (a
    later policy must not find an earlier one's output of the same prompt) and fed the outputs
    once all have run."""
    specs = check_policies(policies)
    for spec in specs:  # a bad spec or a missing controller fails before the first decode
        make_policy(spec, ctx_for(spec))
    req = shared_seed(req)
    check(req, pair.engine)
    out: list[Result] = []
    before = history.snapshot() if history is not None else None
    outputs: dict[str, list[int]] = {}  # prompt key → an output, fed after the comparison
    for i, prompt in enumerate(prompts):
        for spec in specs:
            one = replace(req, prompt=prompt, policy=spec)
            gen = open_generation(pair, one, context=ctx_for(spec), prefix=prefix, history=before)
            for _ in stepped(gen, f"a comparison ({spec})", on_wait, opening=True):  # in turns with other decodes
                pass
            outputs.setdefault(prompt_key(gen.prompt_ids), gen.token_ids)
            kept = keep(gen, one)
            res = Result(spec, prompt, i, kept.row, kept.steps)
            out.append(res)
            on_run(res)
    if history is not None:
        before = None  # released: feeding need not copy the trie
        for key, tokens in outputs.items():
            history.add(key, tokens)
    return out


def generate(pair, req: Request, db: "str | Store | None" = None, context: Any = AUTO, prefix=None,
             say: Callable[[str], None] = lambda m: None, history=None) -> tuple[Any, Kept]:
    """Runs one request to its end and stores it: (the Generation, what was kept). With an open
    Store as `db`, `context` must be given (the file is already open: nothing else reads it)."""
    assert not (isinstance(db, Store) and context is AUTO), "pass the context with an open Store"
    gen = open_generation(pair, req, None if isinstance(db, Store) else db, context, prefix, say,
                          history=history).run()
    return gen, keep(gen, req, db)


def suffix_history(db: "str | Store", pair, budget: int = SUFFIX_BUDGET,
                   prompts: Collection[str] | None = None) -> SuffixHistory:
    """A cross-request suffix history holding the outputs of the runs `db` (a path or an open
    Store) holds for this pair's target (of `prompts` only, when given), the newest that fit in
    `budget` tokens: what a process (the CLI's `generate`, one run each) starts from, so that it
    finds what earlier requests produced. Empty without a file."""
    from engine.lab.generation import encode_prompt

    check_budget(budget, "--suffix-budget")
    if isinstance(db, Store):
        runs = db.runs(target=pair.target_name)
    elif file_missing(db):
        return SuffixHistory(budget)
    else:
        with Store(db, wait_s=3.0) as st:
            runs = st.runs(target=pair.target_name)
    items: dict[str, list[int]] = {}  # key → output, newest first until the budget is full; a prompt once
    held = 0
    for r in reversed(runs.to_dict("records")) if len(runs) else ():
        if held >= budget:
            break
        tokens = r.get("token_ids")
        if (isinstance(r.get("error"), str) or not r.get("prompt") or tokens is None or not len(tokens)
                or (prompts is not None and r["prompt"] not in prompts)):
            continue
        key = prompt_key(encode_prompt(pair.tokenizer, r["prompt"], bool(r.get("chat"))))
        if key not in items:
            items[key] = [int(t) for t in tokens]
            held += len(tokens)
    return SuffixHistory.from_outputs(reversed(list(items.items())), budget)


def greedy_history(pair, prompts: Sequence[str], max_new_tokens: int, budget: int = SUFFIX_BUDGET) -> SuffixHistory:
    """A suffix history of the target's greedy outputs for `prompts` (`ar` runs, nothing stored): a
    benchmark's warm history. Greedy outputs repeat exactly, so a benchmark reads it `without` the
    timed prompt's key (`prompt_key`): a configuration never learns from its own prompt's answer."""
    items = []
    for prompt in prompts:
        gen = open_generation(pair, Request(prompt, "ar", max_new_tokens=max_new_tokens), context=None).run()
        items.append((prompt_key(gen.prompt_ids), gen.token_ids))
    return SuffixHistory.from_outputs(items, budget)


def file_missing(db: str) -> bool:
    """Whether reading `db` would find nothing: no name, or a file not made yet (reading must not
    create one)."""
    return not db or (db != ":memory:" and not os.path.exists(db))


def store_run(db: str, row: dict, steps: list[dict], wait_s: float = 10.0) -> tuple[str, bool, str]:
    """Stores a finished run and its steps: (run_id, staged?, a line saying what happened). The
    file is opened only for the write, so other processes can use it in between; one that holds
    it makes the store stage the run as Parquet, ingested on the next open (nothing is lost)."""
    with Store(db, wait_s=wait_s) as st:
        run_id = st.add_run(row, steps)
        if st.staged:
            return run_id, True, st.message
        return run_id, False, f"stored as run {run_id} in {db}" + (f" ({st.message})" if st.message else "")


@dataclass
class Stored:
    """Where a run went, for a page: its id (None when not stored), a level and one line."""

    run_id: str | None
    level: str  # "success" | "warning" | "error"
    message: str


def store_outcome(db: str, row: dict, steps: list[dict]) -> Stored:
    """`store_run` for a page: the outcome as one line, a failure included (never a traceback)."""
    try:
        run_id, staged, note = store_run(db, row, steps, wait_s=3.0)
        return Stored(run_id, "warning" if staged else "success", one_line(note[:1].upper() + note[1:]))
    except Exception as e:  # noqa: BLE001 - shown as one line, never a traceback
        return Stored(None, "error", one_line(e))


def latest_live_run(db: str) -> dict | None:
    """The newest finished live run (what the Export page starts from); None when there is none."""
    if file_missing(db):
        return None
    with Store(db, wait_s=3.0) as st:
        runs = st.runs(source="speclab")
    runs = runs[runs["error"].isna()] if len(runs) else runs
    return None if not len(runs) else runs.iloc[-1].to_dict()


