"""A tuned configuration (`TunedConfig`): the settings a user leaves the workbench with, checked
field by field; its SpecLab JSON/YAML file (what `generate --config FILE` reads back); a config
from a stored run; and the precedence of a config file and command-line flags (`with_flags`).

Torch-free at import (the workbench page and `python -m engine export` load no model)."""
from __future__ import annotations

import dataclasses
import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from engine.base.names import EMBEDDED, ENGINES, WEIGHT_TIERS, check_kv_tier, tiers_of
from engine.decode.policies import DEFAULT_POLICY, NEEDS_CONTEXT, make_policy, parse_policy, split_spec
from engine.decode.policies.fixed import parse_tree
from engine.decode.policies.rakv import ALPHA0
from engine.decode.records import K_MAX
from engine.decode.tree import geometric_ranks, static_choices

FILE_FORMAT = "speclab-tuned-config/1"  # the "format" key of a SpecLab config file


# Learned policies → the stored controller they read (engine/decode/policies: speckv-paper uses speckv's).
CONTROLLERS = {"speckv": "speckv", "speckv-rf": "speckv-rf", "speckv-paper": "speckv"}


# Policies that draft a fixed γ = their argument.
FIXED = ("fixed", "joint")


# Policies that never draft.
PLAIN = ("ar", "reuse-only")

# The policy that drafts a token tree every step (engine/decode/tree.py).
TREE = "tree"


def prior_rank_acceptance(width: int) -> list[float]:
    """Where no stored tree step measured them: the chance the target takes a reached node's
    rank-r child, α(1 − α)^r with rakv's prior α0 for the draft (rank 0: its chain's α)."""
    return geometric_ranks(ALPHA0, width)


def tree_shape(policy: str, q: list[float] | None = None) -> list[tuple[int, ...]]:
    """The static tree a `tree:NxW` policy is exported as: its N best rank paths under `q`
    (per-rank acceptance; None: the prior), at most W children a node, K_MAX deep."""
    p = parse_tree(parse_policy(policy)[1])
    return static_choices(q or prior_rank_acceptance(p.width), p.nodes, p.width, K_MAX)


@dataclass(frozen=True)
class TunedConfig:
    """A tuned speculative-decoding setting, everything a run needs besides its prompt. Fields
    left None where a default depends on others are filled in (`__post_init__`), so two configs
    that run the same compare equal."""

    # Models: `generate` loads exactly this pair again.
    target: str = EMBEDDED  # HF id or local dir; "embedded" = the embedded SmolLM2 target
    draft: str | None = None  # HF id, local dir or SpecLab draft dir; None = the target's default draft
    target_tier: str | None = None  # the target's tier (its numerics decide the output); None = fp32, q4_1 on llama.cpp
    draft_tier: str | None = None  # weight tier of the draft; None = the loader's default for it
    kv_tier: str = "native"  # the target's KV cache tier (memory per token, costs are keyed by it)
    engine: str = "torch"  # what runs the target: torch, or llamacpp (its tiers GGUF formats and cache types)
    # The γ policy and, for a learned one, which stored controller: a later retrain must not
    # silently change what an exported setting does.
    policy: str = DEFAULT_POLICY  # a policy spec (engine/decode/policies): fixed:4, rakv, speckv, ...
    controller: str | None = None  # speckv*: the controller's name (filled in from the policy)
    controller_version: int | None = None  # speckv*: its version; None = whichever is active
    # The γ range the tuner recommends: fixed policies' γ, the cap for adaptive ones in HF/vLLM,
    # which have no cost-aware γ of their own.
    gamma_min: int | None = None  # None = from the policy
    gamma_max: int | None = None  # None = from the policy
    # KV offload (engine/runtime/kv/offload.py): restore window W and whether windows are coded.
    kv_window: int | None = None  # W in tokens; None = no offload
    kv_coded: bool = False  # code offloaded windows against the predictor (engine/runtime/kv/codec.py)
    # Cross-request prefix reuse (engine/runtime/prefix/cache.py).
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
        if self.engine not in ENGINES:
            raise _FieldError("engine", f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        self._fill("target_tier", self.target_tier or tiers_of(self.engine)[0][0])
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
    "target_tier": ((str,), "a string", True), "draft_tier": ((str,), "a string", True),
    "kv_tier": ((str,), "a string", False), "engine": ((str,), "a string", False), "policy": ((str,), "a string", False),
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


def speculative_tokens(cfg: TunedConfig) -> int:
    """Tokens drafted per step where an engine drafts a fixed number: fixed/joint:k give k, every
    adaptive policy its γ cap (gamma_max)."""
    name, arg = parse_policy(cfg.policy)
    if name in PLAIN:
        raise ValueError(f"policy {cfg.policy} never drafts: name a drafting policy (fixed:4, rakv, …)")
    return int(arg or 4) if name in FIXED else cfg.gamma_max


def first_proposer(cfg: TunedConfig) -> str:
    """What an engine that runs one speculative method per engine (vLLM, llama.cpp) drafts with:
    the first proposer the policy spec names after '@', else the draft model."""
    _, names, _ = split_spec(cfg.policy)
    return names[0] if names else "draft"


# NgramProposer's defaults (engine/oracles/ngram.py, torch-bound: tests/test_export.py checks them);
# vLLM's own are 5 and 5.
NGRAM_DEFAULTS = {"max": 3, "min": 1}


def ngram_options(cfg: TunedConfig, options: Mapping[str, str] | None = None) -> dict[str, int]:
    """The n-gram lookup's sizes for `cfg`: NGRAM_DEFAULTS under the spec's `@ngram:max=…,min=…`
    (`options`: those already split from it)."""
    given = split_spec(cfg.policy)[2].get("ngram", {}) if options is None else options
    return {**NGRAM_DEFAULTS, **{k: int(v) for k, v in given.items()}}


def default_gamma(name: str, arg: str | None) -> tuple[int, int]:
    """The γ range a policy drafts in when the config names none."""
    if name in PLAIN:
        return 0, 0
    if name in FIXED:
        k = int(arg or 4)
        return k, k
    if name == "heuristic":
        return 1, K_MAX
    if name == TREE:  # a path through the tree: up to its static form's depth
        return 1, max(len(c) for c in tree_shape(f"{TREE}:{arg}" if arg else TREE))
    return 1, K_MAX  # threshold, rules, speckv*, rakv: anything up to the longest draft


def _check_values(cfg: TunedConfig, name: str, arg: str | None) -> None:
    if cfg.target.strip() == "":
        raise _FieldError("target", f"must name a model (or {EMBEDDED!r})")
    if cfg.draft is not None and cfg.draft.strip() == "":
        raise _FieldError("draft", "must name a model, or be null for the target's default draft")
    tiers = tiers_of(cfg.engine)[0]
    on = "" if cfg.engine == "torch" else " on llama.cpp"
    if cfg.target_tier not in tiers:
        raise _FieldError("target_tier", f"unknown tier {cfg.target_tier!r}{on}; known: {', '.join(tiers)}")
    if cfg.draft_tier is not None and cfg.draft_tier not in WEIGHT_TIERS:
        raise _FieldError("draft_tier", f"unknown tier {cfg.draft_tier!r}; known: {', '.join(WEIGHT_TIERS)}")
    try:
        check_kv_tier(cfg.kv_tier, cfg.engine)
    except ValueError as e:
        raise _FieldError("kv_tier", str(e)) from None
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


def _beside(data: Any, base: Path) -> Any:
    """A config whose target or draft names a directory relative to the file (an export directory's
    `speclab_draft`), with that path made absolute; names that are no directory there (hub ids, paths
    relative to the working directory) stay as written."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key in ("target", "draft"):
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (base / value).is_dir():
            out[key] = str((base / value).resolve())
    return out


# A config is a few hundred bytes; a file far past that is not one (and is not read into memory).
MAX_CONFIG_BYTES = 1 << 20


def load_config(path: str | Path) -> TunedConfig:
    """Reads a SpecLab config: a .json file as JSON, any other as YAML (safe_load: plain data only).
    A target or draft directory named relative to the file is read from beside it."""
    p = Path(path)
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode):  # a directory, or a device that never ends (/dev/zero)
            raise ValueError(f"config {p}: not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"config {p}: {info.st_size:,} bytes, more than a config holds (at most "
                             f"{MAX_CONFIG_BYTES:,})")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e  # a decode error has no strerror
        raise ValueError(f"config {p}: cannot read it ({type(e).__name__}: {why})") from None
    if p.suffix.lower() == ".json":  # YAML would let JSON's mistakes pass (a trailing comma)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config {p}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
        return from_dict(_beside(data, p.parent), f"config {p}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"config {p}: not valid YAML{at} ({problem})") from None
    return from_dict(_beside(data, p.parent), f"config {p}")


def default_name(cfg: TunedConfig) -> str:
    """A stored export's name when none is given: the target and the policy."""
    target = cfg.target.rstrip("/").rsplit("/", 1)[-1] or EMBEDDED
    return f"{target}-{cfg.policy}"


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
    engine = run.get("engine") if run.get("engine") in ENGINES else "torch"  # runs before engines: torch
    base = TunedConfig(target=target or EMBEDDED, draft=draft or None, engine=engine)
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


# -- a config file and flags ---------------------------------------------------------------------
# Set from the policy unless given with it: a new policy brings its own γ range and controller.
FOLLOW_POLICY = ("gamma_min", "gamma_max", "controller", "controller_version")


def with_flags(path: str | None, given: Mapping[str, Any], flags: Mapping[str, Any]) -> TunedConfig:
    """The config of a command: the file at `path` overridden by `given` (the fields whose flags were
    set to other than their defaults: a flag at its default cannot be told from an absent one, so it
    keeps the file's value), or, without a file, the flags alone (`flags`, every field's flag value).
    A policy given anew drops the file's γ range and controller unless they are given too."""
    if not path:
        return from_dict({k: v for k, v in flags.items() if v is not None}, "flags")
    base = load_config(path).to_dict()
    if "policy" in given and given["policy"] != base["policy"]:
        base.update({k: None for k in FOLLOW_POLICY if k not in given})
    if not given:
        return from_dict(base, f"config {path}")
    return from_dict(dict(base, **given), f"config {path} with the flags given")
