"""What the `rlvr` commands share: where the store is, opening it, Prefect's set-up for a command that runs a
flow, and the progress bar over a run's progress events."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from rlvr.errors import Stopped

if TYPE_CHECKING:  # the store's modules load pyarrow and fsspec, rich's progress more: not for `rlvr --help`
    from rich.progress import Progress

    from rlvr.storage.store import Store

T = TypeVar("T")

DEFAULT_STORE = "./rlvr-store"
StoreOption = typer.Option(
    None, "--store", help="store root: a path or fsspec URL (default $RLVR_STORE or ./rlvr-store)"
)


def store_root(store: str | None) -> str:
    """The store named by --store, else $RLVR_STORE, else ./rlvr-store."""
    return store or os.environ.get("RLVR_STORE") or DEFAULT_STORE


def open_existing(store: str | None) -> Store:
    """The store named as `store_root` finds it (one-line errors when it is not a store)."""
    from rlvr.storage.store import open_store

    return open_store(store_root(store))


def flow_store(store: str | None) -> str:
    """The store root of a command that runs a flow, with Prefect set up on the store's database (created when
    the store is new)."""
    from rlvr.flows.prefect_env import configure_prefect
    from rlvr.storage.store import open_store

    root = store_root(store)
    configure_prefect(open_store(root, create=True))
    return root


def with_progress(start: Callable[[], T], bar: Progress, update: Callable[[str, dict[str, Any]], None]) -> T:
    """`start()` under `bar`, shown from the run's first progress event on (a run refused at once shows only its
    one-line error); warnings print above the bar, every other event goes to `update`. Ctrl-C becomes `Stopped`
    (exit 130 at once), which Typer does not catch: it would turn it into an exit that waits for stage threads."""
    from rlvr import progress

    def listener(event: str, fields: dict[str, Any]) -> None:
        if event == "warning":
            bar.console.print(f"warning: {fields['message']}", markup=False, highlight=False)
            return
        if not bar.live.is_started:
            bar.start()
        update(event, fields)

    progress.listen(listener)
    try:
        return start()
    except KeyboardInterrupt as exc:
        raise Stopped("interrupted", 128 + signal.SIGINT) from exc
    finally:
        progress.stop_listening(listener)
        if bar.live.is_started:
            bar.stop()
