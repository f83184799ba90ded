"""Which environments exist, and how a run's `env` config becomes one environment per episode.

Built in: `one_turn` (a verifier as an environment; the default), `calculator` (verifiers/calculator_env.py),
`gym` (gym-style `reset`/`step` text environments: GEM and others, verifiers/gym_adapter.py) and `textarena`
(verifiers/textarena_adapter.py). A plugin package adds its own in its pyproject.toml,

    [project.entry-points."rlvr.environments"]
    my_env = "my_package.module:MyEnvironment"

where `MyEnvironment` subclasses `rlvr.verifiers.environment.Environment` and its `name` equals the entry-point
name. As with verifier plugins (verifiers/registry.py), one that fails to load (import error, not an Environment,
a name that differs or clashes) is left out and described by `plugin_errors()`; a name may also be an import path
"package.module:ClassName". `environment_factory` is what the rollout stage calls.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from rlvr.errors import UserError
from rlvr.verifiers.calculator_env import CalculatorEnvironment
from rlvr.verifiers.environment import EnvConfig, Environment, OneTurn
from rlvr.verifiers.gym_adapter import GymEnvironment
from rlvr.verifiers.retry_env import RetryEnvironment
from rlvr.verifiers.textarena_adapter import TextArenaEnvironment

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "EnvConfig",
    "environment_class",
    "environment_factory",
    "plugin_errors",
    "registered",
]

ENTRY_POINT_GROUP = "rlvr.environments"

BUILTIN: dict[str, type[Environment]] = {
    cls.name: cls for cls in (OneTurn, CalculatorEnvironment, RetryEnvironment, GymEnvironment, TextArenaEnvironment)
}


def _check_environment_class(obj: object, expected_name: str | None) -> str | None:
    """Why `obj` cannot be an environment called `expected_name` (None: any name), or None if it can."""
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        return f"{obj!r} is not a subclass of rlvr.verifiers.environment.Environment"
    for attribute in ("name", "version"):
        if not isinstance(getattr(obj, attribute, None), str):
            return f"{obj.__name__}.{attribute} must be a string class attribute"
    if expected_name is not None and obj.name != expected_name:
        return f"class name attribute {obj.name!r} differs from the entry-point name {expected_name!r}"
    if getattr(obj, "__abstractmethods__", None):
        return f"{obj.__name__} does not implement {', '.join(sorted(obj.__abstractmethods__))}"
    return None


_loaded: tuple[tuple[tuple[str, int | None], ...], tuple[dict[str, type[Environment]], list[str]]] | None = None


def _sys_path_state() -> tuple[tuple[str, int | None], ...]:
    """sys.path and each entry's mtime: an install or uninstall into a folder changes the folder's mtime."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _plugins() -> tuple[dict[str, type[Environment]], list[str]]:
    """The plugins and the refusals, scanned again only when sys.path or one of its folders changed."""
    global _loaded
    state = _sys_path_state()
    if _loaded is None or _loaded[0] != state:
        _loaded = (state, _scan())
    plugins, errors = _loaded[1]
    return dict(plugins), list(errors)


def _scan() -> tuple[dict[str, type[Environment]], list[str]]:
    plugins: dict[str, type[Environment]] = {}
    errors: list[str] = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        label = f"plugin {entry_point.name!r} ({entry_point.value})"
        if entry_point.name in BUILTIN:
            errors.append(f"{label} ignored: {entry_point.name!r} is a built-in environment")
            continue
        if entry_point.name in plugins:
            errors.append(f"{label} ignored: another plugin already registered {entry_point.name!r}")
            continue
        try:
            loaded = entry_point.load()
        except Exception as exc:  # a broken plugin is reported, never a crash of every run
            errors.append(f"{label} failed to load: {type(exc).__name__}: {exc}")
            continue
        problem = _check_environment_class(loaded, entry_point.name)
        if problem is not None:
            errors.append(f"{label} rejected: {problem}")
            continue
        plugins[entry_point.name] = loaded
    return plugins, errors


def registered() -> dict[str, type[Environment]]:
    """Every usable environment, name -> class, sorted by name."""
    plugins, _ = _plugins()
    return dict(sorted({**plugins, **BUILTIN}.items()))


def plugin_errors() -> list[str]:
    """One line per entry point in `rlvr.environments` that could not be registered, and why."""
    return _plugins()[1]


def _import_path_class(spec: str) -> type[Environment]:
    module_name, _, class_path = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in class_path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(f"cannot import environment {spec!r}: {type(exc).__name__}: {exc}") from exc
    problem = _check_environment_class(obj, None)
    if problem is not None:
        raise UserError(f"environment {spec!r}: {problem}")
    assert isinstance(obj, type) and issubclass(obj, Environment)  # checked just above
    return obj


def environment_class(name: str) -> type[Environment]:
    """The class for a registered name or an import path "package.module:ClassName"."""
    if ":" in name:
        return _import_path_class(name)
    if name in BUILTIN:
        return BUILTIN[name]
    plugins, errors = _plugins()
    if name in plugins:
        return plugins[name]
    own = [error for error in errors if error.startswith(f"plugin {name!r} ")]
    if own:
        raise UserError(own[0])
    raise UserError(f"unknown environment {name!r}; registered: {', '.join(sorted({**plugins, **BUILTIN}))}")


def environment_factory(config: EnvConfig | Mapping[str, Any]) -> Callable[[], Environment]:
    """What makes one fresh environment per episode for `config` (an EnvConfig or its dict). The type and its
    options are checked here, once: an unknown type or a bad option is a one-line UserError."""
    if not isinstance(config, EnvConfig):
        try:
            config = EnvConfig.model_validate(dict(config))
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise UserError(f"env.{where}: {problem['msg']}") from exc
    return environment_class(config.type).factory(config)


def environment_label(config: EnvConfig | Mapping[str, Any]) -> str:
    """ "name@version" of the configured environment: the rollouts' `env` and the rewards' verifier when it gives
    the reward; part of the rollout stage's identity, so a new version samples again."""
    made = environment_factory(config)()
    try:
        return f"{made.name}@{made.version}"
    finally:
        made.close()
