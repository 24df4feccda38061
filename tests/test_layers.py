"""The layering of docs/architecture.md, checked on the source of the whole tree (engine/, store/,
views/, bench/, app.py): every module imports; data flows down the folders' order (LAYERS), with no
import cycle (counting imports inside functions); nothing imports by name at run time
(`import_module`, `__import__`) except the CLI's dispatch to bench/; views/ and app.py reach the
engine through engine.service only (and engine.base); engine/ never imports streamlit, store/
never torch; only engine/__main__.py imports the CLI; no `pages/` folder.

The checks are functions of a source tree, so the tests below also plant each kind of breach in a
copy and see it refused."""
import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "store", "views", "bench")
# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("store",),
    ("engine.base",),
    ("engine.datasets",),
    ("engine.decode",),
    ("engine.runtime",),
    ("engine.oracles",),
    ("engine.lab",),
    ("engine.training",),
    ("engine.service",),
    ("views", "bench"),  # front ends, side by side: neither imports the other
    ("app",),  # the workbench's entry: lists the pages of views/
    ("engine.cli",),  # dispatches to bench/ by name
    ("engine.__main__",),
)
FRONT = LAYERS.index(("views", "bench"))
# (module, name imported at run time) pairs that may do so: the CLI's `bench NAME` dispatch.
DYNAMIC_IMPORTS_ALLOWED = {("engine.cli.run_commands", "bench")}


def modules(root: Path) -> dict[str, Path]:
    out = {"app": root / "app.py"} if (root / "app.py").exists() else {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours `name` imports, at the top or inside a function."""
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
            while t and t not in known and t.split(".")[0] in PACKAGES + ("torch", "streamlit"):
                t = t.rpartition(".")[0]
            if t in known:
                found.add(t)
    return found - {name}


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(name == n or name.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{name} is in no layer: add its folder to LAYERS")


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """An import cycle as a path, or None. A package importing its own submodules is not a
    cycle of data flow, so edges into a module's own ancestors are dropped."""
    def edges(m):
        return sorted(t for t in g[m] if t in g and not m.startswith(t + "."))

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in edges(m):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def upward(g: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of another front end."""
    bad = []
    for m, deps in sorted(g.items()):
        for t in sorted(deps):
            front = layer(m) == layer(t) == FRONT and m.split(".")[0] != t.split(".")[0]
            if layer(t) > layer(m) or front:
                bad.append(f"{m} → {t}")
    return bad


# What the front ends of the workbench (views/, app.py) may import of ours: the service layer is
# their one door to the engine; engine.base holds the names every layer shares.
FRONT_DOORS = ("engine.service", "engine.base", "store", "views")


def past_the_door(g: dict[str, set[str]]) -> list[str]:
    """Imports by views/ or app.py of a module below engine.service (other than engine.base)."""
    return [f"{m} → {t}" for m, deps in sorted(g.items()) if m == "app" or m.startswith("views")
            for t in sorted(deps) if not any(t == d or t.startswith(d + ".") for d in FRONT_DOORS)]


def dynamic_imports(root: Path) -> list[str]:
    """Calls of importlib.import_module or __import__, outside the allowed dispatch."""
    bad = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called not in ("import_module", "__import__"):
                continue
            arg = node.args[0] if node.args else None
            text = ast.unparse(arg) if arg is not None else ""
            top = text.strip("f'\"").split(".")[0].split("{")[0]
            if (name, top) not in DYNAMIC_IMPORTS_ALLOWED:
                bad.append(f"{name}:{node.lineno} {called}({text})")
    return bad


def external(path: Path) -> set[str]:
    """Third-party top-level packages a file imports anywhere."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


GRAPH = graph(ROOT)


# -- the tree as it is -------------------------------------------------------------------------------
def test_no_import_cycle():
    assert cycle(GRAPH) is None, " → ".join(cycle(GRAPH))


def test_every_module_is_in_a_layer_and_imports_only_downward():
    assert upward(GRAPH) == []


def test_the_pages_reach_the_engine_through_the_service_only():
    assert past_the_door(GRAPH) == []


def test_no_import_by_name_outside_the_cli_dispatch():
    assert dynamic_imports(ROOT) == []


def test_engine_never_imports_streamlit_and_store_never_torch():
    for name, path in modules(ROOT).items():
        ext = external(path)
        if name.startswith("engine"):
            assert "streamlit" not in ext, name
        if name.startswith("store"):
            assert not ext & {"torch", "transformers", "engine"}, name


def test_only_main_imports_the_cli():
    users = sorted(m for m, deps in GRAPH.items() if any(d == "engine.cli" or d.startswith("engine.cli.") for d in deps)
                   and not m.startswith("engine.cli"))
    assert users == ["engine.__main__"], users


def test_every_folder_says_what_lives_there_and_what_it_may_import():
    for init in sorted((ROOT / "engine").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if init.parent == ROOT / "engine":
            continue
        assert doc and "import" in doc, f"{init.relative_to(ROOT)} needs a docstring naming what it may import"


# The service layer's top level holds the actions a newcomer looks for first; families are folders.
SERVICE_TOP_MAX, FOLDER_MAX = 6, 12


def oversized_folders(root: Path) -> list[str]:
    """engine/ folders over FOLDER_MAX modules, and engine/service/ over SERVICE_TOP_MAX at its top."""
    bad = []
    for folder in sorted(p.parent for p in (root / "engine").rglob("__init__.py")):
        n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
        limit = SERVICE_TOP_MAX if folder == root / "engine" / "service" else FOLDER_MAX
        if n > limit:
            bad.append(f"{folder.relative_to(root)}: {n} modules (at most {limit})")
    return bad


def test_no_folder_is_a_flat_room():
    assert oversized_folders(ROOT) == []


def test_no_pages_folder():
    """Streamlit 1.67 runs a server's first script run in its old directory mode whenever a `pages/`
    folder sits beside the entry script (every file listed as a page): the pages live in views/."""
    assert not (ROOT / "pages").exists(), "rename pages/ (Streamlit's directory mode): the pages live in views/"


def test_the_service_layer_and_replay_load_without_torch():
    code = ("import sys; import engine.service, engine.lab.whatif, engine.decode.step, engine.oracles.trace, store; "
            "bad = [m for m in ('torch', 'streamlit', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("name", sorted(m for m in modules(ROOT) if not m.startswith("views")
                                        and m not in ("engine.__main__", "app")))
def test_every_module_imports(name):
    importlib.import_module(name)


# -- the checks refuse what they are for ----------------------------------------------------------------
@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the source tree to plant breaches in."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "app.py", tmp_path / "app.py")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_a_planted_cycle_is_found(tree):
    _append(tree / "engine" / "decode" / "records.py", "def _planted():\n    from engine.decode import step  # noqa")
    found = cycle(graph(tree))
    assert found and "engine.decode.records" in found and "engine.decode.step" in found


def test_a_planted_upward_import_is_found(tree):
    _append(tree / "engine" / "runtime" / "forward.py", "def _planted():\n    from engine.lab import generation  # noqa")
    found = upward(graph(tree))
    assert "engine.runtime.forward → engine.lab.generation" in found and all(b.startswith("engine.runtime.forward") for b in found)
    _append(tree / "bench" / "decode.py", "from views import common  # noqa")
    assert "bench.decode → views.common" in upward(graph(tree))


def test_a_page_reaching_past_the_service_is_found(tree):
    _append(tree / "views" / "live.py", "def _planted():\n    from engine.runtime import forward  # noqa")
    _append(tree / "app.py", "from engine.lab import decode_lock  # noqa")
    _append(tree / "views" / "kv.py", "from engine.base import names  # noqa")  # allowed: the shared names
    _append(tree / "views" / "kv.py", "from engine.service.kv import actions  # noqa")  # and the door
    found = past_the_door(graph(tree))
    assert {"app → engine.lab.decode_lock", "views.live → engine.runtime.forward"} <= set(found)
    assert all(b.startswith(("app → engine.lab", "views.live → engine.runtime")) for b in found), found


def test_a_flat_folder_is_found(tree):
    for i in range(SERVICE_TOP_MAX - len(list((tree / "engine" / "service").glob("*.py"))) + 2):
        (tree / "engine" / "service" / f"planted_{i}.py").write_text('"""planted"""\n')
    assert [b.split(":")[0] for b in oversized_folders(tree)] == ["engine/service"]


def test_a_planted_import_module_of_bench_is_found(tree):
    _append(tree / "engine" / "service" / "kv" / "actions.py",
            "def _planted():\n    import importlib\n    return importlib.import_module('bench.kv')")
    _append(tree / "views" / "kv.py", "def _also():\n    return __import__('bench.kv')")
    assert sorted(b.split(":")[0] for b in dynamic_imports(tree)) == ["engine.service.kv.actions", "views.kv"]
