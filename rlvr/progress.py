"""Progress of running work, for the CLI's progress bars: flows and stages report; whoever listens draws.

It sits in the package root because flows and stage builds (tasks/) both report, and a task module must not
import the flows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def listen(listener: Listener) -> None:
    _listeners.append(listener)


def stop_listening(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def report(event: str, **fields: Any) -> None:
    """Tell every listener about `event` (e.g. "stage", "step", "eval"); listeners must not raise."""
    for listener in list(_listeners):
        listener(event, fields)
