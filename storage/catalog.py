"""The catalog index: one row per committed artifact (what its manifest says), read without opening every
manifest. `connect()` builds the `artifacts`, `lineage` and `stage_runs` tables and each kind's view from it.

Reading every manifest costs one open per artifact (a GET each on object storage), on every query, and a store
of 500 runs holds some 20,000. Instead, under the store root:

    catalog/log/0000000042.json            entry 42: the manifests one commit wrote (a batch, or one artifact),
                                           or the id one delete removed; appended by the writer
    catalog/snapshots/0000000042.parquet   the catalog as entries 0..41 left it (one row per artifact),
                                           written by a reader that read many entries

The log is numbered like the reward cache's index log (store.py "index logs"): a writer creates the next
number exclusively (a hard link on disk, a conditional PUT on S3), after its manifests are written and before
a delete removes one. A reader lists manifests/ once, reads the newest snapshot and the entries after it, and
keeps a row only while its manifest is listed with the size the row recorded; a listed manifest that no row
covers (a writer killed between its manifest and its entry, a store written before the log, a manifest
rewritten or damaged since) is read directly, as before. So the manifests stay the truth, and the log and the
snapshots are hints: losing them costs time, never a row. A reader that read `SNAPSHOT_AFTER` entries or
manifests writes a snapshot (create-if-absent, best effort) and removes all but the newest `KEEP_SNAPSHOTS`,
and so does the writer of every `COMPACT_EVERY`-th entry (a store written for long and never queried); a
process keeps what it read, so its next read costs the listing and the new entries.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, fields
from typing import Any, Protocol

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rlvr.errors import UserError
from rlvr.storage.errors import ArtifactNotFound, DamagedFile
from rlvr.storage.files import read_whole
from rlvr.storage.ids import canonical_json
from rlvr.storage.manifest import Manifest, basename


class CatalogStore(Protocol):
    """What the catalog uses of a store (storage/store.py's `Store`, which imports this module)."""

    fs: fsspec.AbstractFileSystem
    unreadable: dict[str, str]

    @property
    def is_local(self) -> bool: ...

    def path(self, *parts: str) -> str: ...

    def create_new(self, path: str, data: bytes) -> bool: ...

    def manifest(self, artifact_id: str) -> Manifest: ...

    def manifest_path(self, artifact_id: str) -> str: ...

    def _fetch_manifests(self, artifact_ids: Sequence[str]) -> None: ...


SNAPSHOT_AFTER = 64  # entries read past the snapshot, or manifests read directly, before a reader writes one
COMPACT_EVERY = 256  # the writer of every 256th entry reads the catalog too, so writing a snapshot if due
KEEP_SNAPSHOTS = 3  # a reader still reading an older one finds it; a snapshot it cannot read costs it time only
_READ_AHEAD = 16  # log entries asked for at once on object storage

_ENTRY_NAME = "{:010d}.json"
_SNAPSHOT_SUFFIX = ".parquet"
CATALOG_SCHEMA = pa.schema(
    [
        ("artifact_id", pa.string()),
        ("kind", pa.string()),
        ("run_id", pa.string()),
        ("stage", pa.string()),
        ("step", pa.int64()),
        ("rows", pa.int64()),
        ("created_at", pa.string()),
        ("code_version", pa.string()),
        ("parents", pa.list_(pa.string())),
        ("seconds", pa.float64()),
        ("bytes", pa.int64()),  # of its data and binary files
        ("config", pa.string()),  # JSON, keys sorted: the `artifacts` table shows it as is
        ("extra", pa.string()),  # JSON, keys sorted
        ("files", pa.string()),  # JSON: the manifest's file entries
        ("schema", pa.string()),
        ("other", pa.string()),  # JSON of the manifest's remaining fields
        ("manifest_bytes", pa.int64()),  # the size of its manifest file, compared with the listing
    ]
)
# The manifest's fields with a column of their own; any other field (added later) goes in `other`.
_COLUMNS = frozenset(CATALOG_SCHEMA.names) - {"bytes", "other", "manifest_bytes"}


def _log_dir(store: CatalogStore) -> str:
    return store.path("catalog", "log")


def _snapshot_dir(store: CatalogStore) -> str:
    return store.path("catalog", "snapshots")


def manifest_text(manifest: Manifest) -> str:
    """The manifest file's text, exactly as the store writes it."""
    return manifest.to_json()


# ----- rows ------------------------------------------------------------------------------------------------


def _row(manifest: Manifest, manifest_bytes: int) -> dict[str, Any]:
    data = asdict(manifest)
    return {
        "artifact_id": manifest.artifact_id,
        "kind": manifest.kind,
        "run_id": manifest.run_id,
        "stage": manifest.stage,
        "step": manifest.step,
        "rows": manifest.rows,
        "created_at": manifest.created_at,
        "code_version": manifest.code_version,
        "parents": list(manifest.parents),
        "seconds": manifest.seconds,
        "bytes": sum(int(entry.get("bytes") or 0) for entry in manifest.files),
        "config": json.dumps(manifest.config, sort_keys=True, default=str),
        "extra": json.dumps(manifest.extra, sort_keys=True, default=str),
        "files": json.dumps(manifest.files, sort_keys=True, default=str),
        "schema": manifest.schema,
        "other": canonical_json({key: value for key, value in data.items() if key not in _COLUMNS}),
        "manifest_bytes": manifest_bytes,
    }


def rows_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=CATALOG_SCHEMA)


def manifests_of(table: pa.Table) -> list[Manifest]:
    """The manifests behind catalog rows (for what needs them whole, e.g. the stage_runs table)."""
    known = {f.name for f in fields(Manifest)}
    found = []
    for row in table.to_pylist():
        values: dict[str, Any] = {key: row[key] for key in _COLUMNS if key not in ("config", "extra", "files")}
        values.update(config=json.loads(row["config"]), extra=json.loads(row["extra"]), files=json.loads(row["files"]))
        values.update({key: value for key, value in json.loads(row["other"]).items() if key in known})
        found.append(Manifest(**values))
    return found


def files_of(table: pa.Table) -> list[list[dict[str, Any]]]:
    """Each row's file entries (the manifest's `files`)."""
    return [json.loads(text) for text in table.column("files").to_pylist()]


# ----- writing: the log --------------------------------------------------------------------------------------


class _Positions:
    """Where this process appends next, per store handle: found once (`_log_end`), then counted on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next: weakref.WeakKeyDictionary[CatalogStore, int] = weakref.WeakKeyDictionary()


_positions = _Positions()


def append(store: CatalogStore, added: Sequence[Manifest] = (), removed: Sequence[str] = ()) -> None:
    """Log one commit's manifests (after they are written) or removed ids (before they go). A hint: a store
    that refuses the write never fails the commit, it only leaves the manifests for readers to find by the
    listing."""
    if not added and not removed:
        return
    entry = canonical_json({"added": [manifest_text(m) for m in added], "removed": list(removed)}).encode("utf-8")
    try:
        with _positions.lock:
            position = _positions.next.get(store)
            if position is None:
                position = _log_end(store, _newest_snapshot_position(store))
            while not store.create_new(_entry_path(store, position), entry):
                position = _log_end(store, position + 1)  # others appended: skip past them at once
            _positions.next[store] = position + 1
    except (OSError, ValueError, NotImplementedError):  # the hint is lost, the commit stands (module docstring)
        _positions.next.pop(store, None)  # (a lost lease, `LeaseLost`, goes on up: the writer must stop)
        return
    if (position + 1) % COMPACT_EVERY == 0:
        _compact(store)


def _compact(store: CatalogStore) -> None:
    """A writer's share of the snapshots, every `COMPACT_EVERY` entries: a store written for long and never
    queried does not leave its first query thousands of entries to read. Best effort, like a reader's."""
    try:
        committed(store)
    except UserError:  # a lost lease (or damage) is the writer's business
        raise
    except Exception:  # a hint not written
        return


def _entry_path(store: CatalogStore, position: int) -> str:
    return f"{_log_dir(store)}/{_ENTRY_NAME.format(position)}"


def _log_end(store: CatalogStore, start: int) -> int:
    """The first free position at or after `start`. Entries are numbered without gaps, so whether one exists
    splits the positions in two: a doubling search, then halving, costs about 2 log2(new entries) checks."""
    exists = lambda position: _exists(store, _entry_path(store, position))  # noqa: E731
    if not exists(start):
        return start
    low, step = start, 1  # low exists
    while exists(low + step):
        low, step = low + step, step * 2
    high = low + step  # free
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if exists(middle) else (low, middle)
    return high


def _exists(store: CatalogStore, path: str) -> bool:
    """Whether the file exists, on an object store by a GET of its first byte: s3fs's `exists` answers a
    missing key with a HEAD and then a LIST (is it a folder?), and may answer from a listing it cached."""
    if store.is_local:
        return os.path.exists(path)
    try:
        store.fs.cat_file(path, start=0, end=1)
    except FileNotFoundError:
        return False
    return True


# ----- reading -----------------------------------------------------------------------------------------------


class _Seen:
    """What a process has read of a store's catalog: rows as of log position `position`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_store: weakref.WeakKeyDictionary[CatalogStore, tuple[int, pa.Table]] = weakref.WeakKeyDictionary()


_seen = _Seen()


def committed(store: CatalogStore) -> pa.Table:
    """One row per committed artifact (CATALOG_SCHEMA), oldest first (created_at, then id), as of one listing
    of manifests/. A manifest that cannot be read is skipped and named in `store.unreadable`."""
    listed = _listing(store)
    with _seen.lock:
        seen = _seen.by_store.get(store)
    if seen is None:
        seen = _read_snapshot(store)
    start, base = seen
    changes, end = _read_log(store, start)
    table, read_directly = _reconcile(store, base, changes, listed)
    with _seen.lock:
        _seen.by_store[store] = (end, table)
    if end - start >= SNAPSHOT_AFTER or read_directly >= SNAPSHOT_AFTER:
        _write_snapshot(store, end, table)
    return table


def _listing(store: CatalogStore) -> dict[str, int]:
    """Every manifest in manifests/, artifact id -> file size: one listing (sizes come with it on object stores
    and cost a stat per file on disk)."""
    directory = store.path("manifests")
    listed = {}
    if store.is_local:
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.endswith(".json"):  # not a temp file (`.json.tmp-...`)
                        try:
                            listed[entry.name[: -len(".json")]] = entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:  # removed since the listing
                            continue
        except FileNotFoundError:
            pass
        return listed
    store.fs.invalidate_cache(directory)
    try:
        found = store.fs.ls(directory, detail=True)
    except FileNotFoundError:
        return {}
    for entry in found:
        name = basename(entry["name"])
        if name.endswith(".json") and entry.get("type") == "file":
            listed[name[: -len(".json")]] = int(entry.get("size") or 0)
    return listed


def _newest_snapshot_position(store: CatalogStore) -> int:
    positions = _snapshot_positions(store)
    return positions[-1] if positions else 0


def _snapshot_positions(store: CatalogStore) -> list[int]:
    directory = _snapshot_dir(store)
    store.fs.invalidate_cache(directory)
    try:
        names = [basename(path) for path in store.fs.ls(directory, detail=False)]
    except FileNotFoundError:
        return []
    stems = [name[: -len(_SNAPSHOT_SUFFIX)] for name in names if name.endswith(_SNAPSHOT_SUFFIX)]
    return sorted(int(stem) for stem in stems if stem.isdigit())


def _read_snapshot(store: CatalogStore) -> tuple[int, pa.Table]:
    """The newest snapshot that reads (position, rows); (0, no rows) when there is none."""
    for position in reversed(_snapshot_positions(store)):
        path = f"{_snapshot_dir(store)}/{position:010d}{_SNAPSHOT_SUFFIX}"
        try:
            table = pq.ParquetFile(pa.BufferReader(read_whole(store.fs, path))).read()
            return position, table.select(CATALOG_SCHEMA.names).cast(CATALOG_SCHEMA)
        except (OSError, ValueError, KeyError, pa.ArrowException):  # pruned meanwhile, or torn by a crash
            continue
    return 0, rows_table([])


def _read_log(store: CatalogStore, start: int) -> tuple[list[tuple[list[str], list[str]]], int]:
    """The entries from `start` on, in order, as (manifest texts added, ids removed), and the position after
    them. An entry that does not parse (torn by a crash) counts as empty: its manifests are in the listing."""
    changes: list[tuple[list[str], list[str]]] = []
    position = start
    while True:
        wanted = [_entry_path(store, p) for p in range(position, position + (1 if store.is_local else _READ_AHEAD))]
        if store.is_local:
            got: dict[str, bytes] = {}
            try:
                got[wanted[0]] = read_whole(store.fs, wanted[0])
            except FileNotFoundError:
                pass
        else:
            fetched = store.fs.cat(wanted, on_error="omit", start=0)
            got = {store.fs._strip_protocol(path): data for path, data in fetched.items() if isinstance(data, bytes)}
        for path in wanted:
            if path not in got:
                return changes, position
            try:
                entry = json.loads(got[path])
                changes.append(([str(t) for t in entry.get("added", [])], [str(i) for i in entry.get("removed", [])]))
            except (ValueError, AttributeError, TypeError):
                changes.append(([], []))
            position += 1


def _reconcile(
    store: CatalogStore, base: pa.Table, changes: list[tuple[list[str], list[str]]], listed: dict[str, int]
) -> tuple[pa.Table, int]:
    """The rows of `base` and `changes` whose manifest is listed with the recorded size, plus the listed
    manifests none of them covers, read directly; and how many were read directly."""
    changed: dict[str, dict[str, Any] | None] = {}  # id -> its newest row, or None once removed
    for added, removed in changes:
        for text in added:
            try:
                manifest = Manifest.from_json(text)
            except (ValueError, TypeError):
                continue
            changed[manifest.artifact_id] = _row(manifest, len(text.encode("utf-8")))
        for artifact_id in removed:
            changed[artifact_id] = None
    ids = base.column("artifact_id").to_pylist()
    sizes = base.column("manifest_bytes").to_pylist()
    keep = [i not in changed and listed.get(i) == size for i, size in zip(ids, sizes)]
    kept = base.filter(pa.array(keep, pa.bool_())) if not all(keep) else base
    rows = [row for i, row in changed.items() if row is not None and listed.get(i) == row["manifest_bytes"]]
    covered = {i for i, k in zip(ids, keep) if k} | {row["artifact_id"] for row in rows}
    missing = [i for i in listed if i not in covered]
    rows += _read_directly(store, missing, listed)
    table = pa.concat_tables([kept, rows_table(rows)]) if rows else kept
    if rows or not all(keep):  # the base stays sorted; new rows are mostly newer, so sort only then
        table = table.sort_by([("created_at", "ascending"), ("artifact_id", "ascending")])
    return table, len(missing)


def _read_directly(store: CatalogStore, artifact_ids: list[str], listed: dict[str, int]) -> list[dict[str, Any]]:
    if not artifact_ids:
        return []
    store._fetch_manifests(artifact_ids)  # concurrently, on object storage
    rows = []
    for artifact_id in artifact_ids:
        try:
            manifest = store.manifest(artifact_id)
        except ArtifactNotFound:  # deleted between the listing and the read
            continue
        except DamagedFile as exc:  # one bad manifest must not hide the rest of the store
            store.unreadable[store.manifest_path(artifact_id)] = str(exc)
            continue
        rows.append(_row(manifest, listed[artifact_id]))
    return rows


def _write_snapshot(store: CatalogStore, position: int, table: pa.Table) -> None:
    """Best effort: a store this process cannot write to (read-only credentials), or a race with another
    reader, leaves the snapshots as they are."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    try:
        if not store.create_new(
            f"{_snapshot_dir(store)}/{position:010d}{_SNAPSHOT_SUFFIX}", sink.getvalue().to_pybytes()
        ):
            return
        for old in _snapshot_positions(store)[:-KEEP_SNAPSHOTS]:
            store.fs.rm(f"{_snapshot_dir(store)}/{old:010d}{_SNAPSHOT_SUFFIX}")
    except Exception:  # a hint not written
        return
