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


def modules() -> dict[str, tuple[str, Path]]:
    """Module name -> (its layer's folder, its file), for every .py file of the package."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(["rlvr"] + ([] if folder == "rlvr" else [folder]) + parts)
            found[name] = (layer_of(path), path)
    return found


def layer_of(path: Path) -> str:
    """The most specific layer folder holding `path` (flows/cli/ before flows/)."""
    relative = path.relative_to(REPO).as_posix()
    return max((f for f in RANK if relative.startswith(f + "/")), key=len)


def imports(found: dict[str, tuple[str, Path]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (`from rlvr.x import y` counts rlvr.x, and rlvr.x.y when
    that is a module)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (_, path) in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges[name].update(t for t in targets if t in found and t != name and not name.startswith(t + "."))
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
