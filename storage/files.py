"""Reading and checking the store's files: whole reads, checksums against a manifest entry, shard markers, the
one-line messages of damage, durable writes (fsync), and the one line an unreachable store gets."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from rlvr.errors import UserError
from rlvr.storage.manifest import Manifest, basename, sha256_hex

SHARD_MARKER_RE = re.compile(r"^part-(\d{5})\.json$")
HASH_CHUNK = 1 << 20


def open_new(path: str) -> Any:
    """Open `path` for writing, making its directory only when it is missing (a stat saved per file)."""
    try:
        return open(path, "wb")
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")


@lru_cache(maxsize=1)
def fsync_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="rlvr-fsync")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def reaching(root: str) -> Iterator[None]:
    """A store that cannot be reached (no bucket, no credentials, no server) is one line, not a traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
        hint = ""
        if root.startswith(("s3://", "s3a://")):
            hint = (
                "; the bucket must exist, and s3fs reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile)"
                " and, for an S3-compatible server, AWS_ENDPOINT_URL"
            )
        raise UserError(f"cannot reach the store at {root}: {reason}{hint}") from exc


def read_whole(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """A whole (non-empty) file in one request. A plain `cat_file` on s3fs asks for the size first (a
    HEAD, to split large downloads); a range from byte 0 needs no size. For the store's small files."""
    return bytes(fs.cat_file(path, start=0))


def file_checksum(fs: fsspec.AbstractFileSystem, path: str, size: int) -> str | None:
    """The sha256 of the file, or None when its size is not `size` (a file cut short by a crash)."""
    if not isinstance(fs, LocalFileSystem):
        data = read_whole(fs, path)
        return sha256_hex(data) if len(data) == size else None
    if fs.size(path) != size:
        return None
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_damage(data: bytes | None, entry: Mapping[str, Any]) -> str | None:
    """What is wrong with a file's bytes (None: missing) against its manifest entry, or None when they match."""
    if data is None:
        return "the file is missing"
    if len(data) != entry["bytes"]:
        return f"{len(data)} bytes where the manifest recorded {entry['bytes']}"
    if sha256_hex(data) != entry["sha256"]:
        return f"sha256 {sha256_hex(data)[:12]}... where the manifest recorded {entry['sha256'][:12]}..."
    return None


def file_problem(fs: fsspec.AbstractFileSystem, path: str, entry: Mapping[str, Any]) -> str | None:
    """`file_damage` without holding a large file in memory (weights are hashed in chunks)."""
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return "the file is missing"
    if size != entry["bytes"]:
        return f"{size} bytes where the manifest recorded {entry['bytes']}"
    digest = file_checksum(fs, path, size)
    if digest != entry["sha256"]:
        return f"sha256 {str(digest)[:12]}... where the manifest recorded {entry['sha256'][:12]}..."
    return None


def parquet_problem(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """A part whose bytes match its manifest but that Parquet cannot read (a bad file was committed)."""
    try:
        with fs.open(path, "rb") as handle:
            pq.ParquetFile(handle).metadata  # noqa: B018 - reading the footer is the check
    except (pa.ArrowException, OSError) as exc:
        return f"not readable Parquet ({exc})"
    return None


def damage_message(manifest: Manifest, path: str, problem: str) -> str:
    """The one line a damaged file of a committed artifact gets: which, what is wrong, what to do."""
    step = f" step {manifest.step}" if manifest.step is not None else ""
    return (
        f"{manifest.kind} artifact {manifest.artifact_id} (run {manifest.run_id}{step}) is damaged: {path}: {problem}; "
        f"`rlvr check` lists all damage and `rlvr resume {manifest.run_id}` rebuilds what can be rebuilt"
    )


def valid_shards(fs: fsspec.AbstractFileSystem, artifact_dir: str) -> dict[int, dict[str, Any]]:
    """The shard markers of an artifact directory whose data file exists and matches, by index."""
    markers_dir = f"{artifact_dir}/_shards"
    fs.invalidate_cache(markers_dir)  # shards another process (a killed run) wrote count too
    valid: dict[int, dict[str, Any]] = {}
    for marker_path in sorted(fs.find(markers_dir)):  # [] when there is no such directory
        match = SHARD_MARKER_RE.match(basename(marker_path))
        if match is None:
            continue
        try:
            marker = json.loads(read_whole(fs, marker_path))
            if file_checksum(fs, f"{artifact_dir}/{marker['path']}", marker["bytes"]) == marker["sha256"]:
                valid[int(match.group(1))] = marker
        except (FileNotFoundError, KeyError, ValueError):
            continue
    return valid
