"""The service layer: one owner per user action, what the CLI, the pages and the benchmarks call
(docs/architecture.md, "Layers"). At the top: one generation (generation.py), what a process holds
once (session.py) and replay (replays.py); each folder one family: sweeps/, costs/, kv/, export/.
This package re-exports their public names, so callers write `service.generate(...)`, and
the names of the layers below that the pages show (policy specs, the workbench's prompt, the
comparison's shaping): views/ and app.py import nothing below it but engine.base.

May import: engine.base, engine.datasets, engine.decode, engine.runtime, engine.oracles, engine.lab,
engine.training, store. Torch-free at import: a function that runs models imports what it needs."""
from __future__ import annotations

from engine.datasets.prompts import WORKBENCH_PROMPT
from engine.decode.policies import DEFAULT_POLICY, POLICY_EXAMPLES, parse_policy
from engine.lab import side_by_side
from engine.lab.whatif import tier_label
from engine.oracles.suffix import SUFFIX_BUDGET, SuffixHistory
from engine.service.costs.tables import (
    ALPHA_MIN_STEPS,
    calibrate_all,
    calibrate_costs,
    context_for,
    controller_loader,
    cost_key,
    cost_table,
    measure_in_turns,
    policy_context,
    reach,
    stored_costs,
)
from engine.service.export.formats import save_export, stored_exports
from engine.service.generation import (
    Request,
    check,
    comparison_contexts,
    generate,
    greedy_history,
    keep,
    latest_live_run,
    open_generation,
    run_policies,
    store_run,
    suffix_history,
)
from engine.service.kv.actions import (
    MEASURE_KV_MINUTES,
    format_tune,
    kv_view,
    latest_kv_measurement,
    measure_kv,
    tune_kv,
)
from engine.service.replays import TRACE_IDENTITY, newest_traces, replay_all, replay_rows, retrain
from engine.service.sweeps.serial import (
    TRACE_POLICIES,
    format_sweep,
    parse_kv_tiers,
    parse_tiers,
    profile,
    prompt_set,
    stored_keys,
    sweep_jobs,
    sweep_table,
    trace_prompts,
)

__all__ = [
    "DEFAULT_POLICY", "POLICY_EXAMPLES", "WORKBENCH_PROMPT", "parse_policy", "side_by_side", "comparison_contexts",
    "sweep_jobs",
    "Request", "check", "generate", "keep", "open_generation", "run_policies", "SUFFIX_BUDGET", "SuffixHistory",
    "greedy_history", "suffix_history",
    "ALPHA_MIN_STEPS", "MEASURE_KV_MINUTES", "TRACE_IDENTITY", "TRACE_POLICIES", "calibrate_all", "calibrate_costs",
    "context_for", "controller_loader", "cost_key", "cost_table", "format_sweep", "format_tune", "kv_view",
    "latest_kv_measurement", "latest_live_run", "measure_in_turns", "measure_kv", "newest_traces", "parse_kv_tiers",
    "parse_tiers",
    "policy_context", "profile", "prompt_set", "reach", "replay_all", "replay_rows", "retrain", "save_export", "store_run",
    "stored_costs", "stored_exports", "stored_keys", "sweep_table", "tier_label", "trace_prompts", "tune_kv",
]
