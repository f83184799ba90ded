"""Public names keep working (issue 52): every import path docs/ and CONTRIBUTING.md show a user imports, and every
module moved in the 2026-12 layout (rlvr/moved.py `MOVED`) still imports under its old name, with a
DeprecationWarning naming the new one, as the very module object of its new name."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from rlvr.moved import MOVED

REPO = Path(__file__).resolve().parent.parent
# docs/index.md is the README copied by `make docs`, which runs beside the suite (it may be half written)
DOCS = [
    *sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "index.md"),
    REPO / "CONTRIBUTING.md",
    REPO / "README.md",
]

# Dotted names the docs show that are not import paths: entry-point groups (docs/verifiers.md, pyproject.toml) and
# OpenLineage job names (docs/audit.md: the job of stage S is `rlvr.S`).
NOT_PATHS = {
    "rlvr.strategies",
    "rlvr.allocators",
    "rlvr.engines",
    "rlvr.sources",
    "rlvr.label",
    "rlvr.train",
    "rlvr.rl_run",
    "rlvr.data_run",
}
_DOTTED = re.compile(r"(?<![\w.])rlvr(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from\s+(rlvr(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]*)", re.MULTILINE)


def paths_in(text: str) -> set[str]:
    """The import paths `text` shows: each dotted `rlvr.x.y` name, and `module.name` for each name of a
    `from rlvr.x import a, b as c` line (parenthesized over lines too)."""
    found = {m.group(0) for m in _DOTTED.finditer(text)}
    for module, names in _FROM.findall(text):
        for name in names.strip("()").split(","):
            name = name.split(" as ")[0].strip()
            if name.isidentifier():
                found.add(f"{module}.{name}")
    return found - NOT_PATHS


def resolve(path: str) -> str | None:
    """None when `path` imports as a module or as a module's attribute (an old path through its alias counts),
    else why it does not, in one line."""
    parts = path.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # an old path's warning: the next test's business
        for cut in range(len(parts), 0, -1):
            name = ".".join(parts[:cut])
            try:
                found: object = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and name.startswith(exc.name):
                    continue  # no module of this name: an attribute, perhaps, of a shorter one
                return f"importing {name} failed: {exc}"
            for attribute in parts[cut:]:
                if not hasattr(found, attribute):
                    return f"{name} has no {'.'.join(parts[cut:])}"
                found = getattr(found, attribute)
            return None
    return "no such module"


def broken(text: str) -> list[str]:
    """`path: why` for each path `text` shows that does not import, sorted."""
    return sorted(f"{path}: {why}" for path in paths_in(text) if (why := resolve(path)) is not None)


def test_every_import_path_the_docs_show_imports():
    shown = {doc.relative_to(REPO).as_posix(): broken(doc.read_text()) for doc in DOCS}
    assert {doc: paths for doc, paths in shown.items() if paths} == {}
    assert len(set().union(*(paths_in(doc.read_text()) for doc in DOCS))) >= 30  # the collector finds them


def test_a_doc_line_naming_a_removed_or_moved_out_name_is_caught():
    text = (
        "from rlvr.flows.runner import run_flow\n"  # renamed without an alias by an earlier issue
        "Tools: `rlvr.trainer.multi_turn.tools_system_message`.\n"  # an old path (aliased) of a name since removed
        "from rlvr.environments.base import (\n    Environment,\n    Opening as Start,\n)\n"
        "Groups: `rlvr.strategies`; the registry `rlvr.environments.registry.plugin_errors()`.\n"
    )
    assert paths_in(text) == {
        "rlvr.flows.runner",
        "rlvr.flows.runner.run_flow",
        "rlvr.trainer.multi_turn.tools_system_message",
        "rlvr.environments.base",
        "rlvr.environments.base.Environment",
        "rlvr.environments.base.Opening",
        "rlvr.environments.registry.plugin_errors",
    }
    assert broken(text) == [
        "rlvr.flows.runner.run_flow: rlvr.flows has no runner.run_flow",  # rlvr.flows: the longest module prefix
        "rlvr.flows.runner: rlvr.flows has no runner",
        "rlvr.trainer.multi_turn.tools_system_message: rlvr.trainer.multi_turn has no tools_system_message",
    ]


def _old_file(old: str) -> Path:
    """Where module `old` would sit in the repository (pyproject.toml's package-dir maps rlvr.x to x/)."""
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = max((name for name in folders if old.startswith(name + ".")), key=len)
    return REPO / folders[package] / (old.removeprefix(package + ".").replace(".", "/") + ".py")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_under_its_old_name_with_a_warning_as_the_same_module(old, monkeypatch):
    new = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported before by another test: import it afresh
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)}; import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new) and module.__name__ == new
    assert not _old_file(old).exists()  # nothing left behind: the import contract sees the new layout only


ENVIRONMENT_MOVES = {
    "rlvr.verifiers.environment": "rlvr.environments.base",
    "rlvr.verifiers.env_registry": "rlvr.environments.registry",
    "rlvr.verifiers.calculator_env": "rlvr.environments.calculator",
    "rlvr.verifiers.retry_env": "rlvr.environments.retry",
    "rlvr.verifiers.tool_use": "rlvr.environments.tools",
    "rlvr.verifiers.gym_adapter": "rlvr.environments.gym_adapter",
    "rlvr.verifiers.textarena_adapter": "rlvr.environments.textarena_adapter",
    "rlvr.verifiers.env_isolation": "rlvr.environments.isolation",
    "rlvr.trainer.multi_turn": "rlvr.trainer.episodes",
}


def test_the_environment_and_episode_modules_keep_their_old_names():
    assert {old: MOVED.get(old) for old in ENVIRONMENT_MOVES} == ENVIRONMENT_MOVES
