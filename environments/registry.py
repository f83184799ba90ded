"""Which environments exist, and how a run's `env` config becomes one environment per episode.

Built in: `one_turn` (a verifier as an environment; the default), `calculator` (environments/calculator.py),
`gym` (gym-style `reset`/`step` text environments: GEM and others, environments/gym_adapter.py) and `textarena`
(environments/textarena_adapter.py). A plugin package adds its own in its pyproject.toml,

    [project.entry-points."rlvr.environments"]
    my_env = "my_package.module:MyEnvironment"

where `MyEnvironment` subclasses `rlvr.environments.base.Environment` and its `name` equals the entry-point
name. As with verifier plugins (verifiers/registry.py), one that fails to load (import error, not an Environment,
a name that differs or clashes) is left out and described by `plugin_errors()`; a name may also be an import path
"package.module:ClassName". `environment_factory` is what the rollout stage calls; `check_environment` is what a run
calls before any work, so that a key its environment would ignore is refused in one line rather than dropped.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from rlvr.environments.base import LOOP_KEYS, TOOL_KEYS, EnvConfig, Environment, OneTurn
from rlvr.environments.calculator import CalculatorEnvironment
from rlvr.environments.gym_adapter import GymEnvironment
from rlvr.environments.retry import RetryEnvironment
from rlvr.environments.textarena_adapter import TextArenaEnvironment
from rlvr.errors import UserError
from rlvr.plugins import ClassPlugins

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "EnvConfig",
    "check_environment",
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
        return f"{obj!r} is not a subclass of rlvr.environments.base.Environment"
    for attribute in ("name", "version"):
        if not isinstance(getattr(obj, attribute, None), str):
            return f"{obj.__name__}.{attribute} must be a string class attribute"
    if expected_name is not None and obj.name != expected_name:
        return f"class name attribute {obj.name!r} differs from the entry-point name {expected_name!r}"
    if getattr(obj, "__abstractmethods__", None):
        return f"{obj.__name__} does not implement {', '.join(sorted(obj.__abstractmethods__))}"
    return None


PLUGINS: ClassPlugins[Environment] = ClassPlugins(ENTRY_POINT_GROUP, "environment", BUILTIN, _check_environment_class)


def _plugins() -> tuple[dict[str, type[Environment]], list[str]]:
    return PLUGINS.load()


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


_WHY_IGNORED = {  # why a type that does not name a key in `env_keys` ignores it
    "verifier": "it scores its own episodes",
    "step_timeout_s": "only wrapped environments (gym, textarena) run their steps under a limit",
    "isolation": "only wrapped environments (gym, textarena) run in a thread or a process of their own",
    "solved_at": "every reward it gives comes with its verifier's verdict",
    **{key: "it runs no tools" for key in TOOL_KEYS},
}


_DEFAULTS = EnvConfig().model_dump()


def check_environment(config: EnvConfig) -> None:
    """Refuse, before any work, an `env` section that sets a key its type would ignore, then build the type's factory
    once, which checks its options, imports its package, and refuses a verifier that asks a model or a reward with
    no rule for `solved_at`. Each refusal is one UserError line naming the key. "Sets" is what the user set
    (`model_fields_set`) to a value other than the default, since a stored run's dump sets every key. With
    `env.type=one_turn` (the default) the rollouts are one completion a prompt, which the label stage scores, so
    every other env key is refused."""
    cls = environment_class(config.type)
    chosen = sorted(key for key in config.model_fields_set - {"type"} if getattr(config, key) != _DEFAULTS[key])
    if not config.multi_turn:
        for key in chosen:
            if key == "verifier":
                raise UserError(
                    "env.verifier does nothing with env.type=one_turn (the default): the label stage scores one-turn "
                    "rollouts, so set label.verifier, or an env.type that plays episodes (calculator, retry)"
                )
            raise UserError(
                f"env.{key} does nothing with env.type=one_turn (the default: one completion a prompt, scored by the "
                "label stage); leave it out, or set an env.type that plays episodes (calculator, retry, gym, textarena)"
            )
    for key in chosen:
        if key not in LOOP_KEYS and key not in cls.env_keys:
            why = _WHY_IGNORED.get(key, f"it takes {', '.join(sorted(cls.env_keys | LOOP_KEYS))}")
            raise UserError(f"env.{key} does nothing with env.type={config.type}: {why}; leave it out")
    environment_factory(config)
