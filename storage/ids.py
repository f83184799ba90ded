"""Content-addressed ids and derived seeds: the reason resume and caching are exact.

An artifact's id is a hash of everything that determines its content (kind, stage, code version,
config, parent ids, run id), so re-running a stage with the same inputs finds the committed artifact
instead of producing a second one. Seeds are derived the same way, so no RNG state has to travel
between processes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


def canonical_json(obj: Any) -> str:
    """One stable text per value (sorted keys, no spaces), so equal values always hash equally."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def artifact_id(
    kind: str,
    stage: str,
    code_version: str,
    config: Mapping[str, Any],
    parents: Sequence[str],
    run_id: str,
) -> str:
    """The id of the artifact these inputs produce; parents keep their order because it is meaningful."""
    payload = {
        "kind": kind,
        "stage": stage,
        "code_version": code_version,
        "config": dict(config),
        "parents": list(parents),
        "run_id": run_id,
    }
    return f"{kind}-{_sha256_hex(canonical_json(payload))[:20]}"


def row_id(prefix: str, *parts: Any) -> str:
    """A stable id for one row (a problem, a rollout) from what identifies it, e.g. row_id("p", seed, i)."""
    return f"{prefix}-{_sha256_hex(canonical_json(list(parts)))[:16]}"


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from e.g. (run seed, step, stage): each stage seeds its RNG without shared state."""
    digest = hashlib.sha256(canonical_json(list(parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1
