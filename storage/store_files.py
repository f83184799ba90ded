"""The files of a store beneath its artifacts' contents: the root and its layout, writes that are atomic and
checked against the run's lease (fencing), exclusive creates, the index logs of INDEXED_KINDS, what killed
writers left, and run records. `Store` (storage/store.py) builds commits, group commits and reads on these;
the layout and the fencing rules are in its docstring.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from rlvr.storage.errors import DamagedFile
from rlvr.storage.files import fsync_path, fsync_pool, open_new, read_whole, valid_shards
from rlvr.storage.ids import canonical_json
from rlvr.storage.manifest import Manifest, basename, parquet_bytes, part_name, sha256_hex, utc_now
from rlvr.storage.processes import TMP_MARK, host_tag, mtime_of, temp_writer_gone
from rlvr.storage.run_records import RUN_STATUSES, parsed_run_record

# These names are catalog views in DuckDB, so no artifact kind may take them.
RESERVED_KINDS = frozenset({"artifacts", "lineage", "runs", "stage_runs"})
# Kinds whose readers poll for new artifacts (the reward cache, at every labelling call): each commit also
# appends the artifact id to an index log, so a reader asks for the next entry (one GET on an object
# store) instead of listing every manifest of the store.
INDEXED_KINDS = frozenset({"reward_cache"})

_KIND_RE = re.compile(r"^[a-z][a-z0-9_]*$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_INDEX_ENTRY_RE = re.compile(r"^(\d{10})\.json$")
OWNER_FILE = "_owner.json"


def check_kind(kind: str) -> None:
    if not _KIND_RE.match(kind) or kind in RESERVED_KINDS:
        raise ValueError(
            f"bad artifact kind {kind!r}: kinds are view names, lower_snake_case, "
            f"and not one of {sorted(RESERVED_KINDS)}"
        )


def check_name(what: str, name: str) -> None:
    if not NAME_RE.match(name):
        raise ValueError(f"bad {what} {name!r}: use letters, digits, '_', '.', '-' (it becomes a file name)")


class Fence(Protocol):
    """A run's lease as the store sees it (storage/leases.py's `Lease`): its number, and the two checks that
    raise `LeaseLost` once another process has taken the run over."""

    number: int

    def check(self) -> None:
        """One listing of the run's leases: before a commit."""

    def check_fresh(self) -> None:
        """In memory while the heartbeat is recent: before any other write."""


class StoreFiles:
    """A store's root on a local path or any fsspec URL, and the files it keeps besides artifacts' contents."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fs, root_path = fsspec.core.url_to_fs(root)
        self._root_path = root_path.rstrip("/")
        self._thread = threading.local()  # the open batch belongs to the thread that opened it (`_batch`)
        self._index_next: dict[str, int] = {}  # per indexed kind: where this process appends next
        self._index_lock = threading.RLock()  # index_end takes it inside _append_index
        self.unreadable: dict[str, str] = {}  # damaged manifests and run records listings skipped: path -> why
        self._fences: dict[str, Fence] = {}  # run id -> the lease this process holds on it (`hold`)

    @property
    def _batch(self) -> Batch | None:
        """The batch open in this thread: a run record or lease written by another thread (the heartbeat)
        never joins a step's batch."""
        return getattr(self._thread, "batch", None)

    @_batch.setter
    def _batch(self, batch: Batch | None) -> None:
        self._thread.batch = batch

    # ----- paths -----------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """A path on `self.fs` under the root."""
        return "/".join([self._root_path, *parts])

    @property
    def is_local(self) -> bool:
        """Local stores are read by DuckDB directly; others go through the fsspec filesystem."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def local_root(self) -> str | None:
        """The root as an OS path, or None when the store is not on the local disk."""
        return self._root_path if self.is_local else None

    def artifact_dir(self, kind: str, artifact_id: str) -> str:
        """The directory holding an artifact's parts, shard markers and files."""
        return self.path("artifacts", kind, artifact_id)

    def manifest_path(self, artifact_id: str) -> str:
        """Where the manifest (the commit marker) of `artifact_id` lives."""
        return self.path("manifests", f"{artifact_id}.json")

    # ----- fencing (storage/leases.py) -------------------------------------------------------------

    def hold(self, run_id: str, fence: Fence) -> None:
        """From now on every write of run `run_id` through this handle checks `fence` (the run's lease)."""
        self._fences[run_id] = fence

    def let_go(self, run_id: str, fence: Fence) -> None:
        if self._fences.get(run_id) is fence:
            del self._fences[run_id]

    def lease_number(self, run_id: str) -> int | None:
        """The number of the lease this process holds on the run (recorded in what it commits), or None."""
        fence = self._fences.get(run_id)
        return None if fence is None else fence.number

    def _check_lease(self, run_ids: Sequence[str | None], listing: bool) -> None:
        """`LeaseLost` when this process held a lease on one of these runs and another process took it over:
        `listing` before a commit (one listing per run), else the check in memory (before a file write)."""
        for run_id in dict.fromkeys(run_ids):
            fence = self._fences.get(run_id) if run_id is not None else None
            if fence is not None:
                fence.check() if listing else fence.check_fresh()

    @contextmanager
    def _fencing(self, run_ids: Sequence[str]) -> Iterator[None]:
        """Inside, `create_new` (the catalog's and the index logs' entries, which name no run) checks the leases
        of `run_ids` in memory before each entry, as every other write of these runs does."""
        previous = getattr(self._thread, "fencing", ())
        self._thread.fencing = tuple(run_ids)
        try:
            yield
        finally:
            self._thread.fencing = previous

    # ----- low-level writes ------------------------------------------------------------------------

    def _write_atomic(self, path: str, data: bytes, batch: Batch | None = None, run_id: str | None = None) -> None:
        """Readers see the old file or the new one, never half of one.

        Locally: a temp file beside the target, fsync, rename (inside `batch()` the fsync is left to the
        batch's flush). On object stores a single put of the final object is already atomic.
        `batch`: the group this write belongs to (default: the one open now, if any). `run_id`: the run whose
        lease is checked just before the file appears.
        """
        batch = batch or self._batch
        self._check_lease([run_id], listing=False)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        self._publish_temp(self._write_temp(path, data, sync=batch is None), path, run_id)
        if batch is not None:
            batch.written.append(path)

    def write_small(self, path: str, data: bytes, run_id: str | None = None) -> None:
        """Replace a small store file (a run record, a lease) atomically and durably now, never as part of
        an open batch. `run_id`: the run whose lease is checked just before the file appears."""
        self._check_lease([run_id], listing=False)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        self._publish_temp(self._write_temp(path, data, sync=True), path, run_id)

    def _publish_temp(self, tmp: str, path: str, run_id: str | None) -> None:
        """Rename temp file `tmp` to `path` once run `run_id`'s lease checks again (the process may have been
        frozen while it wrote); a failed check removes the temp file, which was this process's and never seen."""
        try:
            self._check_lease([run_id], listing=False)
        except BaseException:
            os.remove(tmp)
            raise
        os.replace(tmp, path)

    @staticmethod
    def _write_temp(path: str, data: bytes | Iterable[bytes], sync: bool) -> str:
        """`data` (bytes, or chunks of them) in a temp file beside `path` (fsynced when `sync`); the caller renames
        it into place. The name says which host and process wrote it (`temp_writer_gone`)."""
        tmp = f"{path}{TMP_MARK}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open_new(tmp) as handle:
                for chunk in (data,) if isinstance(data, bytes) else data:
                    handle.write(chunk)
                    del chunk  # not held while the next chunk is made (a streamed checkpoint's next tensor)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return tmp

    def _write_part(
        self,
        kind: str,
        artifact_id: str,
        index: int,
        table: pa.Table,
        batch: Batch | None = None,
        run_id: str | None = None,
    ) -> dict[str, Any]:
        data = parquet_bytes(table)
        name = part_name(index)
        self._write_atomic(f"{self.artifact_dir(kind, artifact_id)}/{name}", data, batch, run_id)
        return {"path": name, "rows": table.num_rows, "bytes": len(data), "sha256": sha256_hex(data)}

    def _write_binary(
        self,
        kind: str,
        artifact_id: str,
        name: str,
        data: bytes,
        batch: Batch | None = None,
        run_id: str | None = None,
    ) -> dict[str, Any]:
        check_name("file name", name)
        relative = f"files/{name}"
        self._write_atomic(f"{self.artifact_dir(kind, artifact_id)}/{relative}", data, batch, run_id)
        return {"path": relative, "rows": None, "bytes": len(data), "sha256": sha256_hex(data)}

    def place_file(self, kind: str, artifact_id: str, name: str, data: bytes | Iterable[bytes]) -> dict[str, Any]:
        """Write binary file `name` of an artifact that another process commits (`write_artifact(placed=...)`),
        durably, and return its manifest entry. Until that commit the file belongs to an uncommitted folder.
        `data` may come in chunks (an iterable of bytes), so a file larger than memory is written a piece at a time
        (a checkpoint streamed from the ranks' shards); it appears whole or not at all, as any other file."""
        check_kind(kind)
        check_name("file name", name)
        relative = f"files/{name}"
        chunks = (data,) if isinstance(data, bytes) else data
        size, digest = self._write_chunks(f"{self.artifact_dir(kind, artifact_id)}/{relative}", chunks)
        return {"path": relative, "rows": None, "bytes": size, "sha256": digest}

    def _write_chunks(self, path: str, chunks: Iterable[bytes]) -> tuple[int, str]:
        """`_write_atomic` for data that comes in chunks: (bytes written, their sha256). Locally through a temp file
        renamed into place; on object storage one upload, which the object store shows only once it is complete."""
        digest, size = hashlib.sha256(), [0]

        def tallied() -> Iterator[bytes]:
            for chunk in chunks:
                digest.update(chunk)
                size[0] += len(chunk)
                yield chunk
                del chunk

        self._check_lease([None], listing=False)
        if not self.is_local:
            with self.fs.open(path, "wb") as handle:
                for chunk in tallied():
                    handle.write(chunk)
                    del chunk
        else:
            self._publish_temp(self._write_temp(path, tallied(), sync=True), path, None)
        return size[0], digest.hexdigest()

    def create_new(self, path: str, data: bytes) -> bool:
        """Write `path` only if it does not exist yet, atomically; False when it already did."""
        fencing = getattr(self._thread, "fencing", ())  # inside `_fencing` only
        if not self.is_local:
            self._check_lease(fencing, listing=False)
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True
        if not os.path.isdir(os.path.dirname(path)):  # made before the check: no write waits between them
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._check_lease(fencing, listing=False)
        tmp = self._write_temp(path, data, sync=False)  # an index entry is a hint: no fsync
        try:
            self._check_lease(fencing, listing=False)  # again: the process may have been frozen while it wrote
            os.link(tmp, path)  # fails if `path` exists: the local form of S3's If-None-Match
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)
        return True

    def _sync(self, paths: Sequence[str]) -> None:
        """fsync these files (or directories) all at once: from threads, the file system groups them into
        a few journal commits instead of one per file."""
        if self.is_local and paths:
            list(fsync_pool().map(fsync_path, paths))

    # ----- listings ------------------------------------------------------------------------------

    def _committed_ids(self) -> list[str]:
        directory = self.path("manifests")
        self.fs.invalidate_cache(directory)
        try:  # one listing (asking whether the folder exists first would be another round trip)
            names = [basename(p) for p in self.fs.ls(directory, detail=False)]
        except FileNotFoundError:
            return []
        return [name[: -len(".json")] for name in names if name.endswith(".json")]

    # ----- index logs (INDEXED_KINDS) ---------------------------------------------------------------
    #
    # indexes/<kind>/ holds one small object per commit of the kind, numbered 0, 1, 2, ... in commit
    # order. A writer creates the next number exclusively (a conditional PUT on S3, a hard link locally)
    # and takes the one after when another writer got there first, so the numbers have no gaps and a
    # reader that has read up to n asks for n, n+1, ... until one is missing. The log is a hint, never
    # the truth (the manifests are): a kill between a manifest and its entry leaves an artifact only a
    # listing finds, which costs a reader speed (the reward cache scores again), never correctness.

    def _index_path(self, kind: str, position: int) -> str:
        return self.path("indexes", kind, f"{position:010d}.json")

    def index_end(self, kind: str) -> int:
        """The position after the last entry of `kind`'s index log (one listing of the log)."""
        directory = self.path("indexes", kind)
        self.fs.invalidate_cache(directory)
        found = (_INDEX_ENTRY_RE.match(basename(path)) for path in self.fs.find(directory))
        end = max((int(match.group(1)) for match in found if match), default=-1) + 1
        with self._index_lock:  # where this process's next append starts, without a listing of its own
            self._index_next[kind] = max(self._index_next.get(kind, 0), end)
        return end

    def read_index(self, kind: str, start: int) -> tuple[list[str], int]:
        """The ids `kind`'s index log holds from position `start` on, and the position after them.

        One read per entry plus one for the first missing position: no listing.
        """
        ids: list[str] = []
        position = start
        while True:
            try:
                ids.append(json.loads(read_whole(self.fs, self._index_path(kind, position)))["artifact_id"])
            except FileNotFoundError:
                break
            except (ValueError, KeyError):  # an entry still being written (a store without atomic puts)
                break
            position += 1
        return ids, position

    # ----- what killed writers left ----------------------------------------------------------------

    def mark_owner(self, kind: str, artifact_id: str, run_id: str) -> None:
        """Record in a new artifact folder which run writes it (`_owner.json`), so that only that run's
        owner ever removes it uncommitted (`cleanup_run`). Locally it costs one mkdir per artifact and a
        small file when the folder is new; on an object store, one PUT (sharded writers only)."""
        directory = self.artifact_dir(kind, artifact_id)
        data = canonical_json({"run_id": run_id}).encode("utf-8")
        self._check_lease([run_id], listing=False)
        if not self.is_local:
            self.fs.pipe_file(f"{directory}/{OWNER_FILE}", data)
            return
        try:
            os.mkdir(directory)
        except FileExistsError:
            return
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
        with open(f"{directory}/{OWNER_FILE}", "wb") as handle:
            handle.write(data)

    def owner_of(self, directory: str) -> str | None:
        """The run that writes an artifact folder (from its `_owner.json`), or None when it is not known."""
        try:
            return str(json.loads(read_whole(self.fs, f"{directory}/{OWNER_FILE}"))["run_id"])
        except (FileNotFoundError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def uncommitted_dirs(self) -> list[str]:
        """Artifact folders without a manifest: in flight, or left by a killed writer."""
        self.fs.invalidate_cache()
        root = self.path("artifacts")
        committed = set(self._committed_ids())
        try:
            kind_dirs = sorted(self.fs.ls(root, detail=False))
        except FileNotFoundError:
            return []
        found = []
        for kind_dir in kind_dirs:
            if self.fs.isdir(kind_dir):
                found += [d for d in sorted(self.fs.ls(kind_dir, detail=False)) if basename(d) not in committed]
        return [d for d in found if self.fs.isdir(d)]

    def remove_dead_temp_files(self, directories: Sequence[str] = ()) -> list[str]:
        """Remove temp files whose writer is gone (`temp_writer_gone`) from the store's shared folders
        (manifests, runs, index logs) and `directories`. Object stores have no temp files."""
        if not self.is_local:
            return []
        shared = [self.path(folder) for folder in ("manifests", "runs", "catalog/log", "catalog/snapshots")]
        shared += [self.path("indexes", k) for k in sorted(INDEXED_KINDS)]
        removed = []
        for directory in [*shared, *directories]:
            try:
                entries = os.scandir(directory)
            except FileNotFoundError:
                continue
            with entries:
                dead = [e.path for e in entries if temp_writer_gone(e.name, mtime_of(e))]
            for path in dead:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue
                removed.append(path)
        return removed

    def cleanup_artifact_dir(self, directory: str) -> list[str]:
        """Empty an uncommitted artifact folder but for its committed shards (and owner mark); the caller
        makes sure no live process writes it."""
        valid = valid_shards(self.fs, directory)
        if not valid:
            self.fs.rm(directory, recursive=True)
            return [directory]
        keep = {("_shards", f"part-{index:05d}.json") for index in valid}
        keep |= {(basename(directory), marker["path"]) for marker in valid.values()}
        keep.add((basename(directory), OWNER_FILE))
        removed = []
        for path in sorted(self.fs.find(directory)):
            parts = path.rstrip("/").split("/")
            if (parts[-2], parts[-1]) not in keep:
                self.fs.rm(path)
                removed.append(path)
        files_dir = f"{directory}/files"
        if self.fs.exists(files_dir):
            self.fs.rm(files_dir, recursive=True)
        return removed

    # ----- runs ----------------------------------------------------------------------------------

    def write_run(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Replace a run's record atomically and return what was written.

        `updated_at` is set to now; created_at, pid and host default to now and this process. `lease` is the
        number of the lease this process holds on the run (checked first: one listing), absent without one.
        """
        run_id = str(record.get("run_id", ""))
        check_name("run id", run_id)
        if record.get("status") not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {RUN_STATUSES}, got {record.get('status')!r}")
        self._check_lease([run_id], listing=True)
        now = utc_now()
        written = {"created_at": now, "pid": os.getpid(), "host": socket.gethostname(), **record}
        written["updated_at"] = now
        written.pop("lease", None)
        if (lease := self.lease_number(run_id)) is not None:
            written["lease"] = lease
        path = self.path("runs", f"{run_id}.json")
        self.write_small(path, canonical_json(written).encode("utf-8"), run_id=run_id)
        return written

    def read_run(self, run_id: str) -> dict[str, Any] | None:
        """The run's record, or None if there is no such run; a DamagedFile when it cannot be read."""
        if not NAME_RE.match(run_id):
            return None
        path = self.path("runs", f"{run_id}.json")
        try:
            return parsed_run_record(path, self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def list_runs(self) -> list[dict[str, Any]]:
        """Every run record, oldest first."""
        directory = self.path("runs")
        self.fs.invalidate_cache(directory)
        if not self.fs.exists(directory):
            return []
        records = []
        for path in self.fs.ls(directory, detail=False):
            if basename(path).endswith(".json"):
                try:
                    records.append(parsed_run_record(path, self.fs.cat_file(path)))
                except FileNotFoundError:
                    continue
                except DamagedFile as exc:  # one bad record must not hide the other runs
                    self.unreadable[path] = str(exc)
        return sorted(records, key=lambda r: (str(r.get("created_at", "")), str(r.get("run_id", ""))))


@dataclass
class Batch:
    """What one group commit (`Store.batch`) collects while it is open, committed when it ends."""

    defer_writes: bool = False  # single-part artifacts are serialised and written by the committer thread
    written: list[str] = field(default_factory=list)
    manifests: list[Manifest] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
