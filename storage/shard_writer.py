"""Writing one artifact shard by shard (`Store.writer`): each shard commits on its own, with a marker beside
its data, so a killed writer loses at most the shard in flight and a resume writes only the missing ones."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import fsspec
import pyarrow as pa

from rlvr.storage.errors import DamagedArtifact
from rlvr.storage.files import valid_shards
from rlvr.storage.ids import canonical_json
from rlvr.storage.manifest import Manifest, conform_to_schema, utc_now
from rlvr.storage.schemas import schema_for
from rlvr.storage.store_files import Batch

_MAX_SHARD_INDEX = 99_999


class ShardedStore(Protocol):
    """What a sharded writer uses of its store (storage/store.py's `Store`, which imports this module)."""

    fs: fsspec.AbstractFileSystem

    def artifact_dir(self, kind: str, artifact_id: str) -> str: ...

    def exists(self, artifact_id: str) -> bool: ...

    def manifest(self, artifact_id: str) -> Manifest: ...

    def lease_number(self, run_id: str) -> int | None: ...

    def mark_owner(self, kind: str, artifact_id: str, run_id: str) -> None: ...

    def _check_lease(self, run_ids: Sequence[str | None], listing: bool) -> None: ...

    def _write_atomic(self, path: str, data: bytes, batch: Batch | None = None, run_id: str | None = None) -> None: ...

    def _write_part(
        self,
        kind: str,
        artifact_id: str,
        index: int,
        table: pa.Table,
        batch: Batch | None = None,
        run_id: str | None = None,
    ) -> dict[str, Any]: ...

    def _write_binary(
        self,
        kind: str,
        artifact_id: str,
        name: str,
        data: bytes,
        batch: Batch | None = None,
        run_id: str | None = None,
    ) -> dict[str, Any]: ...

    def _commit_manifest(self, manifest: Manifest) -> None: ...


class ArtifactWriter:
    """Writes one artifact shard by shard; each shard commits on its own, the manifest commits them all.

    Resume: ask `committed_shards()`, write only the missing ones, then `commit()`. A shard file
    without its marker (or with a wrong checksum) is not committed and is simply written again.
    Once the artifact is committed it is immutable: further writes are no-ops, commit returns it.
    """

    def __init__(
        self,
        store: ShardedStore,
        kind: str,
        artifact_id: str,
        *,
        run_id: str,
        stage: str,
        parents: list[str],
        code_version: str,
        config: dict[str, Any],
        step: int | None,
        extra: dict[str, Any],
    ) -> None:
        self.store = store
        self.kind = kind
        self.artifact_id = artifact_id
        self.run_id = run_id
        self.stage = stage
        self.parents = parents
        self.code_version = code_version
        self.config = config
        self.step = step
        self.extra = extra
        self._started = time.monotonic()
        self._files: dict[str, dict[str, Any]] = {}
        self._marked = False

    @property
    def directory(self) -> str:
        """The artifact's directory in the store."""
        return self.store.artifact_dir(self.kind, self.artifact_id)

    def _marker_path(self, index: int) -> str:
        return f"{self.directory}/_shards/part-{index:05d}.json"

    def committed_shards(self) -> set[int]:
        """Indices of shards whose marker exists and whose file matches the marker's checksum."""
        return set(valid_shards(self.store.fs, self.directory))

    def write_shard(self, index: int, table: pa.Table) -> None:
        """Write shard `index` (data first, then its marker); rewriting an uncommitted shard is fine."""
        if not 0 <= index <= _MAX_SHARD_INDEX:
            raise ValueError(f"shard index must be in 0..{_MAX_SHARD_INDEX}, got {index}")
        table = conform_to_schema(self.kind, table)
        if self.store.exists(self.artifact_id):
            return
        self.store._check_lease([self.run_id], listing=False)
        self._mark_owner()
        marker_path = self._marker_path(index)
        try:
            self.store.fs.rm(marker_path)
        except FileNotFoundError:
            pass
        entry = self.store._write_part(self.kind, self.artifact_id, index, table, run_id=self.run_id)
        marker = {**entry, "index": index, "schema": str(table.schema)}
        self.store._check_lease([self.run_id], listing=True)  # a shard marker commits the shard
        self.store._write_atomic(marker_path, canonical_json(marker).encode("utf-8"), run_id=self.run_id)

    def add_file(self, name: str, data: bytes) -> None:
        """Attach a binary file (listed in the manifest with its checksum at commit)."""
        if self.store.exists(self.artifact_id):
            return
        self._mark_owner()
        self._files[name] = self.store._write_binary(self.kind, self.artifact_id, name, data, run_id=self.run_id)

    def _mark_owner(self) -> None:
        if not self._marked:
            self.store.mark_owner(self.kind, self.artifact_id, self.run_id)
            self._marked = True

    def commit(self, expected_shards: int | None = None) -> Manifest:
        """Write the manifest listing every committed shard in index order: the artifact now exists.

        `expected_shards`: the shards 0..n-1 must all be there; a missing one (its file deleted or damaged
        since it was written) is an error, never an artifact silently short of rows.
        """
        if self.store.exists(self.artifact_id):
            return self.store.manifest(self.artifact_id)
        shards = valid_shards(self.store.fs, self.directory)
        if expected_shards is not None and set(shards) != set(range(expected_shards)):
            missing = sorted(set(range(expected_shards)) - set(shards))
            raise DamagedArtifact(
                f"shards {missing} of {self.kind} {self.artifact_id} are missing or damaged in {self.directory} "
                f"after they were written; `rlvr resume {self.run_id}` writes them again",
                self.artifact_id,
                self.directory,
            )
        ordered = [shards[index] for index in sorted(shards)]
        entries = [{key: marker[key] for key in ("path", "rows", "bytes", "sha256")} for marker in ordered]
        entries += [self._files[name] for name in sorted(self._files)]
        declared = schema_for(self.kind)
        if declared is not None:
            schema = str(declared)
        else:
            schema = ordered[0]["schema"] if ordered else str(pa.schema([]))
        manifest = Manifest(
            artifact_id=self.artifact_id,
            kind=self.kind,
            run_id=self.run_id,
            stage=self.stage,
            step=self.step,
            rows=sum(marker["rows"] for marker in ordered),
            schema=schema,
            files=entries,
            parents=self.parents,
            code_version=self.code_version,
            config=self.config,
            created_at=utc_now(),
            seconds=time.monotonic() - self._started,
            extra=self.extra,
            lease=self.store.lease_number(self.run_id),
        )
        self.store._commit_manifest(manifest)
        return manifest
