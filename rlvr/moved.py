"""Old import paths of moved modules, kept working for one release (docs/architecture.md, "The move of 2026-12").

`MOVED` maps a module's old name to its new one. `install` puts a finder on `sys.meta_path`: importing an old
name warns once (`DeprecationWarning`, naming the new path) and gives the new module itself, so classes and
functions are the same objects under both names (an `isinstance` check or a pickled path keeps working). No
module file is left at an old path, so the import contract sees only the new layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "rlvr.trainer.reward_server": "rlvr.serving.server",
    "rlvr.trainer.reward_models": "rlvr.serving.reward_models",
    "rlvr.tasks.rlpr_debias": "rlvr.tasks.rlpr",
    "rlvr.trainer.rank_group": "rlvr.trainer.ranks.launch",
    "rlvr.verifiers.environment": "rlvr.environments.base",
    "rlvr.verifiers.env_registry": "rlvr.environments.registry",
    "rlvr.verifiers.calculator_env": "rlvr.environments.calculator",
    "rlvr.verifiers.retry_env": "rlvr.environments.retry",
    "rlvr.verifiers.tool_use": "rlvr.environments.tools",
    "rlvr.verifiers.gym_adapter": "rlvr.environments.gym_adapter",
    "rlvr.verifiers.textarena_adapter": "rlvr.environments.textarena_adapter",
    "rlvr.verifiers.env_isolation": "rlvr.environments.isolation",
    "rlvr.trainer.multi_turn": "rlvr.trainer.episodes",  # ChatRendering: chat_tokens.py; decoding: turn_decoding.py
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """The new module was executed by its own import."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new_name))


def install() -> None:
    """Put the finder on `sys.meta_path` once (rlvr/__init__.py calls it)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
