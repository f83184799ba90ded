"""A committed artifact's manifest (its catalog row and commit marker), and how its Parquet parts are made:
schema conformance, deterministic Parquet bytes, part names."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlvr.storage.errors import DamagedFile, unreadable_message
from rlvr.storage.schemas import OPEN_KINDS, schema_for


def utc_now() -> str:
    """Timestamps are ISO UTC strings with a fixed width, so sorting the strings sorts the times."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def part_name(index: int) -> str:
    """The file name of data part `index`; the zero padding keeps name order equal to index order."""
    return f"part-{index:05d}.parquet"


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The commit record of one artifact and its row in the catalog; immutable once written."""

    artifact_id: str
    kind: str
    run_id: str
    stage: str
    step: int | None
    rows: int
    schema: str
    files: list[dict[str, Any]]
    parents: list[str]
    code_version: str
    config: dict[str, Any]
    created_at: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    # The number of the run's lease its writer held (storage/leases.py: the fencing token checked at the commit);
    # None for a writer without one, and in manifests written before leases were recorded.
    lease: int | None = None

    def to_json(self) -> str:
        """Indented so a person can read a manifest with `cat`."""
        return json.dumps(asdict(self), sort_keys=True, indent=2, ensure_ascii=False, default=str)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest written by `to_json`."""
        return cls(**json.loads(text))

    @classmethod
    def from_file(cls, path: str, text: str | bytes) -> Manifest:
        """Parse the manifest read from `path`; a DamagedFile naming it when it is not one."""
        try:
            manifest = cls.from_json(text)
            if not isinstance(manifest.files, list) or not all(isinstance(e, dict) for e in manifest.files):
                raise ValueError("its file list is not a list of entries")
            return manifest
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise DamagedFile(unreadable_message("manifest", path, exc)) from None

    @property
    def table_files(self) -> list[dict[str, Any]]:
        """The Parquet parts, in order (binary files have rows=None)."""
        return [entry for entry in self.files if entry["rows"] is not None]

    @property
    def binary_files(self) -> list[dict[str, Any]]:
        """The binary files (model weights, ...) that live beside the Parquet parts."""
        return [entry for entry in self.files if entry["rows"] is None]


def conform_to_schema(kind: str, table: pa.Table) -> pa.Table:
    """Cast `table` to the declared schema of `kind`, so every artifact of a kind has the same columns.

    Kinds without a declared schema keep their own columns (extensions add kinds freely); open kinds
    (`OPEN_KINDS`) keep extra columns after the declared ones.
    """
    schema = schema_for(kind)
    if schema is None:
        return table.replace_schema_metadata(None)
    if table.schema.equals(schema, check_metadata=True):
        return table  # already conformed (the runner conforms before it writes and caches)
    expected = schema.names
    actual = table.column_names
    missing = [name for name in expected if name not in actual]
    extra = [name for name in actual if name not in expected]
    duplicated = sorted({name for name in actual if actual.count(name) > 1})
    if kind in OPEN_KINDS and not missing and not duplicated:
        declared = table.select(expected).cast(schema)
        return pa.Table.from_arrays(
            [*declared.columns, *(table.column(name) for name in extra)], names=[*expected, *extra]
        )
    if missing or extra or duplicated:
        raise ValueError(
            f"{kind} table does not match its declared schema (storage/schemas.py): "
            f"missing columns {missing}, extra columns {extra}, duplicated columns {duplicated}; "
            f"expected exactly {expected}"
        )
    try:
        return table.select(expected).cast(schema)
    except pa.ArrowException as exc:
        raise ValueError(f"{kind} table has a column that cannot be cast to its declared type: {exc}") from exc


def parquet_bytes(table: pa.Table) -> bytes:
    """Serialize in memory so the checksum is computed over exactly the bytes that are written.

    Without dictionary encoding: on the small tables of an RL step it costs a third of the write
    time for a few percent of size that snappy mostly wins back.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, use_dictionary=False)
    return sink.getvalue().to_pybytes()
