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
import os
import sys
from importlib.metadata import entry_points

from rlvr.errors import UserError
from rlvr.verifiers.arithmetic import ArithmeticVerifier, FinalNumberVerifier
from rlvr.verifiers.base import Verifier
from rlvr.verifiers.math import MathVerifier

ENTRY_POINT_GROUP = "rlvr.verifiers"

BUILTIN: dict[str, type[Verifier]] = {
    ArithmeticVerifier.name: ArithmeticVerifier,
    FinalNumberVerifier.name: FinalNumberVerifier,
    MathVerifier.name: MathVerifier,
    "sql": importlib.import_module("rlvr.verifiers.sql").SqlVerifier,
    "tool_call": importlib.import_module("rlvr.verifiers.tool_call").ToolCallVerifier,
    "reasoning_gym": importlib.import_module("rlvr.verifiers.reasoning_gym").ReasoningGymVerifier,
    "format": importlib.import_module("rlvr.verifiers.format").FormatVerifier,
    "text": importlib.import_module("rlvr.verifiers.text").TextVerifier,
    "math_format": importlib.import_module("rlvr.verifiers.composite").MathFormatVerifier,
    "code": importlib.import_module("rlvr.verifiers.code").CodeVerifier,
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


_loaded: tuple[tuple[tuple[str, int | None], ...], tuple[dict[str, type[Verifier]], list[str]]] | None = None


def _path_state() -> tuple[tuple[str, int | None], ...]:
    """Each sys.path entry and its modification time: installing or removing a package changes its folder's."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _load_plugins() -> tuple[dict[str, type[Verifier]], list[str]]:
    """The plugins found on sys.path, and why others were refused; scanned again only when sys.path or one of its
    folders changed (reading every installed distribution's metadata costs milliseconds, and labelling asks per
    step). An install or uninstall adds or removes a dist-info folder, which changes its folder's mtime; an
    entry_points.txt edited in place is not seen, and a plugin module already imported is not re-imported.
    (The type registries in rlvr.plugins scan once per process.)"""
    global _loaded
    state = _path_state()
    if _loaded is None or _loaded[0] != state:
        _loaded = (state, _scan_plugins())
    plugins, errors = _loaded[1]
    return dict(plugins), list(errors)


def _scan_plugins() -> tuple[dict[str, type[Verifier]], list[str]]:
    plugins: dict[str, type[Verifier]] = {}
    errors: list[str] = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        label = f"plugin {entry_point.name!r} ({entry_point.value})"
        if entry_point.name in BUILTIN:
            errors.append(f"{label} ignored: {entry_point.name!r} is a built-in verifier")
            continue
        if entry_point.name in plugins:
            errors.append(f"{label} ignored: another plugin already registered {entry_point.name!r}")
            continue
        try:
            loaded = entry_point.load()
        except Exception as exc:
            errors.append(f"{label} failed to load: {type(exc).__name__}: {exc}")
            continue
        problem = _check_verifier_class(loaded, entry_point.name)
        if problem is not None:
            errors.append(f"{label} rejected: {problem}")
            continue
        plugins[entry_point.name] = loaded
    return plugins, errors


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
