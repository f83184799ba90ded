"""The stage protocol every Prefect task follows: compute the output id, skip if committed, else build and commit.

Because ids are content-addressed (stage, code version, config, parent ids, run id), a stage whose
output id already has a manifest has already done exactly this work: resume skips it. A stage
therefore never needs to know whether it runs for the first time or after a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import pyarrow as pa

from rlvr.storage.ids import artifact_id
from rlvr.storage.schemas import schema_for
from rlvr.storage.store import Store


@lru_cache(maxsize=8)
def open_store(root: str) -> Store:
    """One Store object per root and process, so its manifest cache is shared by all stages."""
    return Store.open(root)


@dataclass(frozen=True)
class StageOutput:
    """Everything that names one artifact a stage will produce."""

    kind: str
    stage: str
    code_version: str
    run_id: str
    parents: tuple[str, ...]
    config: Mapping[str, Any] = field(default_factory=dict)
    step: int | None = None

    @property
    def artifact_id(self) -> str:
        config = dict(self.config)
        if self.step is not None:
            config["step"] = self.step
        return artifact_id(
            self.kind, self.stage, self.code_version, config, list(self.parents), self.run_id
        )


@dataclass(frozen=True)
class Built:
    """What a stage computed: the rows, plus binary files (weights) to keep beside them."""

    table: pa.Table
    files: Mapping[str, bytes] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


def commit_stage(store: Store, out: StageOutput, build: Callable[[], Built]) -> str:
    """Return `out`'s artifact id, calling `build` and committing its result only if not yet committed."""
    aid = out.artifact_id
    if store.exists(aid):
        return aid
    built = build()
    store.write_artifact(
        out.kind,
        aid,
        built.table,
        run_id=out.run_id,
        stage=out.stage,
        parents=list(out.parents),
        code_version=out.code_version,
        config=dict(out.config),
        step=out.step,
        files=dict(built.files) or None,
        extra=dict(built.extra) or None,
    )
    return aid


def rows_to_table(kind: str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows as a table with the declared schema of `kind` (columns in schema order)."""
    schema = schema_for(kind)
    if schema is None:
        return pa.Table.from_pylist(list(rows))
    return pa.Table.from_pylist(list(rows), schema=schema)
