"""The SpecLab draft and EAGLE head as speculators-format directories (vllm-project/speculators,
pinned at 0.9.0: its config classes' fields in engine/data/speculators_0.9.0_fields.json), and the
check of such a directory against a target (`check_speculators_dir`).

A directory holds, by speculators' conventions (speculators/config.py, speculators/model.py's
DraftVocabMixin, speculators/train/vocab_mapping.py):
- `config.json`: `speculators_model_type`, `speculators_version`, `architectures`,
  `draft_vocab_size`, `transformer_layer_config` (the layers' shape), `speculators_config`
  {`algorithm`, `proposal_methods` [{`proposal_type` "greedy", `speculative_tokens`, …}],
  `default_proposal_method`, `verifier` {`name_or_path`, `architectures`}}, and `speclab` (which
  target by its embedding fingerprint, where the weights came from, their layout);
- `model.safetensors`: the draft's own weights at bf16, and for a draft vocabulary smaller than the
  target's `d2t` (int64 [Vd]: target id = draft id + d2t[draft id], draft ids in ascending
  target-id order) and `t2d` (bool [V]: which target ids the draft has). A full vocabulary stores
  neither (speculators and vLLM read their absence as the identity). The embedding and LM head are
  the verifier's, never stored again: speculators loads them from the verifier, masked by t2d.

The model types are SpecLab's own (`speclab_eagle`, `speclab_draft`): speculators 0.9.0 registers
eagle3, peagle, mtp, dflash, dflash2, dspark and xpress, and none has these layouts (the head fuses
[embedding; the target's final-norm feature] by one linear layer and normalises the sum before
attention, with an output norm: EAGLE-1 style, where EAGLE-3 normalises the two halves apart and
feeds intermediate-layer states; the draft is an independent few-layer Llama, a type speculators
no longer has). Fields both share keep eagle3's names and meanings. A loader registers the types
in speculators' own registry (tests/test_export.py does); vLLM 0.34, which loads speculators
directories of types eagle3, dflash, dflash2 and dspark only, refuses these by their type in one
line instead of loading weights of another layout.

Torch-free at import."""
from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.base.names import DATA_DIR, EMBEDDED, EMBEDDED_LABEL, SHIPPED_DRAFT, SHIPPED_EAGLE

if TYPE_CHECKING:
    import torch

SPECULATORS_RELEASE = "0.9.0"
FIELDS_FILE = DATA_DIR / f"speculators_{SPECULATORS_RELEASE}_fields.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PROPOSAL = "greedy"  # speculators' one token-proposal type: a chain of `speculative_tokens`, top-1 accepted
MADE_BY = "python -m engine export --speculators"
# kind (the sub-directory's name) → (speculators_model_type, algorithm, what its weights are)
KINDS: dict[str, tuple[str, str, str]] = {
    "eagle": ("speclab_eagle", "eagle",
              "fc([embedding(x_{i+1}); f_i]) → RMSNorm → attention → +residual → RMSNorm → SwiGLU MLP → +residual → "
              "RMSNorm (norm.weight) = f̂_{i+1}; f_i the target's final-norm hidden state; logits = the verifier's "
              "LM-head rows (t2d) · f̂"),
    "draft": ("speclab_draft", "independent",
              "a Llama decoder of transformer_layer_config's layers; embedding and tied LM head are the verifier's"),
}
# Top-level fields of a SpecLab directory besides SpeculatorModelConfig's own: eagle3's names
# (tests/test_export.py checks they are eagle3 fields of the pinned release) and `speclab`.
SHARED_FIELDS = ("architectures", "draft_vocab_size", "transformer_layer_config")
EAGLE_ARCHITECTURE = "SpecLabEagleHead"
# SpecLab head tensor (engine/runtime/eagle_head.py) → its name in a speculators checkpoint (the
# decoder layer's names of speculators' eagle3 checkpoints).
EAGLE_NAMES = {
    "fc.weight": "fc.weight",
    "q.weight": "layers.0.self_attn.q_proj.weight", "k.weight": "layers.0.self_attn.k_proj.weight",
    "v.weight": "layers.0.self_attn.v_proj.weight", "o.weight": "layers.0.self_attn.o_proj.weight",
    "gate.weight": "layers.0.mlp.gate_proj.weight", "up.weight": "layers.0.mlp.up_proj.weight",
    "down.weight": "layers.0.mlp.down_proj.weight",
    "attn_norm": "layers.0.input_layernorm.weight", "mlp_norm": "layers.0.post_attention_layernorm.weight",
    "out_norm": "norm.weight",
}

# HeadShape field → its name in a Llama config (the head's layer is a Llama decoder layer).
LLAMA_NAMES = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
               "head_dim": "head_dim", "intermediate": "intermediate_size", "eps": "rms_norm_eps"}


@cache
def pinned() -> dict[str, Any]:
    """The pinned speculators release's config fields (engine/service/pinned_fields.py made them)."""
    return json.loads(FIELDS_FILE.read_text())


# -- the draft vocabulary ---------------------------------------------------------------------------
def vocab_maps(vocab_map: "torch.Tensor | None", vocab_size: int) -> dict[str, "torch.Tensor"]:
    """speculators' `d2t`/`t2d` for a draft vocabulary given as target ids ([Vd], any order):
    {} for none or the whole vocabulary."""
    import torch

    if vocab_map is None:
        return {}
    ids = vocab_map.long().flatten().sort().values  # [Vd] ascending: draft id i ↔ target id ids[i]
    if ids.numel() == 0:
        raise ValueError("a draft vocabulary must hold at least one target id")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"a draft vocabulary must hold target ids in [0, {vocab_size}), got ids in "
                         f"[{int(ids[0])}, {int(ids[-1])}]")
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError("a draft vocabulary names a target id twice")
    if ids.numel() == vocab_size:
        return {}
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def draft_token_ids(tensors: dict[str, "torch.Tensor"], vocab_size: int) -> "torch.Tensor":
    """The draft vocabulary's target ids in draft-id order ([Vd]) from `d2t`/`t2d`, each checked
    against the other; the whole vocabulary when neither is stored."""
    import torch

    have = {"d2t", "t2d"} & set(tensors)
    if not have:
        return torch.arange(vocab_size)
    if len(have) == 1:
        raise ValueError(f"holds {min(have)} without {min({'d2t', 't2d'} - have)}: speculators stores both or neither")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    ids = torch.arange(d2t.numel()) + d2t
    if t2d.numel() != vocab_size:
        raise ValueError(f"t2d covers {t2d.numel()} target ids, the target has {vocab_size}")
    if not torch.equal(t2d.nonzero().flatten(), ids):
        raise ValueError("d2t and t2d name different target ids")
    return ids


# -- the target -------------------------------------------------------------------------------------
def _embedded(target: str | None) -> bool:
    return target in (None, "", EMBEDDED)


def _source(target: str | None) -> str:
    """Where the target's files are: the embedded model's converted copy, else its id or path."""
    from engine.runtime.models import embedded_dir

    return str(embedded_dir()) if _embedded(target) else target


def _target_name(target: str | None) -> str:
    return EMBEDDED_LABEL if _embedded(target) else target


def target_embedding(target: str | None) -> "torch.Tensor":
    """The target's input embedding [V, H] at fp32: read from its safetensors when it is a local
    directory (no model built), else from the loaded model."""
    import torch

    from engine.runtime import draft_model as draftlib
    from engine.runtime.models import load_model

    source = _source(target)
    local = Path(source).is_dir() and any(Path(source).glob("*.safetensors"))
    model = None if local else load_model(source, "fp32", torch.device("cpu"))
    return draftlib.target_embedding(source, model)


def verifier_of(target: str | None) -> dict[str, Any]:
    """speculators' VerifierConfig of a target: its name and its config's architectures."""
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(_source(target))
    except OSError as e:
        raise ValueError(f"cannot read the config of target {_target_name(target)}: {e}") from None
    return {"name_or_path": _target_name(target), "architectures": list(config.get("architectures") or [])}


def _check_made_for(what: str, path: Path, meta: dict, fingerprint: str, target: str | None) -> None:
    want = meta.get("target_fingerprint")
    if want is None:
        raise ValueError(f"{what} {path} names no target fingerprint: it cannot be checked against "
                         f"{_target_name(target)}")
    if want != fingerprint:
        raise ValueError(f"{what} {path} was trained for target {meta.get('target', '?')!r}, not for "
                         f"{_target_name(target)} (embedding fingerprint {want}, the target's {fingerprint})")


# -- what to export ---------------------------------------------------------------------------------
def _draft_dir(target: str | None, draft: str | None) -> Path | None:
    from engine.runtime import draft_model as draftlib

    if draft in (None, ""):
        return SHIPPED_DRAFT if _embedded(target) and draftlib.is_draft_dir(SHIPPED_DRAFT) else None
    if not draftlib.is_draft_dir(draft):
        raise ValueError(f"{draft} is not a SpecLab draft (no {draftlib.MARKER}): vLLM loads a Hugging Face draft "
                         "as it is (method draft_model)")
    return Path(draft)


def _eagle_dir(target: str | None, eagle: str | None) -> Path | None:
    from engine.runtime import eagle_head as eaglelib

    if eagle == "off":
        return None
    if eagle in (None, ""):
        return SHIPPED_EAGLE if _embedded(target) and eaglelib.is_head_dir(SHIPPED_EAGLE) else None
    if not eaglelib.is_head_dir(eagle):
        raise ValueError(f"{eagle!r} is not an EAGLE head directory (no {eaglelib.MARKER})")
    return Path(eagle)


def _config(kind: str, architectures: list[str], layers: dict[str, Any], draft_vocab: int,
            verifier: dict[str, Any], tokens: int, speclab: dict[str, Any]) -> dict[str, Any]:
    model_type, algorithm, layout = KINDS[kind]
    proposal = {"proposal_type": PROPOSAL, "speculative_tokens": tokens, "verifier_accept_k": 1,
                "accept_tolerance": 0.0}
    return {"speculators_model_type": model_type, "speculators_version": SPECULATORS_RELEASE,
            "architectures": architectures, "draft_vocab_size": draft_vocab, "transformer_layer_config": layers,
            "speculators_config": {"algorithm": algorithm, "proposal_methods": [proposal],
                                   "default_proposal_method": PROPOSAL, "verifier": verifier},
            "speclab": dict(speclab, kind=kind, layout=layout, made_by=MADE_BY)}


def _provenance(path: Path, meta: dict) -> dict[str, Any]:
    root = DATA_DIR.parents[1]  # a shipped draft or head is named relative to the repository
    source = path.resolve().relative_to(root).as_posix() if path.resolve().is_relative_to(root) else str(path)
    return {"source": source, "target": meta.get("target"), "target_fingerprint": meta["target_fingerprint"]}


def _eagle_part(path: Path, embedding: "torch.Tensor", verifier: dict, tokens: int, target: str | None):
    """(config, tensors) of a SpecLab EAGLE head."""
    import torch
    from safetensors.torch import load_file

    from engine.runtime import draft_model as draftlib
    from engine.runtime import eagle_head as eaglelib

    meta = json.loads((path / eaglelib.MARKER).read_text())
    _check_made_for("EAGLE head", path, meta, draftlib.fingerprint(embedding), target)
    state = load_file(str(path / eaglelib.WEIGHTS))
    vocab_map = state.pop("vocab_map")
    if set(state) != set(EAGLE_NAMES):
        raise ValueError(f"EAGLE head {path} holds {sorted(set(state) ^ set(EAGLE_NAMES))[:3]} beyond or short of "
                         "the head's tensors")
    tensors = {EAGLE_NAMES[k]: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    V = embedding.shape[0]
    tensors.update(vocab_maps(vocab_map, V))
    s = meta["shape"]
    layers = {"model_type": "llama", "num_hidden_layers": 1, **{LLAMA_NAMES[k]: s[k] for k in LLAMA_NAMES},
              "rope_parameters": {"rope_theta": s["rope_theta"], "rope_type": "default"},
              "hidden_act": "silu", "vocab_size": V, "tie_word_embeddings": True}
    config = _config("eagle", [EAGLE_ARCHITECTURE], layers, vocab_map.numel(), verifier, tokens,
                     _provenance(path, meta))
    return config, tensors


def _draft_part(path: Path, embedding: "torch.Tensor", verifier: dict, tokens: int, target: str | None):
    """(config, tensors) of a SpecLab draft: its own weights dequantized to bf16, and a reduced LM
    head's `vocab_map` (the target ids of its rows) as d2t/t2d where the draft has one."""
    import torch
    from safetensors.torch import load_file

    from engine.runtime import draft_model as draftlib

    meta = json.loads((path / draftlib.MARKER).read_text())
    _check_made_for("draft", path, meta, draftlib.fingerprint(embedding), target)
    raw = load_file(str(path / draftlib.WEIGHTS))
    vocab_map = raw.pop("vocab_map", None)
    tensors = {k: v.contiguous() for k, v in draftlib.dequantize(raw, torch.bfloat16).items()}
    V = embedding.shape[0]
    tensors.update(vocab_maps(vocab_map, V))
    layers = {k: v for k, v in json.loads((path / CONFIG).read_text()).items()
              if not k.startswith("_") and k != "transformers_version"}
    draft_vocab = V if vocab_map is None else vocab_map.numel()
    config = _config("draft", list(layers.get("architectures") or []), layers, draft_vocab, verifier, tokens,
                     _provenance(path, meta))
    return config, tensors


PARTS = {"draft": (_draft_dir, _draft_part), "eagle": (_eagle_dir, _eagle_part)}


def export_speculators(out: str | Path, target: str | None = None, draft: str | None = None,
                       eagle: str | None = None, tokens: int = 4) -> list[Path]:
    """Writes `out/draft` (the SpecLab draft: `draft`, or the embedded target's shipped one) and
    `out/eagle` (the EAGLE head: `eagle`, the shipped one by default, `off` for none) as
    speculators directories for `target`, proposing `tokens` tokens a step; returns the
    directories written. Everything is read and checked (each part made for this target) before
    the first file is written, into a temporary sibling renamed into place: a refused export
    leaves nothing behind."""
    import os

    from safetensors.torch import save

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory: name a new one")
    if tokens < 1:
        raise ValueError(f"speculative tokens must be ≥ 1, got {tokens}")
    given = {"draft": draft, "eagle": eagle}
    sources = {kind: path for kind, (find, _) in PARTS.items() if (path := find(target, given[kind])) is not None}
    if not sources:
        raise ValueError(f"nothing to export for target {_target_name(target)}: pass --draft (a SpecLab draft) "
                         "or --eagle (an EAGLE head)")
    embedding = target_embedding(target)  # [V, H]
    verifier = verifier_of(target)
    parts = {kind: PARTS[kind][1](path, embedding, verifier, tokens, target) for kind, path in sources.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier try's
    try:
        for kind, (config, tensors) in parts.items():
            (tmp / kind).mkdir(parents=True)
            (tmp / kind / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            # bytes written here, not save_file: its file would be private (0600) whatever the umask
            (tmp / kind / WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / kind for kind in parts]


# -- reading and checking a directory ---------------------------------------------------------------
def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"speculators dir {path}: cannot read {CONFIG}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculators dir {path}: {CONFIG} is not a JSON object")
    return config


def read_tensors(path: str | Path) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    try:
        return load_file(str(Path(path) / WEIGHTS))
    except (OSError, ValueError) as e:
        raise ValueError(f"speculators dir {path}: cannot read {WEIGHTS}: {e}") from None


def _unknown(given: dict, fields: dict, what: str) -> list[str]:
    extra = sorted(set(given) - set(fields))
    return [f"{what} has fields the pinned speculators release does not: {', '.join(extra)}"] if extra else []


def _missing(given: dict, fields: dict, what: str) -> list[str]:
    need = sorted(n for n, f in fields.items() if f["required"] and n not in given)
    return [f"{what} lacks the required {', '.join(need)}"] if need else []


def config_problems(config: dict[str, Any]) -> list[str]:
    """What in a speculators config.json the pinned release's config classes would refuse (or, in
    a SpecLab directory, not know), one line each; [] when nothing."""
    p = pinned()
    cls = p["classes"]
    model_type = config.get("speculators_model_type")
    speclab = {t for t, _, _ in KINDS.values()}
    if model_type not in set(p["model_types"]) | speclab:
        return [f"speculators_model_type {model_type!r} is neither speculators {p['release']}'s "
                f"({', '.join(sorted(p['model_types']))}) nor SpecLab's ({', '.join(sorted(speclab))})"]
    out = []
    if not isinstance(config.get("speculators_version"), str):
        out.append("speculators_version is missing")
    if model_type in speclab:
        top = dict(cls["SpeculatorModelConfig"]["fields"], **dict.fromkeys(SHARED_FIELDS + ("speclab",)))
        out += _unknown(config, top, "config.json")
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        return out + ["speculators_config is missing"]
    out += _missing(spec, cls["SpeculatorsConfig"]["fields"], "speculators_config")
    out += _unknown(spec, cls["SpeculatorsConfig"]["fields"], "speculators_config")
    verifier = spec.get("verifier")
    if isinstance(verifier, dict):
        out += _missing(verifier, cls["VerifierConfig"]["fields"], "verifier")
        out += _unknown(verifier, cls["VerifierConfig"]["fields"], "verifier")
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods:
        return out + ["proposal_methods must be a non-empty list"]
    for m in methods:
        kind = p["proposal_types"].get(m.get("proposal_type") if isinstance(m, dict) else None)
        if kind is None:
            out.append(f"proposal_type {m.get('proposal_type') if isinstance(m, dict) else m!r} is not one of "
                       f"{', '.join(p['proposal_types'])}")
            continue
        out += _unknown(m, kind["fields"], f"proposal method {m['proposal_type']}")
        if not isinstance(m.get("speculative_tokens", 1), int) or m.get("speculative_tokens", 1) < 1:
            out.append(f"speculative_tokens must be an integer ≥ 1, got {m.get('speculative_tokens')!r}")
    if spec.get("default_proposal_method") not in [m.get("proposal_type") for m in methods if isinstance(m, dict)]:
        out.append(f"default_proposal_method {spec.get('default_proposal_method')!r} is none of proposal_methods")
    return out


def check_speculators_dir(path: str | Path, target: str | None = None) -> dict[str, Any]:
    """The directory's config.json, checked: its fields against the pinned speculators release,
    its verifier against `target` (the architectures, and the embedding fingerprint a SpecLab
    directory records, else the verifier's name), its d2t/t2d against draft_vocab_size. Raises a
    one-line ValueError for the first problem; reads, never writes."""
    path = Path(path)
    config = read_config(path)
    problems = config_problems(config)
    if problems:
        raise ValueError(f"speculators dir {path}: {problems[0]}")
    verifier = config["speculators_config"]["verifier"]
    archs = ", ".join(verifier.get("architectures") or []) or "no architectures"
    theirs = f"{verifier.get('name_or_path')!r} ({archs})"
    ours = verifier_of(target)
    other = ValueError(f"speculators dir {path} is for verifier {theirs}, not for {ours['name_or_path']!r} "
                       f"({', '.join(ours['architectures'])})")
    if list(verifier.get("architectures") or []) != ours["architectures"]:
        raise other
    embedding = target_embedding(target)
    fingerprint = (config.get("speclab") or {}).get("target_fingerprint")
    if fingerprint is None and verifier.get("name_or_path") != ours["name_or_path"]:
        raise other
    if fingerprint is not None:
        from engine.runtime import draft_model as draftlib

        if fingerprint != draftlib.fingerprint(embedding):
            raise ValueError(f"speculators dir {path} is for verifier {theirs}, not for {ours['name_or_path']!r}: "
                             "the embedding fingerprint differs")
    try:
        ids = draft_token_ids(read_tensors(path), embedding.shape[0])
    except ValueError as e:
        raise ValueError(f"speculators dir {path}: {e}") from None
    if ids.numel() != config.get("draft_vocab_size", ids.numel()):
        raise ValueError(f"speculators dir {path}: draft_vocab_size is {config['draft_vocab_size']}, "
                         f"its d2t/t2d name {ids.numel()} tokens")
    return config


def summary(path: str | Path, config: dict[str, Any]) -> str:
    """One line naming what a checked directory holds."""
    spec = config["speculators_config"]
    tokens = spec["proposal_methods"][0].get("speculative_tokens")
    return (f"{path}: {config['speculators_model_type']} ({spec['algorithm']}), draft vocabulary "
            f"{config.get('draft_vocab_size')}, {tokens} tokens a step, verifier {spec['verifier']['name_or_path']}")
