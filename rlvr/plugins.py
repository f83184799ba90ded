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

from importlib.metadata import entry_points
from typing import Annotated, Any, Generic, TypeVar, Union

from pydantic import BaseModel, Discriminator, Tag

from rlvr.errors import UserError

__all__ = [
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
