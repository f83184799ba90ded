"""Embedded Prefect: nothing to start by hand, nothing written to the home directory.

Prefect reads its settings when it is imported, so `configure_prefect` must run before any module
that imports prefect. With no PREFECT_API_URL, Prefect starts a temporary local server on SQLite
in-process; its home (database, results) lives inside the store, or in a temp dir of its own when the
store is not on the local disk (s3://...). A PREFECT_API_URL already set (a real server) is left alone.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

from rlvr.storage.store import Store


def configure_prefect(store: Store) -> Path:
    """Point Prefect's and Hugging Face's homes inside the store (or a temp dir); return Prefect's home.

    Prefect creates its home when it is imported, so a local store's folder is made here.
    """
    if store.local_root is not None:
        home = Path(store.local_root) / "_prefect"
    else:
        home = remote_store_home(store.root) / "_prefect"
    home.mkdir(parents=True, exist_ok=True)
    if "prefect" in sys.modules and os.environ.get("PREFECT_HOME") not in (None, str(home)):
        return Path(os.environ["PREFECT_HOME"])  # already configured (tests, a host application)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(home / "results"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("HF_HOME", str(home.parent / "_hf"))
    return home


def remote_store_home(root: str) -> Path:
    """A local folder for what a store on object storage cannot hold (Prefect's SQLite database, HF's
    cache): one per store and user, as `<store>/_prefect` is for a local store, so two runs on two
    buckets never share a database and two users never share a folder."""
    digest = hashlib.sha256(root.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"rlvr-{os.getuid()}" / digest
