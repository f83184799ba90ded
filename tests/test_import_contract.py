"""The import contract (docs/architecture.md, "Layers"): drawn from every import in the package's source (at
module level or inside a function), a folder imports only from its own layer or the ones below, and no
modules import each other in a circle. `make lint` runs this file.

Layers, lowest first: the package root `rlvr/` (errors, plugins, progress, chat prompts, the child guard);
`storage/`; `curricula/` and `verifiers/` (which do not import each other); `environments/`; `data/`; `trainer/`;
`serving/` and `tasks/` (which do not import each other); `flows/`; the CLI (`flows/cli/`), which nothing else
imports.
"""

from __future__ import annotations

import ast
import shutil
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS: list[set[str]] = [
    {"rlvr"},
    {"storage"},
    {"curricula"},
    {"verifiers"},
    {"environments"},
    {"data"},
    {"trainer"},
    {"serving"},
    {"tasks"},
    {"flows"},
    {"flows/cli"},
]
FOLDERS = [folder for layer in LAYERS for folder in layer if "/" not in folder]  # the package's top folders
RANK = {folder: rank for rank, layer in enumerate(LAYERS) for folder in layer}
RANK["verifiers"] = RANK["curricula"]  # one layer: neither may import the other (checked below)
RANK["tasks"] = RANK["serving"]  # one layer too


def modules(root: Path = REPO) -> dict[str, tuple[str, Path]]:
    """Module name -> (its layer's folder, its file), for every .py file of the package under `root`; a
    package's `__init__.py` is the module of the package's own name (`rlvr.storage`), its face."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(["rlvr"] + ([] if folder == "rlvr" else [folder]) + parts)
            found[name] = (layer_of(path, root), path)
    return found


def layer_of(path: Path, root: Path = REPO) -> str:
    """The most specific layer folder holding `path` (flows/cli/ before flows/)."""
    relative = path.relative_to(root).as_posix()
    return max((f for f in RANK if relative.startswith(f + "/")), key=len)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an import in `tree` names: `import a.b` names a.b; `from a import b` names a (the
    face of package a, whose `__init__` runs first) and a.b; `from . import b` is resolved against `module`;
    `importlib.import_module("a.b")` with a literal name names a.b."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def imports(found: dict[str, tuple[str, Path]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports. An import from a package's face is an edge to that package's
    `__init__` even from inside the package: `from rlvr.storage import catalog` in storage/store.py runs
    storage/__init__.py, which imports store.py back (a circle); `import rlvr.storage.catalog` does not count
    the face, since every module's own package is initialised before it anyway."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (_, path) in found.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = imported_names(tree, name, path.name == "__init__.py")
        edges[name].update(t for t in targets if t in found and t != name)
    return edges


def back_arrows(found: dict[str, tuple[str, Path]], edges: dict[str, set[str]]) -> list[str]:
    arrows = []
    for source, targets in edges.items():
        for target in targets:
            a, b = found[source][0], found[target][0]
            if RANK[b] > RANK[a] or (a != b and RANK[a] == RANK[b]):  # up, or across one layer
                arrows.append(f"{source} ({a}/) imports {target} ({b}/)")
    return sorted(arrows)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_points_up_a_layer():
    found = modules()
    assert back_arrows(found, imports(found)) == []


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(imports(modules())) == []


def test_the_check_finds_a_back_arrow_and_a_circle():
    """The checks can fail: a storage module importing a task, a flow importing the CLI, and two trainer modules
    importing each other."""
    found = {
        "rlvr.storage.a": ("storage", Path("a")),
        "rlvr.tasks.b": ("tasks", Path("b")),
        "rlvr.trainer.c": ("trainer", Path("c")),
        "rlvr.trainer.d": ("trainer", Path("d")),
        "rlvr.verifiers.e": ("verifiers", Path("e")),
        "rlvr.curricula.f": ("curricula", Path("f")),
        "rlvr.flows.g": ("flows", Path("g")),
        "rlvr.flows.cli.h": ("flows/cli", Path("h")),
    }
    edges = {
        "rlvr.storage.a": {"rlvr.tasks.b"},
        "rlvr.trainer.c": {"rlvr.trainer.d"},
        "rlvr.trainer.d": {"rlvr.trainer.c"},
        "rlvr.verifiers.e": {"rlvr.curricula.f"},
        "rlvr.flows.g": {"rlvr.flows.cli.h"},
    }
    assert back_arrows(found, edges) == [
        "rlvr.flows.g (flows/) imports rlvr.flows.cli.h (flows/cli/)",
        "rlvr.storage.a (storage/) imports rlvr.tasks.b (tasks/)",
        "rlvr.verifiers.e (verifiers/) imports rlvr.curricula.f (curricula/)",
    ]
    assert cycles(edges) == [["rlvr.trainer.c", "rlvr.trainer.d"]]


def test_imported_names_reads_faces_relative_imports_and_import_module():
    tree = ast.parse(
        "from rlvr.storage import catalog\n"
        "import rlvr.storage.views as views\n"
        "from . import ids\n"
        "from .manifest import Manifest\n"
        "import importlib\n"
        "def later(name):\n"
        "    importlib.import_module('rlvr.verifiers.registry')\n"
        "    importlib.import_module(name)\n"
    )
    assert imported_names(tree, "rlvr.storage.store", is_package=False) == {
        "rlvr.storage",
        "rlvr.storage.catalog",
        "rlvr.storage.views",
        "rlvr.storage.ids",
        "rlvr.storage.manifest",
        "rlvr.storage.manifest.Manifest",
        "importlib",
        "rlvr.verifiers.registry",
    }
    assert imported_names(ast.parse("from . import store"), "rlvr.storage", is_package=True) == {
        "rlvr.storage",
        "rlvr.storage.store",
    }


def _copy_of_the_package(root: Path) -> None:
    """The package's source (every layer folder's .py files) under `root`, laid out as in the repository."""
    for folder in FOLDERS:
        shutil.copytree(
            REPO / folder,
            root / folder,
            ignore=lambda _, names: [n for n in names if n == "__pycache__" or (n.endswith((".pyc", ".so")))],
        )


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_contract_fails_on_a_copy_given_a_face_cycle_an_import_module_circle_and_an_upward_import(tmp_path):
    """The acceptance of issue 52: each kind of violation the contract once missed, put back into a copy of the
    source, is reported: `from rlvr.storage import catalog` in storage/store.py (a circle through storage's
    `__init__`), verifiers/composite.py importing the registry by `importlib.import_module` while the registry
    imports it, and a storage module importing a trainer module."""
    _copy_of_the_package(tmp_path)
    before = modules(tmp_path)
    arrows_before = back_arrows(before, imports(before))
    cycles_before = cycles(imports(before))

    _append(tmp_path / "storage" / "store.py", "\nfrom rlvr.storage import catalog as _by_the_face\n")
    _append(
        tmp_path / "verifiers" / "composite.py",
        "\n\ndef _registry():\n    import importlib\n\n    return importlib.import_module('rlvr.verifiers.registry')\n",
    )
    _append(tmp_path / "storage" / "ids.py", "\nimport rlvr.trainer\n")
    after = modules(tmp_path)
    edges = imports(after)

    assert sorted(set(back_arrows(after, edges)) - set(arrows_before)) == [
        "rlvr.storage.ids (storage/) imports rlvr.trainer (trainer/)"
    ]
    new_cycles = [cycle for cycle in cycles(edges) if cycle not in cycles_before]
    assert ["rlvr.verifiers.composite", "rlvr.verifiers.registry"] in new_cycles
    assert any({"rlvr.storage", "rlvr.storage.store"} <= set(cycle) for cycle in new_cycles), new_cycles
    assert len(new_cycles) == 2
