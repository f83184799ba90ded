"""OpenLineage events for runs and stage runs: START, then COMPLETE or FAIL, naming the artifacts read and
written as datasets with their schema and row count. Off unless configured.

Turned on by the run config's `openlineage.transport` (any OpenLineage transport: file, http, kafka,
console, ...), or else by the OpenLineage client's own configuration (OPENLINEAGE_CONFIG, an
openlineage.yml in the working directory or ~/.openlineage, OPENLINEAGE__TRANSPORT__* variables,
OPENLINEAGE_URL); OPENLINEAGE_DISABLED=true turns it off. A process resolves the setting once per run:
the runner does it when the run starts, and a worker process of another task runner reads the run's
record from the store, so every process that runs a stage emits.

Naming:
- a stage run is job `rlvr.<stage>` in namespace `openlineage.namespace` (default `rlvr`); its OpenLineage
  run id is a UUID derived from the store and its output artifact ids, so a stage redone after a kill
  completes the run its first attempt started;
- the run is job `rlvr.<kind>_run` (rl or data), run id derived from the store and the rlvr run id, and
  the parent (and root) of every stage run; tags carry the rlvr run id and step;
- an artifact is a dataset named by its artifact id in the store's namespace (the store root as a URI),
  with a `schema` facet (column names and Arrow types) and `inputStatistics`/`outputStatistics` (rows).

A stage skipped because its outputs are committed did no work, so it emits nothing: its events were
sent when it ran. Emitting never fails a stage: an error is a logged warning.

Events are built in the stage's thread and sent, in order, by one daemon thread per emitter, so a slow
transport (an http POST that waits for its timeout) never holds up a stage. The run's COMPLETE or FAIL
waits until every queued event is sent, then closes the client; a process that never sees the run end
(a worker of another task runner) sends what is queued when it exits.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import os
import queue
import threading
import traceback
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError
from rlvr.storage.manifest import utc_now
from rlvr.storage.stage import TABLES, observe_stage_work
from rlvr.storage.store import Store

log = logging.getLogger(__name__)

INTEGRATION = "RLVR"
_UUID_NAMESPACE = uuid.UUID("6c4b2f0e-3c53-5a0e-9a57-0d1f0e6e7a11")  # fixed: derived run ids never change


class OpenLineageConfig(BaseModel):
    """The run config's `openlineage` section. Secrets (an API key) belong in the client's own
    configuration, not here: the run config is stored with the run."""

    model_config = ConfigDict(extra="forbid")

    transport: dict[str, Any] | None = Field(
        None,
        description="an OpenLineage transport, e.g. {type: file, log_file_path: ./events.jsonl, append: true}; "
        "default: the OpenLineage client's own configuration, and no events when there is none",
    )
    namespace: str = Field("rlvr", min_length=1, description="the namespace of the jobs (stages and runs)")


def _producer() -> str:
    try:
        version = metadata.version("rlvr-pipeline")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"urn:rlvr-pipeline:{version}"


def client_configured() -> bool:
    """Whether the OpenLineage client has a configuration of its own (file or environment)."""
    if os.environ.get("OPENLINEAGE_URL"):
        return True
    if any(key.startswith("OPENLINEAGE__TRANSPORT") for key in os.environ):
        return True
    candidates = [os.environ.get("OPENLINEAGE_CONFIG"), "openlineage.yml", "~/.openlineage/openlineage.yml"]
    return any(path and Path(path).expanduser().is_file() for path in candidates)


def dataset_namespace(store_root: str) -> str:
    """The store root as a URI: file:///abs/path for a local store, the fsspec URL otherwise."""
    if "://" in store_root and not store_root.startswith("file://"):
        return store_root.rstrip("/")
    return Path(store_root.removeprefix("file://")).resolve().as_uri()


def derived_run_id(*parts: str) -> str:
    """An OpenLineage run id (a UUID) that is always the same for the same parts."""
    return str(uuid.uuid5(_UUID_NAMESPACE, "\x1f".join(parts)))


@dataclass
class Emitter:
    """Sends one run's events through an OpenLineage client from its own thread; never raises."""

    client: Any
    namespace: str
    datasets: str
    run_id: str
    kind: str = "rl"
    failures: int = 0

    def __post_init__(self) -> None:
        self.producer = _producer()
        self._queue: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._send_queued, name=f"openlineage-{self.run_id}", daemon=True).start()

    @property
    def run_job(self) -> str:
        return f"rlvr.{self.kind}_run"

    @property
    def run_uuid(self) -> str:
        return derived_run_id(self.datasets, "run", self.run_id)

    def emit(self, event: Any) -> None:
        """Queue `event` for the sending thread; returns at once."""
        self._queue.put(event)

    def flush(self) -> None:
        """Wait until every event queued so far has been sent (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, then close the client (at the run's end)."""
        self.flush()
        try:
            self.client.close(timeout=5.0)
        except Exception as exc:
            log.warning("OpenLineage transport did not close cleanly: %s", exc)

    def _send_queued(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self.client.emit(event)
            except Exception as exc:
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning(
                        "OpenLineage event not sent (%d so far): %s: %s", self.failures, type(exc).__name__, exc
                    )
            finally:
                self._queue.task_done()


# ----- resolving the configuration ------------------------------------------------------------------

_emitters: dict[tuple[str, str], Emitter | None] = {}


def _make_client(settings: OpenLineageConfig) -> Any:
    try:
        from openlineage.client import OpenLineageClient
    except ImportError:
        raise UserError(
            "OpenLineage events are configured but openlineage-python is not installed: "
            "pip install 'rlvr-pipeline[lineage]'"
        ) from None
    try:
        if settings.transport is not None:
            return OpenLineageClient(config={"transport": dict(settings.transport)})
        return OpenLineageClient()
    except Exception as exc:
        raise UserError(f"bad OpenLineage transport configuration: {type(exc).__name__}: {exc}") from None


def emitter_for(store_root: str, run_id: str, settings: OpenLineageConfig | None, kind: str = "rl") -> Emitter | None:
    """The run's emitter in this process (None when events are off); a bad configuration is a UserError."""
    settings = settings or OpenLineageConfig()
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return None
    if settings.transport is None and not client_configured():
        return None
    if settings.transport is not None and not settings.transport.get("type"):
        raise UserError("openlineage.transport needs a type (file, http, kafka, console, ...)")
    return Emitter(_make_client(settings), settings.namespace, dataset_namespace(store_root), run_id, kind)


def configure_run(store_root: str, run_id: str, settings: OpenLineageConfig | None, kind: str = "rl") -> None:
    """Resolve (again) where this run's events go in this process; called by the runner as a run starts."""
    _emitters[(store_root, run_id)] = emitter_for(store_root, run_id, settings, kind)


def _emitter(store: Store, run_id: str) -> Emitter | None:
    """The cached emitter, or one resolved from the run's record (a worker process of another runner)."""
    key = (store.root, run_id)
    if key not in _emitters:
        emitter = None
        try:
            emitter = emitter_for(store.root, run_id, *_settings_of_run(store, run_id))
        except Exception as exc:  # never fail a stage over its events
            log.warning("OpenLineage events off for run %s: %s", run_id, exc)
        _emitters[key] = emitter
    return _emitters[key]


def _settings_of_run(store: Store, run_id: str) -> tuple[OpenLineageConfig | None, str]:
    record = store.read_run(run_id) or {}
    section = json.loads(record.get("config_json") or "{}").get("openlineage")
    return (OpenLineageConfig.model_validate(section) if section else None), str(record.get("kind", "rl"))


def forget_runs() -> None:
    """Drop every resolved emitter (tests; a process that changed its OpenLineage environment)."""
    flush_events()
    _emitters.clear()


def flush_events() -> None:
    """Wait until every event this process has queued is sent (tests; a process's exit)."""
    for emitter in list(_emitters.values()):
        if emitter is not None:
            emitter.flush()


atexit.register(flush_events)  # a process's normal exit ...
multiprocessing.util.Finalize(None, flush_events, exitpriority=0)  # ... and a multiprocessing worker's (no atexit)


# ----- events ---------------------------------------------------------------------------------------


def _schema_fields(schema_text: str) -> list[tuple[str, str]]:
    """(name, type) of each top-level column of a manifest's schema (`str(pa.Schema)`)."""
    fields = []
    for line in schema_text.splitlines():
        if not line or line[0].isspace() or line.startswith("--"):
            continue
        name, sep, kind = line.partition(": ")
        if sep:
            fields.append((name, kind.strip()))
    return fields


def _describe(store: Store, artifact_id: str) -> tuple[int, list[tuple[str, str]]]:
    """Rows and columns of a committed artifact: from the table in memory when there is one (a manifest
    read would write a deferred artifact out early), else from its manifest."""
    table = TABLES.peek(store, artifact_id)
    if table is not None:
        return table.num_rows, [(f.name, str(f.type)) for f in table.schema]
    manifest = store.manifest(artifact_id)
    return manifest.rows, _schema_fields(manifest.schema)


def _dataset_facets(fields: Sequence[tuple[str, str]], producer: str) -> dict[str, Any]:
    from openlineage.client.facet_v2 import schema_dataset

    columns = [schema_dataset.SchemaDatasetFacetFields(name=name, type=kind) for name, kind in fields]
    return {"schema": schema_dataset.SchemaDatasetFacet(fields=columns, producer=producer)}


def _datasets(
    emitter: Emitter,
    store: Store,
    artifact_ids: Sequence[str],
    direction: Literal["input", "output"],
    described: bool = True,
) -> list[Any]:
    """The artifacts as input or output datasets with their columns and row counts (by name only when
    not `described`: outputs not committed yet)."""
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.facet_v2 import input_statistics_input_dataset as input_stats
    from openlineage.client.facet_v2 import output_statistics_output_dataset as output_stats

    dataset_class: Any = InputDataset if direction == "input" else OutputDataset
    datasets = []
    for aid in artifact_ids:
        if not described:
            datasets.append(dataset_class(namespace=emitter.datasets, name=aid))
            continue
        rows, fields = _describe(store, aid)
        statistics: dict[str, Any]
        if direction == "input":
            input_facet = input_stats.InputStatisticsInputDatasetFacet(rowCount=rows, producer=emitter.producer)
            statistics = {"inputFacets": {"inputStatistics": input_facet}}
        else:
            output_facet = output_stats.OutputStatisticsOutputDatasetFacet(rowCount=rows, producer=emitter.producer)
            statistics = {"outputFacets": {"outputStatistics": output_facet}}
        datasets.append(
            dataset_class(
                namespace=emitter.datasets,
                name=aid,
                facets=_dataset_facets(fields, emitter.producer),
                **statistics,
            )
        )
    return datasets


def _job(emitter: Emitter, name: str, job_type: str) -> Any:
    from openlineage.client.event_v2 import Job
    from openlineage.client.facet_v2 import job_type_job

    facet = job_type_job.JobTypeJobFacet(
        processingType="BATCH", integration=INTEGRATION, jobType=job_type, producer=emitter.producer
    )
    return Job(namespace=emitter.namespace, name=name, facets={"jobType": facet})


def _run_facets(emitter: Emitter, tags: Mapping[str, Any], parent: bool) -> dict[str, Any]:
    from openlineage.client.facet_v2 import parent_run, tags_run

    facets: dict[str, Any] = {
        "tags": tags_run.TagsRunFacet(
            tags=[
                tags_run.TagsRunFacetFields(key=f"rlvr.{key}", value=str(value), source=INTEGRATION)
                for key, value in tags.items()
                if value is not None
            ],
            producer=emitter.producer,
        )
    }
    if parent:
        run, job = emitter.run_uuid, emitter.run_job
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=run),
            job=parent_run.Job(namespace=emitter.namespace, name=job),
            root=parent_run.Root(
                run=parent_run.RootRun(runId=run), job=parent_run.RootJob(namespace=emitter.namespace, name=job)
            ),
            producer=emitter.producer,
        )
    return facets


def _error_facet(emitter: Emitter, exc: BaseException) -> Any:
    from openlineage.client.facet_v2 import error_message_run

    return error_message_run.ErrorMessageRunFacet(
        message=f"{type(exc).__name__}: {exc}"[:2000],
        programmingLanguage="python",
        stackTrace="".join(traceback.format_exception(exc))[-20000:],
        producer=emitter.producer,
    )


def _event(emitter: Emitter, state: str, run_uuid: str, job: Any, facets: dict[str, Any], **datasets: Any) -> Any:
    from openlineage.client.event_v2 import Run, RunEvent, RunState

    return RunEvent(
        eventType=RunState[state],
        eventTime=utc_now(),
        run=Run(runId=run_uuid, facets=facets),
        job=job,
        producer=emitter.producer,
        **datasets,
    )


@contextmanager
def stage_events(
    store: Store,
    stage: str,
    run_id: str,
    step: int | None,
    input_ids: Sequence[str],
    output_ids: Sequence[str],
    code_version: str = "",
) -> Iterator[None]:
    """START before the body (the build and commit of one stage run), COMPLETE after it, FAIL if it raises."""
    emitter = _emitter(store, run_id)
    if emitter is None:
        yield
        return
    run_uuid = derived_run_id(emitter.datasets, "stage", *output_ids)
    tags = {"run_id": run_id, "stage": stage, "step": step, "code_version": code_version}
    inputs: list[Any] | None = None
    try:
        inputs = _datasets(emitter, store, input_ids, "input")  # committed before the stage: the same in every event
    except Exception as exc:
        emitter.failures += 1
        log.warning("OpenLineage events of stage %s not built: %s: %s", stage, type(exc).__name__, exc)
    if inputs is None:
        yield
        return

    def send(state: str, committed: bool, error: BaseException | None = None) -> None:
        try:
            facets = _run_facets(emitter, tags, parent=True)
            if error is not None:
                facets["errorMessage"] = _error_facet(emitter, error)
            outputs = _datasets(emitter, store, output_ids, "output", described=committed)
            job = _job(emitter, f"rlvr.{stage}", "STAGE")
            emitter.emit(_event(emitter, state, run_uuid, job, facets, inputs=inputs, outputs=outputs))
        except Exception as exc:
            emitter.failures += 1
            log.warning("OpenLineage %s event of stage %s not built: %s: %s", state, stage, type(exc).__name__, exc)

    send("START", committed=False)
    try:
        yield
    except BaseException as exc:
        send("FAIL", committed=False, error=exc)
        raise
    send("COMPLETE", committed=True)


def run_event(store_root: str, run_id: str, state: str, error: BaseException | None = None) -> None:
    """A START, COMPLETE or FAIL event of the whole run (the stage runs' parent), if events are on."""
    emitter = _emitters.get((store_root, run_id))
    if emitter is None:
        return
    try:
        facets = _run_facets(emitter, {"run_id": run_id}, parent=False)
        if error is not None:
            facets["errorMessage"] = _error_facet(emitter, error)
        job = _job(emitter, emitter.run_job, "RUN")
        emitter.emit(_event(emitter, state, emitter.run_uuid, job, facets))
    except Exception as exc:
        log.warning("OpenLineage %s event of run %s not built: %s: %s", state, run_id, type(exc).__name__, exc)
    if state != "START":
        emitter.close()


observe_stage_work(stage_events)  # every process that runs stages through flows/ imports this module
