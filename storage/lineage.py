"""Lineage walks over the manifests' parent edges: from any artifact or row, what it came from and what came of it."""

from __future__ import annotations

from collections import deque

from rlvr.storage.errors import ArtifactNotFound, DamagedFile
from rlvr.storage.manifest import Manifest
from rlvr.storage.store import Store
from rlvr.storage.views import data_paths, duckdb_connection, parquet_scan

# Where a row id may live, searched in this order: a rollout id names its rollouts artifact
# before the rewards that copy it.
ROW_ID_COLUMNS: tuple[tuple[str, str], ...] = (
    ("problems", "problem_id"),
    ("rollouts", "rollout_id"),
    ("rewards", "rollout_id"),
)
_FILE_COLUMN = "_rlvr_source_file"


def ancestors(store: Store, artifact_id: str) -> list[Manifest]:
    """Every committed artifact reachable through parents, breadth-first, each once, start excluded.

    A parent that was deleted is skipped: it no longer exists to be audited.
    """
    start = store.manifest(artifact_id)
    seen = {artifact_id}
    found: list[Manifest] = []
    queue = deque(start.parents)
    while queue:
        current = queue.popleft()
        if current in seen:
            continue
        seen.add(current)
        try:
            manifest = store.manifest(current)
        except ArtifactNotFound:
            continue
        except DamagedFile as exc:  # shown as a warning; the rest of the lineage is still walked
            store.unreadable[store.manifest_path(current)] = str(exc)
            continue
        found.append(manifest)
        queue.extend(manifest.parents)
    return found


def descendants(store: Store, artifact_id: str) -> list[Manifest]:
    """Every committed artifact that has `artifact_id` as an ancestor, breadth-first, each once."""
    store.manifest(artifact_id)  # a one-line ArtifactNotFound for an unknown id
    children: dict[str, list[Manifest]] = {}
    for manifest in store.manifests():
        for parent in dict.fromkeys(manifest.parents):
            children.setdefault(parent, []).append(manifest)
    seen = {artifact_id}
    found: list[Manifest] = []
    queue = deque([artifact_id])
    while queue:
        for child in children.get(queue.popleft(), []):
            if child.artifact_id not in seen:
                seen.add(child.artifact_id)
                found.append(child)
                queue.append(child.artifact_id)
    return found


def _artifact_holding_row(store: Store, kind: str, column: str, row_id: str) -> str | None:
    """The oldest committed artifact of `kind` with a row whose `column` equals `row_id`."""
    manifests = store.manifests(kind=kind)
    owner = {path: m.artifact_id for m in manifests for path in data_paths(store, m)}
    if not owner:
        return None
    con = duckdb_connection(store)
    try:
        scan = parquet_scan(owner, extra_options=f", filename = '{_FILE_COLUMN}'")
        hits = con.execute(f'SELECT DISTINCT {_FILE_COLUMN} FROM {scan} WHERE "{column}" = ?', [row_id]).fetchall()
    finally:
        con.close()
    holding = {owner[path] for (path,) in hits if path in owner}
    return next((m.artifact_id for m in manifests if m.artifact_id in holding), None)


def resolve_id(store: Store, some_id: str) -> str:
    """An artifact id as is; a row id (problem_id, rollout_id) as the id of the artifact holding it."""
    if store.exists(some_id):
        return some_id
    for kind, column in ROW_ID_COLUMNS:
        found = _artifact_holding_row(store, kind, column, some_id)
        if found is not None:
            return found
    raise ArtifactNotFound(f"no artifact or row with id {some_id} in store {store.root}")
