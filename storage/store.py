"""The artifact store: a directory (local or any fsspec URL) of immutable Parquet artifacts and run records.

The commit protocol is what makes resume safe: data files are written first, and an artifact exists
only once its manifest has been written, last and atomically. Sharded artifacts commit each shard with
its own marker, so a crash loses at most the shard in flight. Layout under the root:

    STORE                                              {"format": 1}: a store exists here
    manifests/<artifact_id>.json                       commit marker + catalog row
    artifacts/<kind>/<artifact_id>/part-00000.parquet  data (one or more parts)
    artifacts/<kind>/<artifact_id>/_shards/part-00003.json   shard commit marker (sharded writes)
    artifacts/<kind>/<artifact_id>/files/<name>        binary files (model weights, ...)
    artifacts/<kind>/<artifact_id>/_owner.json         the run writing it (local stores; sharded writes on others)
    runs/<run_id>.json                                 run record (mutable, replaced atomically)
    leases/<run_id>/000003.json                        which process owns the run (storage/leases.py)
    indexes/<kind>/0000000042.json                     append-only log of the kind's commits (INDEXED_KINDS)
    catalog/log/0000000042.json                        append-only log of every commit's manifests and every delete
    catalog/snapshots/0000000042.parquet               the catalog as the log's first 42 entries left it
                                                       (storage/catalog.py: what queries read, not every manifest)

On an object store (s3://...) each object is written by one PUT, which is atomic, so there is no temp
file and no rename; the manifest is still PUT last. Reads never trust a listing this process cached:
another process may have committed since.

Integrity: every read of an artifact's data (`read_table`, `read_file`) checks the bytes against the
size and sha256 its manifest recorded, and a mismatch is a `DamagedArtifact` naming the file;
`verify_artifact` checks a whole artifact (`rlvr check`, and `rlvr resume` before it decides what is
committed). DuckDB queries read the parts directly, unchecked.

Temp files are named `<target>.tmp-<host tag>-<pid>-<random>`, so a cleanup can tell a dead writer's
leftovers from a live one's; only the owner of a run removes its uncommitted artifact folders (`cleanup_run`).

Fencing: while a process owns a run, its lease is held here (`hold`, from storage/leases.py's `owning`). Each
commit of the run's manifests (one batch, or one artifact outside a batch), each shard marker and each run
record write first checks with one listing that the lease is still the run's newest; every other file of the
run checks the lease in memory just before its rename or PUT. A lost lease raises `LeaseLost`; manifests and
the run record carry the `lease` number they were written under.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import rlvr.storage.catalog as catalog
from rlvr.errors import UserError
from rlvr.storage.errors import ArtifactNotFound, DamagedArtifact, DamagedFile, StoreNotFound
from rlvr.storage.files import (
    damage_message,
    file_damage,
    file_problem,
    parquet_problem,
    reaching,
    read_whole,
)
from rlvr.storage.ids import canonical_json
from rlvr.storage.manifest import Manifest, conform_to_schema, utc_now
from rlvr.storage.schemas import schema_for
from rlvr.storage.shard_writer import ArtifactWriter
from rlvr.storage.store_files import INDEXED_KINDS, NAME_RE, Batch, StoreFiles, check_kind, check_name

STORE_FORMAT = 1


class Store(StoreFiles):
    """A store rooted at a local path or any fsspec URL; every method works the same on both. Its layout, the
    fencing, the low-level writes, the index logs, run records and what killed writers left are `StoreFiles`'
    (storage/store_files.py); artifacts' commits and reads are here."""

    check_reads = True  # reads compare bytes with the manifest; benchmarks/integrity_cost.py turns it off to compare

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._manifest_cache: dict[str, Manifest] = {}
        self._unwritten: dict[str, _Unwritten] = {}  # deferred writes of background batches, by artifact id
        self._pending: list[tuple[Batch, Future[None]]] = []  # batches committing in the background
        self._pending_lock = threading.Lock()  # steps on two threads (flow.async_level) submit and reap alike
        self._committer: ThreadPoolExecutor | None = None

    @classmethod
    def open(cls, root: str, create: bool = False) -> Store:
        """A new handle on an existing store; only `create=True` makes a new one, so a typo never starts an
        empty store. The pipeline itself uses `open_store` (one handle per process); a second handle is
        what another process would see (tests, tools)."""
        try:
            store = cls(root)
        except (ImportError, ValueError) as exc:  # an unknown protocol, or its fsspec package is missing
            raise UserError(f"cannot use {root} as a store: {exc}") from None
        marker = store.path("STORE")
        with reaching(root):
            if not store.fs.exists(marker):
                if not create:
                    raise StoreNotFound(
                        f"no store at {root}; create one with `rlvr run --store {root}` "
                        f"or `rlvr data --store {root}`, or pass the right --store / RLVR_STORE"
                    )
                store._write_atomic(marker, canonical_json({"format": STORE_FORMAT}).encode())
                if store.is_local:  # made now, not by a run's first index entry, a write inside its fencing
                    for kind in sorted(INDEXED_KINDS):
                        os.makedirs(store.path("indexes", kind), exist_ok=True)
                return store
            found = json.loads(store.fs.cat_file(marker)).get("format")
        if found != STORE_FORMAT:
            raise UserError(f"store at {root} has format {found}; this version reads format {STORE_FORMAT}")
        return store

    # ----- group commits ---------------------------------------------------------------------------

    def _write_files(self, job: _Unwritten) -> Manifest:
        """Write a single-part artifact's data; its manifest, listing the files written."""
        kind, artifact_id, run_id = job.manifest.kind, job.manifest.artifact_id, job.manifest.run_id
        entries = [self._write_part(kind, artifact_id, 0, job.table, job.batch, run_id)]
        for name in sorted(job.files):
            entries.append(self._write_binary(kind, artifact_id, name, job.files[name], job.batch, run_id))
        return replace(job.manifest, files=entries + sorted(job.placed, key=lambda entry: entry["path"]))

    def _ensure_written(self, artifact_id: str) -> None:
        """Write a deferred artifact's data now, in this thread, unless some thread already has; its full
        manifest (listing the files) then replaces the file-less one in the cache and in its batch. A
        thread waits only for the artifact it asks for, never for the committer's other writes."""
        job = self._unwritten.get(artifact_id)
        if job is None:
            return
        with job.lock:
            if not job.done:
                manifest = self._write_files(job)
                self._manifest_cache[artifact_id] = manifest
                assert job.batch is not None
                position = next(i for i, m in enumerate(job.batch.manifests) if m.artifact_id == artifact_id)
                job.batch.manifests[position] = manifest
                job.done = True
        self._unwritten.pop(artifact_id, None)

    def _commit_manifest(self, manifest: Manifest) -> None:
        if self._batch is not None:
            self._check_lease([manifest.run_id], listing=False)  # the batch's flush lists the leases
            self._manifest_cache[manifest.artifact_id] = manifest
            self._batch.manifests.append(manifest)  # written when the batch ends, after its data is durable
            return
        self.wait()  # an artifact never reaches the disk before the batches committed ahead of it
        self._check_lease([manifest.run_id], listing=True)
        self._manifest_cache[manifest.artifact_id] = manifest
        path = self.manifest_path(manifest.artifact_id)
        self._write_atomic(path, manifest.to_json().encode("utf-8"), run_id=manifest.run_id)
        with self._fencing([manifest.run_id]):
            self._append_index([manifest])

    @contextmanager
    def batch(self, background: bool = False) -> Iterator[None]:
        """Commit everything written inside as one group (one RL step), for a fraction of the syncs.

        Inside, data files are written without their own fsync and manifests wait in memory (this
        process sees them: `exists` and `manifest` answer as if committed). At the end: one flush of
        the data to disk, then every manifest in commit order, one more flush, then the deletes asked
        for inside. A kill before the end leaves data files without manifests, which do not exist
        for anyone and which the run's next owner removes (`cleanup_run`): the group is redone on resume. A kill
        during the manifests leaves a prefix of them, and every artifact's inputs precede it.

        `background`: the flush runs on one committer thread while the caller goes on (the next RL
        step computes while this one's syncs run); batches commit in order, any commit outside a
        batch first waits for them, and `wait()` drains them. Nested batches join the outer one.
        """
        if self._batch is not None:
            yield
            return
        self._batch = Batch(defer_writes=background)
        failed = True
        try:
            yield
            failed = False
        finally:
            batch, self._batch = self._batch, None
            if background and not failed:
                self._submit(batch)
            else:
                self.wait()
                self._flush(batch)

    def _submit(self, batch: Batch) -> None:
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlvr-commit")
        self._reap()
        with self._pending_lock:
            self._pending.append((batch, self._committer.submit(self._flush, batch)))

    def _reap(self) -> None:
        """Forget finished background commits (raising the error of a failed one)."""
        while True:
            with self._pending_lock:
                if not self._pending or not self._pending[0][1].done():
                    return
                _, done = self._pending.pop(0)
            done.result()

    def wait(self) -> None:
        """Return once every batch committing in the background is on disk (raising if one failed)."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
                head = self._pending[0]
            head[1].result()
            with self._pending_lock:
                if self._pending and self._pending[0] is head:
                    self._pending.pop(0)

    def _flush(self, batch: Batch) -> None:
        """Data durable, then manifests durable, then renamed into place (the commit), then deletes."""
        for artifact_id in batch.deferred:
            self._ensure_written(artifact_id)
        if not batch.manifests and not batch.deletes:
            return
        self._sync(batch.written)
        deleted = [self._manifest_cache.get(aid) for aid in batch.deletes]  # `_delete_now` checks each again
        runs = [m.run_id for m in [*batch.manifests, *deleted] if m is not None]
        self._check_lease(runs, listing=True)  # one listing per run, before the commit writes anything
        if self.is_local:
            paths = [self.manifest_path(m.artifact_id) for m in batch.manifests]
            temps = [
                self._write_temp(path, m.to_json().encode("utf-8"), sync=False)
                for path, m in zip(paths, batch.manifests)
            ]
            self._sync(temps)
            for temp, path, manifest in zip(temps, paths, batch.manifests):
                self._check_lease([manifest.run_id], listing=False)  # e.g. frozen since the listing: then it lists
                os.replace(temp, path)
            self._sync([self.path("manifests")] if paths else [])
        else:
            for manifest in batch.manifests:
                self._check_lease([manifest.run_id], listing=False)
                self.fs.pipe_file(self.manifest_path(manifest.artifact_id), manifest.to_json().encode("utf-8"))
        with self._fencing(runs):
            self._append_index(batch.manifests)
        for artifact_id in batch.deletes:
            self._delete_now(artifact_id)

    # ----- logs of each commit (storage/catalog.py, INDEXED_KINDS) ---------------------------------

    def _append_index(self, manifests: Sequence[Manifest]) -> None:
        """Log the commit in the catalog's log, and the commits of indexed kinds in theirs, after the manifests
        are written."""
        catalog.append(self, added=manifests)
        for manifest in manifests:
            if manifest.kind not in INDEXED_KINDS:
                continue
            entry = canonical_json({"artifact_id": manifest.artifact_id}).encode("utf-8")
            with self._index_lock:
                position = self._index_next.get(manifest.kind)
                if position is None:
                    position = self.index_end(manifest.kind)
                while not self.create_new(self._index_path(manifest.kind, position), entry):
                    position += 1
                self._index_next[manifest.kind] = position + 1

    def _log_removal(self, artifact_id: str) -> None:
        """Log in the catalog's log that the artifact goes, before its manifest does: a reader then never keeps
        the row of a manifest that was removed and written again (storage/catalog.py)."""
        catalog.append(self, removed=[artifact_id])

    # ----- writing artifacts -----------------------------------------------------------------------

    def write_artifact(
        self,
        kind: str,
        artifact_id: str,
        table: pa.Table,
        *,
        run_id: str,
        stage: str,
        parents: Sequence[str],
        code_version: str,
        config: Mapping[str, Any],
        step: int | None = None,
        files: Mapping[str, bytes] | None = None,
        extra: Mapping[str, Any] | None = None,
        placed: Sequence[Mapping[str, Any]] = (),
    ) -> Manifest:
        """Write a single-part artifact and commit it; a second write of the same id is a no-op.

        Ids are content-addressed, so an existing manifest already holds what this call would write.
        `placed`: entries of binary files other processes already wrote into the artifact's folder (`place_file`:
        the data-parallel ranks' shards of a training state), listed in the manifest as they are.
        """
        started = time.monotonic()
        check_kind(kind)
        check_name("artifact id", artifact_id)
        table = conform_to_schema(kind, table)
        if self.exists(artifact_id):
            return self.manifest(artifact_id)
        self._check_lease([run_id], listing=False)  # nothing new starts once the run is known to be taken
        manifest = Manifest(
            artifact_id=artifact_id,
            kind=kind,
            run_id=run_id,
            stage=stage,
            step=step,
            rows=table.num_rows,
            schema=str(table.schema),
            files=[],
            parents=list(parents),
            code_version=code_version,
            config=dict(config),
            created_at=utc_now(),
            seconds=time.monotonic() - started,
            extra=dict(extra or {}),
            lease=self.lease_number(run_id),
        )
        if self.is_local:
            self.mark_owner(kind, artifact_id, run_id)
        job = _Unwritten(manifest, table, dict(files or {}), self._batch, [dict(entry) for entry in placed])
        if self._batch is None or not self._batch.defer_writes:
            manifest = replace(self._write_files(job), seconds=time.monotonic() - started)
            self._commit_manifest(manifest)
            return manifest
        # Serialising and writing go to the committer thread (the batch's flush, timed with it; the
        # manifest's `seconds` are this thread's). Until then the manifest lists no files; a reader in
        # this process that needs them (manifest, read_table, read_file) writes them first.
        self._commit_manifest(manifest)
        self._unwritten[artifact_id] = job
        self._batch.deferred.append(artifact_id)
        return manifest

    def writer(
        self,
        kind: str,
        artifact_id: str,
        *,
        run_id: str,
        stage: str,
        parents: Sequence[str],
        code_version: str,
        config: Mapping[str, Any],
        step: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> ArtifactWriter:
        """A writer for an artifact written in shards, each committed on its own (resume skips them)."""
        check_kind(kind)
        check_name("artifact id", artifact_id)
        return ArtifactWriter(
            self,
            kind,
            artifact_id,
            run_id=run_id,
            stage=stage,
            parents=list(parents),
            code_version=code_version,
            config=dict(config),
            step=step,
            extra=dict(extra or {}),
        )

    # ----- reading artifacts -----------------------------------------------------------------------

    def exists(self, artifact_id: str) -> bool:
        """True once the artifact is committed (its manifest exists); files alone do not count.

        Inside `batch()`, an artifact committed in the batch exists for this process already.
        """
        batches = [self._batch] if self._batch is not None else []
        batches += [batch for batch, _ in self._pending]
        if any(m.artifact_id == artifact_id for batch in batches for m in batch.manifests):
            return True
        if not NAME_RE.match(artifact_id):
            return False
        if self.is_local:
            return os.path.exists(self.manifest_path(artifact_id))
        # An object store answers with one GET, never from a listing cached by this process (another
        # process may have committed since), and the manifest read is the one a caller asks for next.
        return self._fetch_manifest(artifact_id) is not None

    def await_committed(self, artifact_id: str, timeout: float = 600.0) -> None:
        """Return once `artifact_id` is committed, for an artifact another process commits in the background
        (flow.sampler=process: the sampler waits for the trainer's policies, the trainer for the sampler's
        steps). Polls every few milliseconds; a TimeoutError after `timeout` seconds."""
        deadline, pause = time.monotonic() + timeout, 0.0005
        while not self.exists(artifact_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{artifact_id} was not committed to {self.root} within {timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.004)

    def manifest(self, artifact_id: str) -> Manifest:
        """The manifest of a committed artifact (cached: manifests never change)."""
        self._ensure_written(artifact_id)
        cached = self._manifest_cache.get(artifact_id)
        if cached is not None:
            return cached
        manifest = self._fetch_manifest(artifact_id) if NAME_RE.match(artifact_id) else None
        if manifest is None:
            raise ArtifactNotFound(
                f'no artifact {artifact_id} in store {self.root}; list them with `rlvr query "select * from artifacts"`'
            )
        return manifest

    def _fetch_manifest(self, artifact_id: str) -> Manifest | None:
        """Read a manifest from the store (not the cache) and cache it; None when it is not committed."""
        path = self.manifest_path(artifact_id)
        try:
            text = read_whole(self.fs, path)
        except FileNotFoundError:
            return None
        manifest = Manifest.from_file(path, text)
        self._manifest_cache[artifact_id] = manifest
        return manifest

    def manifests(self, kind: str | None = None, run_id: str | None = None) -> list[Manifest]:
        """Every committed artifact (optionally of one kind / run), oldest first.

        The manifests directory is listed once per call; only manifests not seen before are read, and on
        an object store they are fetched concurrently (one round trip each would dominate a query).
        """
        ids = self._committed_ids()
        self._fetch_manifests([aid for aid in ids if aid not in self._manifest_cache])
        found: list[Manifest] = []
        for artifact_id in ids:
            try:
                manifest = self.manifest(artifact_id)
            except ArtifactNotFound:  # deleted between the listing and the read
                continue
            except DamagedFile as exc:  # one bad manifest must not hide the rest of the store
                self.unreadable[self.manifest_path(artifact_id)] = str(exc)
                continue
            if (kind is None or manifest.kind == kind) and (run_id is None or manifest.run_id == run_id):
                found.append(manifest)
        return sorted(found, key=lambda m: (m.created_at, m.artifact_id))

    def _fetch_manifests(self, artifact_ids: Sequence[str]) -> None:
        """Read these manifests into the cache in one concurrent batch (object stores); a missing one is skipped."""
        if self.is_local or len(artifact_ids) < 2:
            return
        paths = {self.manifest_path(aid): aid for aid in artifact_ids}
        fetched = self.fs.cat(list(paths), on_error="omit", start=0)  # start=0: see read_whole
        for path, text in fetched.items():
            aid = paths.get(self.fs._strip_protocol(path))
            if aid is not None and isinstance(text, bytes):
                try:
                    self._manifest_cache[aid] = Manifest.from_file(path, text)
                except DamagedFile as exc:
                    self.unreadable[path] = str(exc)

    def read_table(self, artifact_id: str, columns: Sequence[str] | None = None) -> pa.Table:
        """All rows of a committed artifact, parts concatenated in order, each part checked against its
        manifest's size and sha256 first (a `DamagedArtifact` names the part that fails)."""
        manifest = self.manifest(artifact_id)
        wanted = list(columns) if columns is not None else None
        tables = [self._read_part(manifest, entry, wanted) for entry in manifest.table_files]
        if tables:
            return pa.concat_tables(tables, promote_options="default")
        declared = schema_for(manifest.kind)
        empty = declared.empty_table() if declared is not None else pa.table({})
        return empty.select(wanted) if wanted is not None and declared is not None else empty

    def _read_part(self, manifest: Manifest, entry: dict[str, Any], columns: list[str] | None) -> pa.Table:
        """One part, read whole (on an object store one GET, where a Parquet reader on a remote handle
        would cost a HEAD and several ranged GETs), checked, then parsed from memory."""
        data = self._checked_bytes(manifest, entry)
        try:
            return pq.ParquetFile(pa.BufferReader(data)).read(columns=columns)
        except pa.ArrowException as exc:  # its checksum matched: the manifest itself recorded a bad file
            path = self._entry_path(manifest, entry)
            raise DamagedArtifact(f"{path} is not readable Parquet ({exc})", manifest.artifact_id, path) from None

    def _entry_path(self, manifest: Manifest, entry: Mapping[str, Any]) -> str:
        return f"{self.artifact_dir(manifest.kind, manifest.artifact_id)}/{entry['path']}"

    def _checked_bytes(self, manifest: Manifest, entry: Mapping[str, Any]) -> bytes:
        """The bytes of one file of a committed artifact, as its manifest recorded them, else a DamagedArtifact."""
        path = self._entry_path(manifest, entry)
        try:
            data = self.fs.cat_file(path) if self.is_local else read_whole(self.fs, path)
        except FileNotFoundError:
            data = None
        problem = file_damage(data, entry) if self.check_reads or data is None else None
        if problem is not None:
            raise DamagedArtifact(damage_message(manifest, path, problem), manifest.artifact_id, path)
        assert data is not None
        return data

    def verify_artifact(self, artifact_id: str) -> list[tuple[str, str]]:
        """Every file of a committed artifact that does not match its manifest: (path, what is wrong)."""
        manifest = self.manifest(artifact_id)
        damaged = []
        for entry in manifest.files:
            path = self._entry_path(manifest, entry)
            problem = file_problem(self.fs, path, entry)
            if problem is None and entry["rows"] is not None:
                problem = parquet_problem(self.fs, path)
            if problem is not None:
                damaged.append((path, problem))
        return damaged

    def file_path(self, artifact_id: str, name: str) -> str:
        """The fs path of a binary file of a committed artifact (e.g. to hand to a model loader)."""
        manifest = self.manifest(artifact_id)
        relative = f"files/{name}"
        listed = [entry["path"] for entry in manifest.binary_files]
        if relative not in listed:
            raise ArtifactNotFound(f"artifact {artifact_id} has no file {name!r}; it has {listed}")
        return f"{self.artifact_dir(manifest.kind, artifact_id)}/{relative}"

    def local_file_path(self, artifact_id: str, name: str) -> str | None:
        """An OS path to the file when the store is local, else None (read it with read_file)."""
        path = self.file_path(artifact_id, name)
        return path if self.is_local else None

    def read_file(self, artifact_id: str, name: str) -> bytes:
        """The bytes of a binary file of a committed artifact, checked against its manifest."""
        manifest = self.manifest(artifact_id)
        relative = f"files/{name}"
        entry = next((e for e in manifest.binary_files if e["path"] == relative), None)
        if entry is None:
            listed = [e["path"] for e in manifest.binary_files]
            raise ArtifactNotFound(f"artifact {artifact_id} has no file {name!r}; it has {listed}")
        return self._checked_bytes(manifest, entry)

    # ----- removing ------------------------------------------------------------------------------

    def delete_artifact(self, artifact_id: str) -> None:
        """Remove an artifact: manifest first, so a crash midway leaves only invisible files.

        Shard markers go next, so leftovers are not mistaken for committed shards by cleanup.
        Inside `batch()` the delete waits for the batch's manifests to be durable.
        """
        if self._batch is not None:
            self._batch.deletes.append(artifact_id)
            return
        self.wait()
        self._delete_now(artifact_id)

    def set_aside(self, artifact_id: str) -> str:
        """Take a damaged artifact out of the catalog: its manifest moves to damaged/ (where `rlvr check`
        still shows it), so the artifact no longer exists and the stage that made it makes it again. Its
        files stay, uncommitted, for that stage to overwrite. Returns where the manifest went."""
        self.wait()
        source = self.manifest_path(artifact_id)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = self.path("damaged", f"{artifact_id}.{stamp}.json")
        self.write_small(target, bytes(self.fs.cat_file(source)))
        self._log_removal(artifact_id)
        self.fs.rm(source)
        self._manifest_cache.pop(artifact_id, None)
        return target

    def _delete_now(self, artifact_id: str) -> None:
        manifest = self.manifest(artifact_id)
        with self._fencing([manifest.run_id]):
            self._log_removal(artifact_id)
        self._check_lease([manifest.run_id], listing=False)
        self.fs.rm(self.manifest_path(artifact_id))
        self._manifest_cache.pop(artifact_id, None)
        directory = self.artifact_dir(manifest.kind, artifact_id)
        for path in (f"{directory}/_shards", directory):
            self._check_lease([manifest.run_id], listing=False)  # each removal, as each write: frozen in between?
            try:  # one request where asking first would be two (on an object store, each a round trip)
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                continue

    def cleanup_run(self, run_id: str) -> list[str]:
        """Remove what killed writers of run `run_id` left (its uncommitted artifact folders, keeping
        committed shards: resume skips them) and temp files of writers that are gone; returns the paths.

        Call it only while owning the run (storage/leases.py): then no live process writes those folders.
        Other runs' folders are never touched, whatever state they are in.
        """
        self.wait()
        removed = self.remove_dead_temp_files()
        for directory in self.uncommitted_dirs():
            if self.owner_of(directory) == run_id:
                removed.extend(self.cleanup_artifact_dir(directory))
        return removed


_handles: dict[tuple[int, str], Store] = {}
_handles_lock = threading.Lock()


def open_store(root: str, create: bool = False) -> Store:
    """This process's one handle on the store at `root` (opened, or created with `create`, on first use):
    every stage, the run record's heartbeat and the CLI share its manifest cache and its commit thread.
    Keyed by the process id too, so a forked child opens its own."""
    key = (os.getpid(), root)
    with _handles_lock:
        handle = _handles.get(key)
        if handle is None:
            handle = _handles[key] = Store.open(root, create=create)
        return handle


@dataclass
class _Unwritten:
    """A single-part artifact whose manifest is committed in a batch and whose files are still to write."""

    manifest: Manifest
    table: pa.Table
    files: dict[str, bytes]
    batch: Batch | None
    placed: list[dict[str, Any]] = field(default_factory=list)  # entries of files other processes wrote
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False
