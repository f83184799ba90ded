"""Embedded Prefect: nothing to start by hand, nothing written to the home directory.

Prefect reads its settings when it is imported, so `configure_prefect` must run before any module
that imports prefect. With no PREFECT_API_URL, Prefect starts a temporary local server on SQLite
in-process; its home (database, results) lives inside the store, or in a temp dir when the store
is not on the local disk. A PREFECT_API_URL already set (a real server) is left alone.
"""

from __future__ import annotations

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
        home = Path(tempfile.gettempdir()) / "rlvr-prefect"
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
