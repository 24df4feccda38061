"""Export a tuned configuration: as SpecLab JSON/YAML (what `generate --config FILE` reads back),
as Hugging Face assisted-generation keyword arguments, and as a vLLM `speculative_config`.

Torch-free at import (the workbench page and `python -m engine export` load no model). The vLLM
field names are the ones of `SpeculativeConfig` at a pinned release, extracted once into
engine/data/vllm_speculative_config_fields.json; the export uses no other name."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Mapping

import yaml

from engine.base.names import DATA_DIR, EMBEDDED, KV_TIERS, WEIGHT_TIERS
from engine.base.names import SHIPPED_DRAFT as SHIPPED_DRAFT_PATH
from engine.decode.policies import (
    DEFAULT_POLICY,
    NEEDS_CONTEXT,
    make_policy,
    parse_policy,
)
from engine.decode.records import K_MAX

# The embedded target's shipped SpecLab draft as exports name it: relative to the repository.
SHIPPED_DRAFT = SHIPPED_DRAFT_PATH.relative_to(DATA_DIR.parents[1]).as_posix()
FORMATS = ("json", "yaml", "hf", "vllm")
FILE_FORMAT = "speclab-tuned-config/1"  # the "format" key of a SpecLab config file
VLLM_FIELDS_FILE = DATA_DIR / "vllm_speculative_config_fields.json"

# Learned policies → the stored controller they read (engine/policies: speckv-paper uses speckv's).
CONTROLLERS = {"speckv": "speckv", "speckv-rf": "speckv-rf", "speckv-paper": "speckv"}
# Policies that draft a fixed γ = their argument.
FIXED = ("fixed", "joint")
# Policies that never draft.
PLAIN = ("ar", "reuse-only")
# HF's own starting confidence threshold for dynamic speculation (GenerationConfig's default).
HF_CONFIDENCE = 0.4


@dataclass(frozen=True)
class TunedConfig:
    """A tuned speculative-decoding setting, everything a run needs besides its prompt. Fields
    left None where a default depends on others are filled in (`__post_init__`), so two configs
    that run the same compare equal."""

    # Models: `generate` loads exactly this pair again.
    target: str = EMBEDDED  # HF id or local dir; "embedded" = the embedded SmolLM2 target
    draft: str | None = None  # HF id, local dir or SpecLab draft dir; None = the target's default draft
    target_tier: str = "fp32"  # weight tier of the target: its numerics decide the output
    draft_tier: str | None = None  # weight tier of the draft; None = the loader's default for it
    kv_tier: str = "native"  # the target's KV cache tier (memory per token, costs are keyed by it)
    # The γ policy and, for a learned one, which stored controller: a later retrain must not
    # silently change what an exported setting does.
    policy: str = DEFAULT_POLICY  # a policy spec (engine/policies): fixed:4, rakv, speckv, ...
    controller: str | None = None  # speckv*: the controller's name (filled in from the policy)
    controller_version: int | None = None  # speckv*: its version; None = whichever is active
    # The γ range the tuner recommends: fixed policies' γ, the cap for adaptive ones in HF/vLLM,
    # which have no cost-aware γ of their own.
    gamma_min: int | None = None  # None = from the policy
    gamma_max: int | None = None  # None = from the policy
    # KV offload (engine/kv/offload.py): restore window W and whether windows are coded.
    kv_window: int | None = None  # W in tokens; None = no offload
    kv_coded: bool = False  # code offloaded windows against the predictor (engine/kv/codec.py)
    # Cross-request prefix reuse (engine/prefix_cache.py).
    reuse: bool = True  # take the longest stored prefix from the prefix cache
    prefix_budget_mib: float = 512.0  # the prefix cache's byte budget
    # Sampling (GenConfig): the same values reproduce the same run.
    max_new_tokens: int = 128  # generated tokens, EOS included
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus filter on target and draft
    seed: int | None = None  # None = drawn per run
    source: str = ""  # where the values came from (a run id, the tuner, by hand): provenance only

    def __post_init__(self) -> None:
        _check_fields(self)
        try:
            name, arg = parse_policy(self.policy)
        except ValueError as e:
            raise _FieldError("policy", str(e)) from None
        _check_policy_arg(self.policy, name, arg)
        self._fill("policy", self.policy.strip())
        self._fill_controller(name, arg)
        lo, hi = default_gamma(name, arg)
        self._fill("gamma_min", lo if self.gamma_min is None else self.gamma_min)
        self._fill("gamma_max", hi if self.gamma_max is None else self.gamma_max)
        _check_values(self, name, arg)

    def _fill(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: defaults are filled once, here

    def _fill_controller(self, name: str, arg: str | None) -> None:
        want = CONTROLLERS.get(name)
        if want is None:
            if self.controller is not None or self.controller_version is not None:
                raise _FieldError("controller", f"policy {name} uses no stored controller; leave it empty")
            return
        if self.controller not in (None, want):
            raise _FieldError("controller", f"policy {name} reads controller {want!r}, not {self.controller!r}")
        version = None if arg is None else int(arg)
        if version is not None and self.controller_version not in (None, version):
            raise _FieldError("controller_version", f"policy {self.policy!r} names version {version},"
                              f" the config says {self.controller_version}")
        self._fill("controller", want)
        self._fill("controller_version", version if version is not None else self.controller_version)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def policy_name(self) -> str:
        return parse_policy(self.policy)[0]

    def pinned_policy(self) -> str:
        """The policy spec with the controller version pinned (`speckv:3`), as `generate` runs it."""
        name, arg = parse_policy(self.policy)
        if name in CONTROLLERS and arg is None and self.controller_version is not None:
            return f"{name}:{self.controller_version}"
        return self.policy


class _FieldError(ValueError):
    """A bad value of one field; load_config prefixes the file."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"field {name!r}: {message}")
        self.field = name


# -- validation ------------------------------------------------------------------------------------
_FIELDS = {f.name: f for f in dataclasses.fields(TunedConfig)}
# field → (accepted Python types, how an error names them, may be None)
_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "target": ((str,), "a string", False), "draft": ((str,), "a string", True),
    "target_tier": ((str,), "a string", False), "draft_tier": ((str,), "a string", True),
    "kv_tier": ((str,), "a string", False), "policy": ((str,), "a string", False),
    "controller": ((str,), "a string", True), "controller_version": ((int,), "an integer", True),
    "gamma_min": ((int,), "an integer", True), "gamma_max": ((int,), "an integer", True),
    "kv_window": ((int,), "an integer", True), "kv_coded": ((bool,), "true or false", False),
    "reuse": ((bool,), "true or false", False), "prefix_budget_mib": ((int, float), "a number", False),
    "max_new_tokens": ((int,), "an integer", False), "temperature": ((int, float), "a number", False),
    "top_p": ((int, float), "a number", False), "seed": ((int,), "an integer", True),
    "source": ((str,), "a string", False),
}
assert set(_TYPES) == set(_FIELDS), "every TunedConfig field needs a type rule"


def _check_fields(cfg: TunedConfig) -> None:
    for name, (types, what, nullable) in _TYPES.items():
        value = getattr(cfg, name)
        if value is None and nullable:
            continue
        # bool is an int in Python; a YAML `true` must not pass as γ = 1.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise _FieldError(name, f"must be {what}{' or null' if nullable else ''}, got {_show(value)}")


def _check_policy_arg(spec: str, name: str, arg: str | None) -> None:
    """Rejects a bad argument now: policies needing a context cannot be built without a store."""
    try:
        if name not in NEEDS_CONTEXT:
            make_policy(spec)
        elif name == "rakv" and arg is not None:
            a = float(arg)
            if not 0 < a < 1:
                raise ValueError(f"policy rakv:α needs 0 < α < 1, got {arg}")
        elif name in CONTROLLERS and arg is not None and (not arg.isdigit() or int(arg) < 1):
            raise ValueError(f"policy {name}:N takes a controller version N ≥ 1, got {arg!r}")
    except ValueError as e:
        raise _FieldError("policy", str(e)) from None


def default_gamma(name: str, arg: str | None) -> tuple[int, int]:
    """The γ range a policy drafts in when the config names none."""
    if name in PLAIN:
        return 0, 0
    if name in FIXED:
        k = int(arg or 4)
        return k, k
    if name == "heuristic":
        return 1, K_MAX
    return 1, K_MAX  # threshold, rules, speckv*, rakv: anything up to the longest draft


def _check_values(cfg: TunedConfig, name: str, arg: str | None) -> None:
    if cfg.target.strip() == "":
        raise _FieldError("target", f"must name a model (or {EMBEDDED!r})")
    if cfg.draft is not None and cfg.draft.strip() == "":
        raise _FieldError("draft", "must name a model, or be null for the target's default draft")
    for tier in ("target_tier", "draft_tier"):
        value = getattr(cfg, tier)
        if value is not None and value not in WEIGHT_TIERS:
            raise _FieldError(tier, f"unknown tier {value!r}; known: {', '.join(WEIGHT_TIERS)}")
    if cfg.kv_tier not in KV_TIERS:
        raise _FieldError("kv_tier", f"unknown KV tier {cfg.kv_tier!r}; known: {', '.join(KV_TIERS)}")
    if cfg.controller_version is not None and cfg.controller_version < 1:
        raise _FieldError("controller_version", f"must be ≥ 1, got {cfg.controller_version}")
    lo, hi = cfg.gamma_min, cfg.gamma_max
    assert lo is not None and hi is not None  # filled in before
    if not 0 <= lo <= hi <= K_MAX:
        raise _FieldError("gamma_min..gamma_max", f"the γ range needs 0 ≤ gamma_min ≤ gamma_max ≤ {K_MAX}, got {lo}..{hi}")
    if name in FIXED and not lo <= int(arg or 4) <= hi:
        raise _FieldError("gamma_min", f"policy {cfg.policy} drafts γ = {int(arg or 4)}, outside {lo}..{hi}")
    if name not in PLAIN + FIXED and hi < 1:
        raise _FieldError("gamma_max", f"policy {name} drafts: gamma_max must be ≥ 1, got {hi}")
    if cfg.kv_window is not None and cfg.kv_window < 1:
        raise _FieldError("kv_window", f"W must be ≥ 1 token, got {cfg.kv_window}")
    if cfg.kv_coded and cfg.kv_window is None:
        raise _FieldError("kv_coded", "coding is for offloaded windows: set kv_window (W) too")
    if not (math.isfinite(cfg.prefix_budget_mib) and cfg.prefix_budget_mib > 0):
        raise _FieldError("prefix_budget_mib", f"must be a positive number, got {cfg.prefix_budget_mib}")
    if cfg.max_new_tokens < 1:
        raise _FieldError("max_new_tokens", f"must be ≥ 1, got {cfg.max_new_tokens}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise _FieldError("temperature", f"must be a finite number ≥ 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise _FieldError("top_p", f"must be in (0, 1], got {cfg.top_p}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- SpecLab files -------------------------------------------------------------------------------
def to_json(cfg: TunedConfig) -> str:
    return json.dumps({"format": FILE_FORMAT, **cfg.to_dict()}, indent=2) + "\n"


def to_yaml(cfg: TunedConfig) -> str:
    return yaml.safe_dump({"format": FILE_FORMAT, **cfg.to_dict()}, sort_keys=False, allow_unicode=True)


def from_dict(data: Any, where: str = "config") -> TunedConfig:
    """A TunedConfig from a parsed file; every problem is one ValueError line naming `where`
    and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of settings at the top, got {type(data).__name__}")
    data = dict(data)
    fmt = data.pop("format", FILE_FORMAT)
    if fmt != FILE_FORMAT:
        raise ValueError(f"{where}: format {fmt!r} is not {FILE_FORMAT!r}")
    unknown = [k for k in data if k not in _FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown key {str(unknown[0])!r} (known: {', '.join(_FIELDS)})")
    try:
        return TunedConfig(**data)
    except ValueError as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None


def load_config(path: str | Path) -> TunedConfig:
    """Reads a SpecLab config: a .json file as JSON, any other as YAML (safe_load: plain data only)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config {p}: cannot read it ({type(e).__name__}: {e.strerror or e})") from None
    if p.suffix.lower() == ".json":  # YAML would let JSON's mistakes pass (a trailing comma)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config {p}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
        return from_dict(data, f"config {p}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"config {p}: not valid YAML{at} ({problem})") from None
    return from_dict(data, f"config {p}")


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


def hf_generate_kwargs(cfg: TunedConfig) -> dict[str, Any]:
    """Keyword arguments for `target.generate(input_ids, **kwargs)`.

    `assistant_model` holds the draft's path or id (JSON cannot hold a model): the caller loads
    it and substitutes the model; `hf_bind` does that and also sets the assistant keys on the
    assistant's generation_config, where transformers reads them. Policies that never draft
    (`ar`, `reuse-only`) give plain decoding: no assistant. Mapping: fixed/joint:k → k tokens on
    a constant schedule with the confidence stop off; heuristic:k0 → HF's own heuristic schedule
    from k0, reset per call as SpecLab's is (`heuristic_transient`); threshold:c → up to γ_max
    tokens, stopping under confidence c; rules, rakv and speckv* (cost-aware or learned, no HF
    counterpart) → HF's dynamic speculation: up to γ_max tokens with its confidence stop."""
    name, arg = parse_policy(cfg.policy)
    out: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens}
    if cfg.temperature > 0:
        out.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        out["do_sample"] = False
    if name in PLAIN:
        return out
    out["assistant_model"] = draft_source(cfg)
    if name in FIXED:
        k = int(arg or 4)
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


def vllm_speculative_config(cfg: TunedConfig) -> dict[str, Any] | None:
    """vLLM's `speculative_config` (`LLM(..., speculative_config=...)`, `--speculative-config`)
    for the pinned release; None for policies that never draft. vLLM drafts a fixed number of
    tokens per step: fixed/joint:k give k, every adaptive policy its γ cap (gamma_max)."""
    name, arg = parse_policy(cfg.policy)
    if name in PLAIN:
        return None
    k = int(arg or 4) if name in FIXED else cfg.gamma_max
    out: dict[str, Any] = {"method": "draft_model", "model": draft_source(cfg), "num_speculative_tokens": k}
    tier = cfg.draft_tier or (None if cfg.draft is not None or cfg.target == EMBEDDED else "nf4")
    if tier in ("int8", "nf4"):  # bitsandbytes tiers; vLLM quantizes a draft the same way in flight
        out["quantization"] = "bitsandbytes"
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
    if cfg.draft is None and cfg.target == EMBEDDED:
        out.append(f"the embedded draft ({SHIPPED_DRAFT}) is a SpecLab draft sharing the target's embedding: "
                   "load it with engine.runtime.models.load_pair; vLLM cannot load it as a checkpoint")
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


def export_bundle(cfg: TunedConfig) -> dict[str, Any]:
    """The three forms at once (and what does not carry over)."""
    return {"speclab": cfg.to_dict(), "hf_generate_kwargs": hf_generate_kwargs(cfg),
            "vllm_speculative_config": vllm_speculative_config(cfg), "vllm_release": vllm_fields()["release"],
            "notes": notes(cfg)}


def render(cfg: TunedConfig, fmt: str) -> str:
    """The export's text in one format (json, yaml, hf, vllm)."""
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
    raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")


def default_name(cfg: TunedConfig) -> str:
    """A stored export's name when none is given: the target and the policy."""
    target = cfg.target.rstrip("/").rsplit("/", 1)[-1] or EMBEDDED
    return f"{target}-{cfg.policy}"


__all__ = ["TunedConfig", "FORMATS", "load_config", "from_dict", "to_json", "to_yaml", "hf_generate_kwargs",
           "hf_bind", "vllm_speculative_config", "vllm_fields", "export_bundle", "render", "default_name",
           "draft_source", "notes", "from_run"]


def from_run(run: Mapping[str, Any], target: str | None, draft: str | None) -> TunedConfig:
    """A config starting from a stored live run's settings. The store names a run's models by
    label, not by source, so the caller passes the sources (the workbench's sidebar). A value the
    run does not hold, or holds in a form a config refuses, keeps its default."""
    conf = run.get("config")
    if isinstance(conf, str):
        try:
            conf = json.loads(conf)
        except ValueError:
            conf = None
    conf = conf if isinstance(conf, dict) else {}
    base = TunedConfig(target=target or EMBEDDED, draft=draft or None)
    values = base.to_dict()
    picks = {"target_tier": run.get("target_tier"), "draft_tier": conf.get("draft_tier"),
             "kv_tier": run.get("kv_tier"), "policy": run.get("policy"), "reuse": conf.get("reuse"),
             "max_new_tokens": run.get("max_new_tokens"), "temperature": run.get("temperature"),
             "top_p": run.get("top_p")}
    for key, value in picks.items():
        value = _plain(value, _TYPES[key][0])
        if value is None:
            continue
        trial = dict(values, **{key: value})
        if key == "policy":  # the γ range and controller follow the policy
            trial.update(gamma_min=None, gamma_max=None, controller=None, controller_version=None)
        try:
            values = TunedConfig(**trial).to_dict()
        except ValueError:
            continue
    values["source"] = f"run {run.get('run_id')}" if run.get("run_id") else ""
    return TunedConfig(**values)


def _plain(value: Any, types: tuple[type, ...]) -> Any:
    """A stored value (numpy/pandas scalars, NaN for NULL) as the plain Python a config holds."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "item"):
        value = value.item()
    if bool in types:
        return value if isinstance(value, bool) else None
    if int in types and float not in types:
        return int(value) if isinstance(value, (int, float)) and float(value).is_integer() else None
    if float in types:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return value if isinstance(value, str) else None
