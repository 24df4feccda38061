"""Export a tuned configuration (service/export/tuned_config.py) where engines read it: as Hugging Face
assisted-generation keyword arguments and as a vLLM `speculative_config`, beside the SpecLab
JSON/YAML; `render` gives any of the formats as text.

Torch-free at import. The vLLM field names are the ones of `SpeculativeConfig` at a pinned release,
read from its wheel into engine/data/vllm_speculative_config_fields.json (service/export/pinned_fields.py);
the export uses no other name. The draft itself, as a model each engine loads: service/export/model_dir.py."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from engine.base.names import BNB_TIERS, DATA_DIR, EMBEDDED, FALLBACK_DRAFT_TIER
from engine.base.names import SHIPPED_DRAFT as SHIPPED_DRAFT_PATH
from engine.decode.policies import parse_policy, split_spec
from engine.decode.policies.fixed import parse_tree
from engine.decode.tree import rank_acceptance, stored_tree
from engine.service.export.tuned_config import (
    FIXED,
    PLAIN,
    TREE,
    TunedConfig,
    first_proposer,
    ngram_options,
    prior_rank_acceptance,
    speculative_tokens,
    to_json,
    to_yaml,
    tree_shape,
)
from engine.service.generation import file_missing
from store import Store

REPO_ROOT = DATA_DIR.parents[1]
# The embedded target's shipped SpecLab draft as exports name it: relative to the repository.
SHIPPED_DRAFT = SHIPPED_DRAFT_PATH.relative_to(REPO_ROOT).as_posix()
FORMATS = ("json", "yaml", "hf", "vllm", "llamacpp", "tree")
# Tree steps of a policy's stored runs below which its export's tree comes from the prior instead.
MIN_TREE_NODES = 50
VLLM_FIELDS_FILE = DATA_DIR / "vllm_speculative_config_fields.json"
# HF's own starting confidence threshold for dynamic speculation (GenerationConfig's default).
HF_CONFIDENCE = 0.4


# -- Hugging Face transformers --------------------------------------------------------------------
# Keys `hf_bind` copies onto the assistant's generation_config: transformers' AssistedCandidate-
# Generator reads them from there, not from the main call's kwargs (transformers 5.x,
# generation/candidate_generator.py; tests/test_export.py shows a kwarg alone changes nothing).
HF_ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def draft_source(cfg: TunedConfig) -> str:
    """The draft the loader would pick (engine.runtime.models._draft_source), as a path or id."""
    if cfg.draft is not None:
        return cfg.draft
    return SHIPPED_DRAFT if cfg.target == EMBEDDED else cfg.target


def hf_proposer(cfg: TunedConfig) -> str:
    """What HF drafts with: prompt lookup where the policy's first proposer is the n-gram index
    (`prompt_lookup_num_tokens`), else the draft model (HF has no suffix index or EAGLE head)."""
    _, names, _ = split_spec(cfg.policy)
    return "ngram" if names and names[0] == "ngram" else "draft"


def hf_generate_kwargs(cfg: TunedConfig) -> dict[str, Any]:
    """Keyword arguments for `target.generate(input_ids, **kwargs)`.

    `assistant_model` holds the draft's path or id (JSON cannot hold a model): the caller loads
    it and substitutes the model; `hf_bind` does that and also sets the assistant keys on the
    assistant's generation_config, where transformers reads them (an export directory's draft
    carries them in its own generation_config.json). Policies that never draft (`ar`,
    `reuse-only`) give plain decoding: no assistant. Mapping: fixed/joint:k → k tokens on a
    constant schedule with the confidence stop off; heuristic:k0 → HF's own heuristic schedule
    from k0, reset per call as SpecLab's is (`heuristic_transient`); threshold:c → up to γ_max
    tokens, stopping under confidence c; rules, rakv and speckv* (cost-aware or learned, no HF
    counterpart) → HF's dynamic speculation: up to γ_max tokens with its confidence stop. A
    policy drafting with the n-gram index first gets HF's prompt lookup of γ tokens instead."""
    name, arg = parse_policy(cfg.policy)
    out: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens}
    if cfg.temperature > 0:
        out.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        out["do_sample"] = False
    if name in PLAIN:
        return out
    if hf_proposer(cfg) == "ngram":
        out.update(prompt_lookup_num_tokens=speculative_tokens(cfg), max_matching_ngram_size=ngram_options(cfg)["max"])
        return out
    out["assistant_model"] = draft_source(cfg)
    if name in FIXED or name == TREE:  # a tree: HF drafts a chain as deep as its static form
        k = int(arg or 4) if name in FIXED else speculative_tokens(cfg)
        out.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    elif name == "heuristic":
        out.update(num_assistant_tokens=int(arg or 4), num_assistant_tokens_schedule="heuristic_transient",
                   assistant_confidence_threshold=0.0)
    elif name == "threshold":
        out.update(num_assistant_tokens=cfg.gamma_max, num_assistant_tokens_schedule="constant",
                   assistant_confidence_threshold=float(arg or 0.4))
    else:
        out.update(num_assistant_tokens=cfg.gamma_max, num_assistant_tokens_schedule="constant",
                   assistant_confidence_threshold=HF_CONFIDENCE)
    return out


def hf_bind(kwargs: dict[str, Any], assistant_model: Any) -> dict[str, Any]:
    """The kwargs for `generate` with the loaded draft in place of its path, and the assistant
    keys set on `assistant_model.generation_config` (where transformers reads them)."""
    out = dict(kwargs)
    if "assistant_model" not in out:
        return out
    out["assistant_model"] = assistant_model
    for key in HF_ASSISTANT_KEYS:
        if key in out:
            setattr(assistant_model.generation_config, key, out[key])
    return out


# -- vLLM -----------------------------------------------------------------------------------------
@cache
def vllm_fields() -> dict[str, Any]:
    """The pinned vLLM release's SpeculativeConfig field names (release, source, fields, methods)."""
    return json.loads(VLLM_FIELDS_FILE.read_text())


def _vllm_draft(cfg: TunedConfig, options: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"method": "draft_model", "model": draft_source(cfg)}
    tier = cfg.draft_tier or (None if cfg.draft is not None or cfg.target == EMBEDDED else FALLBACK_DRAFT_TIER)
    if tier in BNB_TIERS:  # vLLM quantizes a draft the same way in flight
        out["quantization"] = "bitsandbytes"
    return out


def _vllm_eagle(cfg: TunedConfig, options: dict[str, str]) -> dict[str, Any]:
    # SpecLab's head has a layout no vLLM EAGLE model reads: the draft model stands in (notes says so).
    return _vllm_draft(cfg, {})


def _vllm_ngram(cfg: TunedConfig, options: dict[str, str]) -> dict[str, Any]:
    o = ngram_options(cfg, options)
    return {"method": "ngram", "prompt_lookup_max": o["max"], "prompt_lookup_min": o["min"]}


def _vllm_suffix(cfg: TunedConfig, options: dict[str, str]) -> dict[str, Any]:
    return {"method": "suffix"}  # vLLM's GPU suffix speculator: its tree and corpus sizes are its own


# SpecLab proposer → its vLLM speculative_config (method and the fields its options map to).
VLLM_PROPOSERS = {"draft": _vllm_draft, "eagle": _vllm_eagle, "ngram": _vllm_ngram, "suffix": _vllm_suffix}


def vllm_speculative_config(cfg: TunedConfig) -> dict[str, Any] | None:
    """vLLM's `speculative_config` (`LLM(..., speculative_config=...)`, `--speculative-config`)
    for the pinned release; None for policies that never draft. vLLM drafts a fixed number of
    tokens per step (`speculative_tokens`) with one proposer (`first_proposer`: vLLM runs one method per engine)."""
    if cfg.policy_name in PLAIN:
        return None
    proposer = first_proposer(cfg)
    out = VLLM_PROPOSERS[proposer](cfg, split_spec(cfg.policy)[2].get(proposer, {}))
    out["num_speculative_tokens"] = speculative_tokens(cfg)
    known = set(vllm_fields()["fields"]) - set(vllm_fields()["engine_set_fields"])
    assert set(out) <= known and out["method"] in vllm_fields()["methods"], out
    return out


# -- the bundle ---------------------------------------------------------------------------------
def notes(cfg: TunedConfig) -> list[str]:
    """What the HF and vLLM forms cannot carry, one line each."""
    name = cfg.policy_name
    out = []
    if name not in PLAIN + FIXED + ("heuristic", "threshold"):
        out.append(f"{name} has no Hugging Face or vLLM counterpart: HF gets dynamic speculation capped at "
                   f"γ = {cfg.gamma_max}, vLLM a fixed γ = {cfg.gamma_max}")
    if name in ("heuristic", "threshold"):
        out.append(f"vLLM drafts a fixed γ: {name} becomes γ = {cfg.gamma_max}")
    if name == TREE:
        out.append(f"Hugging Face and vLLM {vllm_fields()['release']} verify chains (this vLLM's SpeculativeConfig has "
                   f"no token-tree field): {cfg.policy} becomes a chain of γ = {cfg.gamma_max}, its static tree's "
                   "depth; the tree itself is the `tree` export (EAGLE's tree_choices, Medusa's medusa_choices)")
    out += _proposer_notes(cfg)
    if cfg.draft is None and cfg.target == EMBEDDED:
        out.append(f"the embedded draft ({SHIPPED_DRAFT}) is a SpecLab draft (int8 rows, the target's embedding "
                   "shared): `export --format hf|vllm --out DIR` writes it as a standalone model both load, "
                   "with the full LM head where SpecLab reads an 8,192-row sub-head")
    if cfg.kv_tier != "native":
        out.append(f"KV tier {cfg.kv_tier}: in vLLM an engine argument (kv_cache_dtype), not part of "
                   "speculative_config; HF has no equivalent here")
    if cfg.kv_window is not None:
        out.append(f"KV offload (W = {cfg.kv_window}{', coded' if cfg.kv_coded else ''}) is SpecLab's own")
    if cfg.reuse:
        out.append(f"prefix reuse ({cfg.prefix_budget_mib:g} MiB) is SpecLab's; vLLM has enable_prefix_caching")
    if cfg.seed is not None:
        out.append("HF takes no seed argument: call torch.manual_seed before generate")
    return out


def _proposer_notes(cfg: TunedConfig) -> list[str]:
    """What the engines' one proposer drops of the policy's, and the EAGLE head no engine loads."""
    if cfg.policy_name in PLAIN:
        return []
    names = split_spec(cfg.policy)[1] or []
    used, out = first_proposer(cfg), []
    if len(names) > 1:
        out.append(f"vLLM drafts with one proposer: {used} (the policy also chooses {', '.join(names[1:])})")
    if "eagle" in names:
        out.append("no EAGLE head for vLLM or Hugging Face: SpecLab's head (normed fusion, output norm, "
                   "its own feature tap) matches neither vLLM's EAGLE-1 nor EAGLE-3 layout, so both get the "
                   "draft model where the policy names eagle")
    if "suffix" in names and hf_proposer(cfg) == "draft":
        out.append("Hugging Face has no suffix index: it drafts with the draft model where the policy names suffix")
    return out


# -- a token tree policy's static tree -------------------------------------------------------------
def tree_export(cfg: TunedConfig, db: str | None = None) -> dict[str, Any] | None:
    """A `tree:NxW` policy as the static tree engines with a fixed tree read (None for any other
    policy): its N best rank paths, by the per-rank acceptance its stored tree steps measured in
    `db` (the prior where fewer than MIN_TREE_NODES nodes were reached), and who reads which form."""
    if cfg.policy_name != TREE:
        return None
    width = parse_tree(parse_policy(cfg.policy)[1]).width
    q, reached = _measured_ranks(db, cfg.policy, width) if db else ([], 0)
    measured = reached >= MIN_TREE_NODES
    choices = [list(c) for c in tree_shape(cfg.policy, q if measured else None)]
    return {"policy": cfg.policy, "tree_choices": choices, "nodes": len(choices), "depth": max(map(len, choices)),
            "rank_acceptance": [round(x, 4) for x in (q if measured else prior_rank_acceptance(width))],
            "from": (f"{reached} tree nodes the target reached in stored {cfg.policy} runs" if measured else
                     f"the prior α(1 − α)^rank (fewer than {MIN_TREE_NODES} stored tree nodes: run {cfg.policy})"),
            "read_by": {"EAGLE (SafeAILab/EAGLE)": "tree_choices", "Medusa": "medusa_choices",
                        f"vLLM {vllm_fields()['release']}": "none: no token-tree field; its speculative_config drafts "
                        "a chain of num_speculative_tokens = depth",
                        "SpecLab": f"policy {cfg.policy}: a dynamic tree per step (EAGLE-2's rule)"}}


def _measured_ranks(db: str, policy: str, width: int) -> tuple[list[float], int]:
    """Per-rank acceptance over the tree steps of `policy`'s stored runs (tree.rank_acceptance)."""
    if file_missing(db):
        return [], 0
    with Store(db, wait_s=3.0) as st:
        runs = st.runs(policy=policy)
        rows = [st.steps(run_id) for run_id in runs["run_id"]] if len(runs) else []
    steps = [(list(r.tree_parents), list(r.draft_ids), list(r.token_ids)[: r.accepted])
             for df in rows for r in df.itertuples() if stored_tree(r.tree_parents)]
    return rank_acceptance(steps, width)


def export_bundle(cfg: TunedConfig) -> dict[str, Any]:
    """The three forms at once (and what does not carry over)."""
    return {"speclab": cfg.to_dict(), "hf_generate_kwargs": hf_generate_kwargs(cfg),
            "vllm_speculative_config": vllm_speculative_config(cfg), "vllm_release": vllm_fields()["release"],
            "vllm_package": vllm_fields()["package"], "notes": notes(cfg)}


def named_path(path: Path) -> str:
    """A path as exports record it: relative to the repository when inside it (the shipped
    draft), else as given."""
    p = path.resolve()
    return p.relative_to(REPO_ROOT).as_posix() if p.is_relative_to(REPO_ROOT) else str(path)


def render(cfg: TunedConfig, fmt: str, db: str | None = None) -> str:
    """The export's text in one format (json, yaml, hf, vllm, llamacpp, tree: its static tree,
    measured from `db`'s stored tree steps where it has enough)."""
    if fmt == "json":
        return to_json(cfg)
    if fmt == "yaml":
        return to_yaml(cfg)
    if fmt == "hf":
        return json.dumps(hf_generate_kwargs(cfg), indent=2) + "\n"
    if fmt == "vllm":
        spec = vllm_speculative_config(cfg)
        if spec is None:
            raise ValueError(f"policy {cfg.policy} never drafts: there is no vLLM speculative_config for it")
        return json.dumps(spec, indent=2) + "\n"
    if fmt == "llamacpp":
        from engine.service.export.llamacpp import render_llamacpp

        return render_llamacpp(cfg)
    if fmt == "tree":
        tree = tree_export(cfg, db)
        if tree is None:
            raise ValueError(f"policy {cfg.policy} drafts chains: the tree format is for tree:NxW policies")
        text = json.dumps(tree, indent=2, ensure_ascii=False)  # the rank paths one line: engines paste the list
        return text.replace(json.dumps(tree["tree_choices"], indent=2).replace("\n", "\n  "),
                            json.dumps(tree["tree_choices"])) + "\n"
    raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")


# -- stored exports --------------------------------------------------------------------------------
def save_export(db: str, cfg, fmt: str, name: str | None = None) -> tuple[str, int, str]:
    """Renders a TunedConfig in `fmt` and stores it as the next version of `name` (default: the
    target and the policy): (name, version, text). The text is made before the file is opened."""
    from engine.service.export.tuned_config import default_name

    text = render(cfg, fmt, db)
    name = (name or "").strip() or default_name(cfg)
    if not db:
        raise ValueError("an export is stored in a database: pass --db")
    with Store(db, wait_s=3.0) as st:
        return name, st.add_export(name, cfg.to_dict(), fmt, text), text


def stored_exports(db: str):
    """Every stored export, oldest first (empty when the file does not exist yet)."""
    import pandas as pd

    if file_missing(db):
        return pd.DataFrame(columns=["name", "version", "format", "created_at"])
    with Store(db, wait_s=3.0) as st:  # read-write: a file from before exports is migrated
        return st.exports()


# -- exports run in their engines (`bench exports`) --------------------------------------------------
ENGINE_LABELS = {"transformers": "Hugging Face", "vllm": "vLLM"}
# What makes two settings the same export for an engine's run: the models and the policy (a run's
# tier is the engine's own choice and is shown beside its figures).
SAME_EXPORT = ("target", "draft", "draft_tier", "policy", "temperature", "top_p")


def export_checks(db: str, cfg: TunedConfig) -> dict[str, dict[str, Any] | None]:
    """The newest `bench exports` outcome per engine for this setting (None where it never ran
    there): engine_version, created_at, ran, reason, the tier it ran at and its figures."""
    out: dict[str, dict[str, Any] | None] = dict.fromkeys(ENGINE_LABELS)
    if not db or file_missing(db):
        return out
    want = {k: cfg.to_dict()[k] for k in SAME_EXPORT}
    with Store(db, wait_s=3.0) as st:  # read-write: a file from before export checks is migrated
        df = st.export_checks()
    for row in df.itertuples():
        config = json.loads(row.config) if isinstance(row.config, str) else (row.config or {})
        if row.engine in out and {k: config.get(k) for k in SAME_EXPORT} == want:
            result = json.loads(row.result) if isinstance(row.result, str) else (row.result or {})
            out[row.engine] = {"engine_version": row.engine_version, "created_at": row.created_at, "ran": bool(row.ran),
                               "reason": row.reason or "", "tier": config.get("target_tier"), **result}
    return out


def describe_check(engine: str, check: dict[str, Any] | None, cfg: TunedConfig) -> str:
    """One line: whether this setting's export was last run in `engine` and what it gave."""
    label = ENGINE_LABELS[engine]
    if check is None:
        return (f"{label}: not run there yet — `python -m engine bench exports --policy {cfg.pinned_policy()}"
                f"{' --make-vllm' if engine == 'vllm' else ' --no-vllm'} --db DB` runs it and stores the outcome")
    when = f"{check['created_at']:%Y-%m-%d %H:%M}" if hasattr(check["created_at"], "strftime") else check["created_at"]
    if not check["ran"]:
        return f"{label}: did not run ({when}): {check['reason']}"
    same = check.get("identical")
    same = same.get("speclab_export") if isinstance(same, dict) else same
    tok_s = check.get("tok_s") or {}
    return (f"{label} {check['engine_version']} ({check['tier']}), {when}: {check['realized_speedup']:.2f}× its plain "
            f"decoding ({', '.join(f'{m} {v:.1f}' for m, v in tok_s.items())} tok/s) against SpecLab's predicted "
            f"{check['predicted_speedup']:.2f}× (realized/predicted {check['realized_vs_predicted']:.2f}); greedy "
            f"output as plain on {same:.0%} of {check['prompts']} prompts")
