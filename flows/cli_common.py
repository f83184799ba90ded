"""What every `rlvr` command shares: where the store is, and opening it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # the store's modules load pyarrow and fsspec: not for `rlvr --help`
    from rlvr.storage.store import Store

DEFAULT_STORE = "./rlvr-store"
StoreOption = typer.Option(
    None, "--store", help="store root: a path or fsspec URL (default $RLVR_STORE or ./rlvr-store)"
)


def store_root(store: str | None) -> str:
    """The store named by --store, else $RLVR_STORE, else ./rlvr-store."""
    return store or os.environ.get("RLVR_STORE") or DEFAULT_STORE


def open_existing(store: str | None) -> Store:
    """The store named as `store_root` finds it (one-line errors when it is not a store)."""
    from rlvr.storage.store import Store

    return Store.open(store_root(store))
