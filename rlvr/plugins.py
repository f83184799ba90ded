"""Extension points chosen by a config's `type`: selection strategies, budget allocators, rollout
engines and problem sources all register here the same way.

An implementation is a pair: a pydantic config class with a field `type: Literal["name"] = "name"`
and the class that does the work (whose `type` class attribute is the same name). The config section
that chooses among them is a discriminated union over the configs registered when the run config is
loaded, so `--set select.type=sec` picks SEC and validates SEC's own fields.

Installed packages add implementations through entry points: a module listed under the registry's
group (`rlvr.strategies`, `rlvr.allocators`, `rlvr.engines`, `rlvr.sources`) is imported the first
time the registry is used, and registers its pair there. A plugin that fails to import is left out
and described by `plugin_errors`, so one broken package cannot break every run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Annotated, Any, Generic, TypeVar, Union

from pydantic import BaseModel, Discriminator, Tag

from rlvr.errors import UserError

__all__ = [
    "ClassPlugins",
    "TypedRegistry",
    "generation",
]

Impl = TypeVar("Impl")

_generation = 0  # bumped by every registration, so a cached run-config model knows it is stale


def generation() -> int:
    """How many registrations have happened in this process (any registry)."""
    return _generation


class TypedRegistry(Generic[Impl]):
    """Implementations of one extension point, by name; the first one registered is the default,
    chosen when a config section gives no `type`."""

    def __init__(self, what: str, config_base: type[BaseModel], impl_base: type[Any], group: str) -> None:
        self.what = what
        self.config_base = config_base
        self.impl_base = impl_base
        self.group = group
        self._entries: dict[str, tuple[type[BaseModel], type[Impl]]] = {}
        self.default: str | None = None
        self.plugin_errors: list[str] = []
        self._plugins_loaded = False

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for entry_point in entry_points(group=self.group):
            try:
                entry_point.load()
            except Exception as exc:  # a broken plugin is reported, never a crash of every run
                self.plugin_errors.append(
                    f"plugin {entry_point.name!r} ({entry_point.value}) failed to load: {type(exc).__name__}: {exc}"
                )

    def register(self, config: type[BaseModel], impl: type[Impl]) -> None:
        """Make `type = config's type` choose `impl` (registering a name again replaces it)."""
        global _generation
        if not issubclass(config, self.config_base):
            raise TypeError(f"{config.__name__} must subclass {self.config_base.__name__}")
        if not issubclass(impl, self.impl_base):
            raise TypeError(f"{impl.__name__} must subclass {self.impl_base.__name__}")
        field = config.model_fields.get("type")
        name = field.default if field is not None else None
        if not isinstance(name, str) or not name:
            raise TypeError(f"{config.__name__} needs a field `type: Literal['name'] = 'name'`")
        if getattr(impl, "type", None) != name:
            raise TypeError(f"{impl.__name__}.type must be {name!r}, as its config's `type`")
        self._entries[name] = (config, impl)
        self.default = self.default or name
        _generation += 1

    def unregister(self, name: str) -> None:
        """Forget `name` (tests that register a toy implementation clean up with this)."""
        global _generation
        self._entries.pop(name, None)
        if self.default == name:
            self.default = next(iter(self._entries), None)
        _generation += 1

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def config_type(self) -> Any:
        """The type of the section that chooses among the registered implementations: a union keyed by
        `type` (errors then name the key the user wrote, e.g. `select.alpha`)."""
        self._load_plugins()
        members = tuple(Annotated[config, Tag(name)] for name, (config, _) in self._entries.items())
        return Annotated[Union[members], Discriminator(self._tag)]  # noqa: UP007 - built at run time

    def default_config(self) -> BaseModel:
        """The default implementation's config with its defaults."""
        if self.default is None:
            raise UserError(f"no {self.what} is registered")
        return self._entries[self.default][0]()

    def _tag(self, value: Any) -> str | None:
        if isinstance(value, dict):
            return value.get("type", self.default)
        return getattr(value, "type", None)

    def implementation(self, cfg: BaseModel) -> type[Impl]:
        self._load_plugins()
        name = getattr(cfg, "type", None)
        if name not in self._entries:
            raise UserError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name][1]

    def make(self, cfg: BaseModel) -> Impl:
        """A new implementation object for `cfg`."""
        return self.implementation(cfg)(cfg)  # type: ignore[call-arg]


PathState = tuple[tuple[str, int | None], ...]


def sys_path_state() -> PathState:
    """Each sys.path entry and its modification time: installing or removing a package changes its folder's."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


class ClassPlugins(Generic[Impl]):
    """Classes registered by name under an entry-point group (verifiers, environments), each checked, and one
    line per entry point refused (broken, not the right kind of class, a clashing name): one broken package
    never breaks every run. Scanned again only when sys.path or one of its folders changed (reading every
    installed distribution's metadata costs milliseconds, and labelling asks per step): an install or uninstall
    adds or removes a dist-info folder, which changes its folder's mtime; an entry_points.txt edited in place is
    not seen, and a plugin module already imported is not re-imported."""

    def __init__(
        self, group: str, what: str, builtin: Mapping[str, type[Impl]], check: Callable[[object, str], str | None]
    ) -> None:
        self.group, self.what, self.builtin, self.check = group, what, builtin, check
        self.cached: tuple[PathState, tuple[dict[str, type[Impl]], list[str]]] | None = None

    def load(self) -> tuple[dict[str, type[Impl]], list[str]]:
        """The plugins (a copy) and the refusals, from the cache while sys.path is unchanged."""
        state = sys_path_state()
        if self.cached is None or self.cached[0] != state:
            self.cached = (state, self.scan())
        plugins, errors = self.cached[1]
        return dict(plugins), list(errors)

    def scan(self) -> tuple[dict[str, type[Impl]], list[str]]:
        plugins: dict[str, type[Impl]] = {}
        errors: list[str] = []
        for entry_point in entry_points(group=self.group):
            label = f"plugin {entry_point.name!r} ({entry_point.value})"
            if entry_point.name in self.builtin:
                errors.append(f"{label} ignored: {entry_point.name!r} is a built-in {self.what}")
                continue
            if entry_point.name in plugins:
                errors.append(f"{label} ignored: another plugin already registered {entry_point.name!r}")
                continue
            try:
                loaded = entry_point.load()
            except Exception as exc:  # a broken plugin is reported, never a crash of every run
                errors.append(f"{label} failed to load: {type(exc).__name__}: {exc}")
                continue
            problem = self.check(loaded, entry_point.name)
            if problem is not None:
                errors.append(f"{label} rejected: {problem}")
                continue
            plugins[entry_point.name] = loaded
        return plugins, errors
