"""The layering rules of docs/architecture.md, checked on the source: every module imports, data
flows down (no import cycle, counting imports inside functions), engine/ never imports
streamlit, store/ never imports torch, and only engine/__main__.py imports engine/cli.py."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "store", "views", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at the top or inside a function, resolved to our modules."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in MODULES and t.split(".")[0] in PACKAGES + ("torch", "streamlit"):
                t = t.rpartition(".")[0]
            if t:
                found.add(t)
    return found - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _external(name: str) -> set[str]:
    """Third-party top-level packages `name` imports anywhere in its file."""
    tree = ast.parse(MODULES[name].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_import_cycle():
    # A package imports its own submodules; a submodule importing its package's siblings
    # through the package is not a cycle of data flow. Edges into a module's own ancestors
    # are dropped for that reason; every other edge counts.
    def edges(m):
        return {t for t in GRAPH[m] if t in GRAPH and not m.startswith(t + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges(m):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " → ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_engine_never_imports_streamlit_and_store_never_torch():
    for name in MODULES:
        ext = _external(name)
        if name.startswith("engine"):
            assert "streamlit" not in ext, name
        if name.startswith("store"):
            assert not ext & {"torch", "transformers", "engine"}, name


def test_only_main_imports_the_cli():
    users = sorted(m for m, deps in GRAPH.items() if "engine.cli.main" in deps)
    assert users == ["engine.__main__"], users


def test_the_service_layer_and_replay_load_without_torch():
    code = ("import sys; import engine.service, engine.lab.whatif, engine.decode.step, engine.oracles.trace, store; "
            "bad = [m for m in ('torch', 'streamlit', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not m.startswith("views") and m != "engine.__main__"))
def test_every_module_imports(name):
    importlib.import_module(name)
