"""The artifact store: Parquet artifacts with an atomic commit protocol, the catalog, lineage and DuckDB views,
and the stage runner (stage.py), which reads a stage's inputs and commits its outputs through a `Store`.

Stages meet only here, and every question about a run is a query over `connect(store)`.
"""

from rlvr.storage.ids import artifact_id, derive_seed, row_id
from rlvr.storage.lineage import ancestors, descendants, resolve_id
from rlvr.storage.manifest import Manifest
from rlvr.storage.run_records import run_status
from rlvr.storage.store import Store, open_store
from rlvr.storage.views import connect, query

__all__ = [
    "Manifest",
    "Store",
    "ancestors",
    "artifact_id",
    "connect",
    "derive_seed",
    "descendants",
    "open_store",
    "query",
    "resolve_id",
    "row_id",
    "run_status",
]
