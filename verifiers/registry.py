"""Which verifiers exist: the built-in ones plus third-party ones from the `rlvr.verifiers` entry points.

A plugin package declares, in its pyproject.toml,

    [project.entry-points."rlvr.verifiers"]
    my_domain = "my_package.module:MyVerifier"

where `MyVerifier` subclasses `rlvr.verifiers.base.Verifier` and its `name` equals the entry-point name.
A plugin that fails to load (import error, not a Verifier, name clash) does not break the registry:
it is left out and described by `plugin_errors()`.

Besides registered names, `verifier_class` accepts an import path "package.module:ClassName"; the
pool uses it to run verifiers that are importable but not registered (e.g. test-only verifiers).
"""

from __future__ import annotations

import importlib

from rlvr.errors import UserError
from rlvr.plugins import ClassPlugins
from rlvr.verifiers.arithmetic import ArithmeticVerifier, FinalNumberVerifier
from rlvr.verifiers.base import Verifier
from rlvr.verifiers.code import CodeVerifier
from rlvr.verifiers.composite import MathFormatVerifier
from rlvr.verifiers.format import FormatVerifier
from rlvr.verifiers.judge import JudgeVerifier
from rlvr.verifiers.math import MathVerifier
from rlvr.verifiers.reasoning_gym import ReasoningGymVerifier
from rlvr.verifiers.reward_model import RewardModelVerifier
from rlvr.verifiers.sql import SqlVerifier
from rlvr.verifiers.text import TextVerifier
from rlvr.verifiers.tool_call import ToolCallVerifier

ENTRY_POINT_GROUP = "rlvr.verifiers"

BUILTIN: dict[str, type[Verifier]] = {
    ArithmeticVerifier.name: ArithmeticVerifier,
    FinalNumberVerifier.name: FinalNumberVerifier,
    MathVerifier.name: MathVerifier,
    "sql": SqlVerifier,
    "tool_call": ToolCallVerifier,
    "reasoning_gym": ReasoningGymVerifier,
    "format": FormatVerifier,
    "text": TextVerifier,
    "math_format": MathFormatVerifier,
    "code": CodeVerifier,
    "judge": JudgeVerifier,
    "reward_model": RewardModelVerifier,
}


def _check_verifier_class(obj: object, expected_name: str) -> str | None:
    """Why `obj` cannot be registered under `expected_name`, or None if it can."""
    if not (isinstance(obj, type) and issubclass(obj, Verifier)):
        return f"{obj!r} is not a subclass of rlvr.verifiers.base.Verifier"
    for attribute in ("name", "domain", "version"):
        if not isinstance(getattr(obj, attribute, None), str):
            return f"{obj.__name__}.{attribute} must be a string class attribute"
    if obj.name != expected_name:
        return f"class name attribute {obj.name!r} differs from the entry-point name {expected_name!r}"
    return None


PLUGINS: ClassPlugins[Verifier] = ClassPlugins(ENTRY_POINT_GROUP, "verifier", BUILTIN, _check_verifier_class)


def _load_plugins() -> tuple[dict[str, type[Verifier]], list[str]]:
    return PLUGINS.load()


def registered() -> dict[str, type[Verifier]]:
    """Every usable verifier, name -> class, sorted by name."""
    plugins, _ = _load_plugins()
    everything = {**plugins, **BUILTIN}
    return dict(sorted(everything.items()))


def plugin_errors() -> list[str]:
    """One line per entry point in `rlvr.verifiers` that could not be registered, and why."""
    _, errors = _load_plugins()
    return errors


def _import_path_class(spec: str) -> type[Verifier]:
    module_name, _, class_path = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in class_path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot import verifier {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Verifier)):
        raise UserError(f"{spec!r} is not a subclass of rlvr.verifiers.base.Verifier")
    return obj


def verifier_class(name: str) -> type[Verifier]:
    """The class for a registered name or an import path "package.module:ClassName"."""
    if ":" in name:
        return _import_path_class(name)
    if name in BUILTIN:
        return BUILTIN[name]
    plugins, errors = _load_plugins()
    if name in plugins:
        return plugins[name]
    own_errors = [error for error in errors if error.startswith(f"plugin {name!r} ")]
    if own_errors:
        raise UserError(own_errors[0])
    names = ", ".join(sorted({**plugins, **BUILTIN}))
    raise UserError(f"unknown verifier {name!r}; registered: {names}")


def get_verifier(name: str) -> Verifier:
    """A ready-to-use instance of the verifier called `name` (see `verifier_class`)."""
    return verifier_class(name)()


def verifier_spec(verifier: str | type[Verifier]) -> str:
    """What a worker process needs to load the same verifier: its name or its import path."""
    if isinstance(verifier, type):
        problem = _check_verifier_class(verifier, getattr(verifier, "name", ""))
        if problem is not None:
            raise UserError(problem)
        if verifier.name in BUILTIN and BUILTIN[verifier.name] is verifier:
            return verifier.name
        return f"{verifier.__module__}:{verifier.__qualname__}"
    verifier_class(verifier)
    return verifier
