"""A self-contained export directory (`python -m engine export --format F --out DIR`): the tuned
setting in one engine's own form beside the weights it names, every path relative to DIR, and a
manifest (`speclab_export.json`) that records which engine and version it was written for, which
target, and each file's size and SHA-256, so that `check_export_dir` can say in one line what is
wrong with a directory before an engine loads it.

    DIR/speclab_export.json     the manifest
    DIR/hf_generate_kwargs.json `target.generate(ids, **kwargs)`; assistant_model is "draft"   (--format hf)
    DIR/vllm.json               `vllm.LLM(**engine_args)`; speculative_config.model is "draft" (--format vllm)
    DIR/speclab.json|yaml       `python -m engine generate --config DIR/speclab.yaml`          (--format json|yaml)
    DIR/draft/                  the draft as a model the engine loads: a SpecLab draft as a standalone
                                Llama (its layers, the target's embedding as a tied head, tokenizer), a
                                Hugging Face draft directory as it is; generation_config carries the
                                assistant keys
    DIR/speclab_draft/          for SpecLab (json|yaml): its own draft directory as it is (int8 rows,
                                shared embedding), which it reads faster than a standalone model

A draft named by a hub id is named as it is, not copied.

A SpecLab draft shares the target's embedding and LM head and stores its matrices as int8 rows;
neither Hugging Face nor vLLM reads that, so the standalone form holds plain tensors at the
draft's tier (bf16 by default) with the target's embedding copied in. SpecLab's EAGLE head has a
layout of its own (normed fusion, output norm) that no pinned engine reads: an export never
names it, and says so.

Torch-free at import."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from engine.base.helpers import one_line
from engine.base.names import EMBEDDED, EMBEDDED_LABEL, FLOAT_TIER_DTYPES
from engine.service.export import formats as ex
from engine.service.export.tuned_config import TunedConfig, first_proposer, to_json, to_yaml

MANIFEST = "speclab_export.json"
MANIFEST_FORMAT = "speclab-export/1"
DRAFT = "draft"  # the standalone draft (Hugging Face and vLLM)
SPECLAB_DRAFT = "speclab_draft"  # SpecLab's own draft directory
CONFIG_FILES = {"hf": "hf_generate_kwargs.json", "vllm": "vllm.json", "json": "speclab.json", "yaml": "speclab.yaml"}
# Weight tier → the dtype a standalone draft is stored at and vLLM's `dtype` for the target.
DTYPES = FLOAT_TIER_DTYPES  # the tiers an export stores as they are, by their dtype's name
# Tokenizer and generation files copied from the target beside the standalone draft.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


# -- versions --------------------------------------------------------------------------------------
def speclab_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("speclab")
    except PackageNotFoundError:  # a checkout that was never installed
        return "0"


def transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def written_for(fmt: str) -> tuple[str, str]:
    """(engine, release) an export in `fmt` is written for: the pinned vLLM release, the
    transformers installed here (the one its test ran), this SpecLab."""
    if fmt == "vllm":
        return "vllm", ex.vllm_fields()["version"]
    if fmt == "hf":
        return "transformers", transformers_version()
    return "speclab", speclab_version()


def same_release(written: str, running: str) -> bool:
    """Releases match on major.minor: a patch release keeps the config fields and weight names."""
    def minor(v: str) -> tuple[str, ...]:
        return tuple(v.split("+")[0].split(".")[:2])

    return minor(written) == minor(running)


# -- writing ---------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _target_source(cfg: TunedConfig) -> str:
    from engine.runtime.embedded import embedded_dir

    return str(embedded_dir()) if cfg.target == EMBEDDED else cfg.target


def _target_config(source: str) -> dict[str, Any]:
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(source)
    except OSError as e:
        raise ValueError(f"cannot read the config of target {source}: {one_line(str(e), limit=200)}") from None
    return config


def _vocab_of(config: dict[str, Any]) -> int:
    text = config.get("text_config") or config
    return int(text["vocab_size"])


def _draft_to_copy(cfg: TunedConfig) -> tuple[Path, bool] | None:
    """(the draft's directory, a SpecLab draft?) when the setting's draft is a local directory the
    export writes into DIR; None when it is a hub id, or the target drafting for itself."""
    from engine.runtime import draft_model as draftlib

    source = ex.draft_source(cfg)
    if cfg.draft is None and cfg.target != EMBEDDED:
        return None  # the target drafts for itself (at nf4): the forms name the target
    path = Path(source)
    if not path.is_absolute() and not path.exists():
        path = ex.REPO_ROOT / source  # the shipped draft is named relative to the repository
    if draftlib.is_draft_dir(path):
        return path, True
    return (path, False) if (path / "config.json").is_file() else None


def copy_hf_draft(src: Path, target_vocab: int, out: Path, assistant: dict[str, Any]) -> None:
    """A Hugging Face draft directory copied as it is, its generation_config carrying `assistant`."""
    from transformers import GenerationConfig

    have = _vocab_of(json.loads((src / "config.json").read_text()))
    if have != target_vocab:
        raise ValueError(f"draft {src} has a vocabulary of {have} tokens, the target {target_vocab}")
    shutil.copytree(src, out)
    if assistant:
        try:
            gen = GenerationConfig.from_pretrained(out)
        except OSError:
            gen = GenerationConfig()
        for key, value in assistant.items():
            setattr(gen, key, value)
        gen.save_pretrained(out)


def write_standalone_draft(src: Path, target_source: str, out: Path, tier: str,
                           assistant: dict[str, Any]) -> None:
    """The SpecLab draft at `src` as a Llama model Hugging Face and vLLM load on their own: its
    layers dequantized to `tier`, the target's embedding as `model.embed_tokens.weight` (tied LM
    head), the target's tokenizer, and a generation_config carrying `assistant` (the keys
    transformers' assisted generation reads from the assistant's own generation_config)."""
    import torch
    from safetensors.torch import load_file, save
    from transformers import AutoConfig, GenerationConfig

    from engine.runtime import draft_model as draftlib

    dtype = getattr(torch, DTYPES[tier])
    embedding = draftlib.target_embedding(target_source, _loaded_target(target_source))  # [V, H] fp32
    meta = json.loads((src / draftlib.MARKER).read_text())
    want = meta.get("target_fingerprint")
    if want and want != draftlib.fingerprint(embedding):
        raise ValueError(f"draft {src} was trained for target {meta.get('target', '?')!r}, not for {target_source} "
                         "(embedding fingerprint differs)")
    config = AutoConfig.from_pretrained(src)
    text = config.get_text_config()
    if text.vocab_size != embedding.shape[0]:
        raise ValueError(f"draft {src} has a vocabulary of {text.vocab_size} tokens, the target {embedding.shape[0]}")
    state = {k: v for k, v in draftlib.dequantize(load_file(str(src / draftlib.WEIGHTS)), dtype).items()
             if k != "vocab_map"}
    state["model.embed_tokens.weight"] = embedding.to(dtype)
    config.tie_word_embeddings = True
    config.dtype = DTYPES[tier]
    for stale in ("_model_name_or_path", "_name_or_path"):  # the distillation's, not this model's
        if hasattr(config, stale):
            delattr(config, stale)
    _check_layout(config, state, src)
    out.mkdir(parents=True)
    config.save_pretrained(out)
    # Bytes written here, not save_file: its file would be private (0600) whatever the umask.
    (out / "model.safetensors").write_bytes(save({k: v.contiguous() for k, v in state.items()},
                                                 metadata={"format": "pt"}))
    try:
        gen = GenerationConfig.from_pretrained(target_source)
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    for key, value in assistant.items():
        setattr(gen, key, value)
    gen.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(target_source) / name).is_file():
            shutil.copyfile(Path(target_source) / name, out / name)


def _check_layout(config, state: dict[str, Any], src: Path) -> None:
    """The tensors are exactly what the architecture's model holds (its tied head aside): built on
    the meta device, so nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = {k for k in model.state_dict() if k.endswith("lm_head.weight")}
    want = set(model.state_dict()) - tied
    if set(state) != want:
        odd = sorted(set(state) ^ want)
        raise ValueError(f"draft {src}: {len(odd)} tensors do not fit {type(model).__name__} (e.g. {odd[0]}): "
                         "this architecture has no standalone form here")


def _loaded_target(source: str):
    """None for a local directory (its embedding is read from its files), else the model."""
    if Path(source).is_dir() and any(Path(source).glob("*.safetensors")):
        return None
    import torch

    from engine.runtime.models import load_model

    return load_model(source, "fp32", torch.device("cpu"))


def _draft_tier(cfg: TunedConfig) -> str:
    tier = cfg.draft_tier or "bf16"  # a SpecLab draft runs at bf16 unless told (runtime/models.py)
    if tier not in DTYPES:
        raise ValueError(f"a standalone draft is stored at {', '.join(DTYPES)}, not at {tier}")
    return tier


def _uses_draft(cfg: TunedConfig, fmt: str) -> bool:
    """Whether the form in `fmt` names a draft model (vLLM drafts with one proposer)."""
    if cfg.policy_name in ex.PLAIN:
        return False
    if fmt == "vllm":
        return first_proposer(cfg) in ("draft", "eagle")
    if fmt == "hf":
        return ex.hf_proposer(cfg) == "draft"
    return True


def _vllm_form(cfg: TunedConfig, target: str, draft: str | None) -> dict[str, Any]:
    spec = ex.vllm_speculative_config(cfg)
    if spec is None:
        raise ValueError(f"policy {cfg.policy} never drafts: there is no vLLM speculative_config for it")
    if draft:
        spec = dict(spec, method="draft_model", model=draft)
        spec.pop("quantization", None)
    args: dict[str, Any] = {"model": target, "speculative_config": spec}
    if cfg.target_tier in DTYPES:
        args["dtype"] = DTYPES[cfg.target_tier]
    else:  # bitsandbytes tiers: vLLM quantizes in flight the same way
        args.update(dtype="bfloat16", quantization="bitsandbytes")
    return args


def write_export_dir(cfg: TunedConfig, fmt: str, out: str | Path, made_by: str = "") -> dict[str, Any]:
    """Writes the export directory of `cfg` in `fmt` at `out` (new or empty) and returns its
    manifest. It is written into a temporary sibling renamed into place: a refused export (a draft
    made for another target, another vocabulary) or a failed one leaves nothing behind."""
    if fmt not in CONFIG_FILES:
        raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(CONFIG_FILES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory: name a new one")
    target = _target_source(cfg)
    tconfig = _target_config(target)
    # A local draft is written into the directory (a SpecLab one for HF and vLLM as a standalone
    # model, for SpecLab as it is); a hub id is named as it is.
    plan = _draft_to_copy(cfg) if _uses_draft(cfg, fmt) else None
    speclab = fmt in ("json", "yaml")
    here = (SPECLAB_DRAFT if plan[1] and speclab else DRAFT) if plan else None
    engine, release = written_for(fmt)
    if fmt == "hf":
        form = ex.hf_generate_kwargs(cfg)
        if here:
            form["assistant_model"] = here
        text = json.dumps(form, indent=2) + "\n"
    elif fmt == "vllm":
        form = _vllm_form(cfg, target, here)
        text = json.dumps(form, indent=2) + "\n"
    else:
        form = {}
        local = TunedConfig(**{**cfg.to_dict(), "draft": here}) if here else cfg
        text = to_json(local) if fmt == "json" else to_yaml(local)
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT, "engine": engine, "engine_version": release, "export_format": fmt,
        "config_file": CONFIG_FILES[fmt],
        "target": {"source": cfg.target if cfg.target != EMBEDDED else EMBEDDED, "path": target,
                   "name": EMBEDDED_LABEL if cfg.target == EMBEDDED else cfg.target,
                   "vocab_size": _vocab_of(tconfig), "architectures": list(tconfig.get("architectures") or [])},
        "draft": None, "speclab": cfg.to_dict(), "notes": ex.notes(cfg),
        "made_by": made_by or f"python -m engine export --format {fmt} --out DIR", "speclab_version": speclab_version(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier try's
    try:
        tmp.mkdir()
        if plan:
            src, is_speclab = plan
            assistant = {k: form[k] for k in ex.HF_ASSISTANT_KEYS if k in form}
            if is_speclab and speclab:
                shutil.copytree(src, tmp / here)
                dtype = "int8 rows"
            elif is_speclab:
                dtype = DTYPES[_draft_tier(cfg)]
                write_standalone_draft(src, target, tmp / here, _draft_tier(cfg), assistant)
            else:
                copy_hf_draft(src, _vocab_of(tconfig), tmp / here, assistant)
                dtype = str(json.loads((tmp / here / "config.json").read_text()).get("dtype", "as saved"))
            manifest["draft"] = {"dir": here, "from": ex.named_path(src), "dtype": dtype,
                                 "vocab_size": _vocab_of(json.loads((tmp / here / "config.json").read_text()))}
        (tmp / CONFIG_FILES[fmt]).write_text(text, encoding="utf-8")
        manifest["files"] = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                             for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# -- checking --------------------------------------------------------------------------------------
def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"export {path}: no {MANIFEST} (not a SpecLab export directory)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"export {path}: cannot read {MANIFEST}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"export {path}: {MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    return manifest


def check_export_dir(path: str | Path, engine_version: str | None = None,
                     target_vocab: int | None = None) -> dict[str, Any]:
    """The manifest of the export at `path`, checked: every file it lists present, the draft's
    vocabulary the target's (`target_vocab`, else the one the export recorded), the engine release
    it was written for matching `engine_version` (major.minor) when given, every file as written
    (size and SHA-256). Raises one ValueError line for the first problem; reads, never writes."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest.get("files") or {}
    for name in files:
        if not (path / name).is_file():
            raise ValueError(f"export {path}: {name} is missing (the export wrote it)")
    draft = manifest.get("draft")
    want = target_vocab if target_vocab is not None else manifest["target"]["vocab_size"]
    if draft:
        try:
            have = _vocab_of(json.loads((path / draft["dir"] / "config.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"export {path}: cannot read {draft['dir']}/config.json ({type(e).__name__})") from None
        if have != want:
            raise ValueError(f"export {path}: the draft's vocabulary ({have} tokens, {draft['dir']}/config.json) "
                             f"does not match the target's ({want} tokens)")
    engine, release = manifest["engine"], manifest["engine_version"]
    if engine_version is not None and not same_release(release, engine_version):
        raise ValueError(f"export {path} was written for {engine} {release}, not for {engine} {engine_version}: "
                         f"export it again for this release")
    for name, entry in files.items():
        p = path / name
        if p.stat().st_size != entry["bytes"] or _sha256(p) != entry["sha256"]:
            raise ValueError(f"export {path}: {name} differs from what the export wrote (size or SHA-256): "
                             "export again, or restore the file")
    return manifest


def resolve(path: str | Path, value: str) -> str:
    """A path an export's config names, relative to the export directory, as an absolute path
    (a name that is no file there, a hub id, is returned as it is)."""
    p = Path(path) / value
    return str(p.resolve()) if not Path(value).is_absolute() and p.exists() else value


def summary(path: str | Path, manifest: dict[str, Any]) -> str:
    """One line naming what a checked export holds."""
    draft = manifest.get("draft")
    what = f"draft {draft['dir']}/ ({draft['dtype']})" if draft else "no draft"
    n = len(manifest.get("files") or {})
    return (f"{path}: {manifest['config_file']} for {manifest['engine']} {manifest['engine_version']}, "
            f"target {manifest['target']['name']}, {what}, {n} file{'s' if n != 1 else ''} as written")
