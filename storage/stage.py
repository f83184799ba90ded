"""Stages, and the one runner that executes every stage the same way.

A stage declares what it is (name, code version, config section), what it reads (named inputs, each an
artifact id) and what it writes (named outputs: an artifact kind each, sharded or not, durable or
transient). Its `build` is a plain function of its inputs, its config and a small context that returns
the rows (and files) of each output; it never touches the store itself. The runner does the rest:

- ids: an output's id hashes (kind, stage, code version, the config that affects it, input ids, run,
  step), so the same work always has the same id (storage/ids.py); where the work ran (the params in
  EXECUTION_PARAMS) is never part of it;
- skip: when every durable output is committed the stage returns at once: that is what resume is;
- inputs: read lazily through a per-process cache of immutable tables (an artifact never changes);
- commit: outputs in declared order, a sharded output shard by shard (resume skips committed shards);
  each manifest records the stage run's timings, shown by the `stage_runs` view;
- carried state: a stage with `carries_state` gets the previous step's state dict and returns the
  next one, which is kept in its first output's manifest;
- transient outputs (the trainer state) replace the run's previous one once committed;
- progress: a "stage_run" event per run, for the CLI's progress bar;
- failures: an exception out of a build or commit carries the stage and step (`failed_stage`), and
  observers (`observe_stage_work`) wrap each run that does work: OpenLineage's START/COMPLETE/FAIL events
  (flows/openlineage_events.py) come from one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa
from pydantic import BaseModel

from rlvr.storage.ids import artifact_id, derive_seed
from rlvr.storage.manifest import Manifest, conform_to_schema, utc_now
from rlvr.storage.schemas import OPEN_KINDS, schema_for
from rlvr.storage.store import Store

C = TypeVar("C")
T = TypeVar("T")

# An input is one artifact id, several artifacts of one kind (read as one table), or absent.
InputRef = str | Sequence[str] | None


def input_ids_of(ref: InputRef) -> tuple[str, ...]:
    """The artifact ids an input names, in order."""
    if ref is None:
        return ()
    return (ref,) if isinstance(ref, str) else tuple(ref)


# ----- what a stage declares ----------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One artifact a stage writes.

    `transient`: only the run's newest one is kept (the runner deletes the previous one after the
    commit), so it cannot be required for a skip: a stage is skipped when its durable outputs exist.
    Declare transient outputs first, so a durable output is never committed without them.
    `sharded`: the build returns a `Sharded` for it; each shard commits on its own.
    """

    kind: str
    transient: bool = False
    sharded: bool = False


@dataclass(frozen=True)
class Built:
    """What a build produced for one output: its rows, binary files beside them (weights), manifest
    extras, the carried state (stages with `carries_state`, first output only), and an object to keep
    in this process under the output's id (a live model, so the next stage need not load it)."""

    table: pa.Table
    files: Mapping[str, bytes] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    state: Mapping[str, Any] | None = None
    resident: Any = None
    placed: Sequence[Mapping[str, Any]] = ()  # entries of files other processes wrote (`Store.place_file`)


@dataclass(frozen=True)
class Sharded:
    """A sharded output: `count` shards, shard i made by `make(i)` only if it is not yet committed."""

    count: int
    make: Callable[[int], pa.Table]
    extra: Mapping[str, Any] = field(default_factory=dict)


Products = Built | Sharded | Mapping[str, Built | Sharded]


@dataclass(frozen=True)
class StageContext:
    """What a build may know besides its inputs and config."""

    run_id: str
    seed: int
    step: int | None
    stage: str
    input_ids: Mapping[str, tuple[str, ...]]
    output_ids: Mapping[str, str]
    params: Mapping[str, Any] = field(default_factory=dict)
    state: Mapping[str, Any] | None = None
    store: Store | None = None
    # What the build reports about the hardware its model work used ("device", "peak_memory_bytes": see
    # trainer/devices.py), kept in the stage run's record for the `stage_runs` view; empty for stages without
    # a model. A sharded output's shards may add to it as they are made.
    usage: dict[str, Any] = field(default_factory=dict)

    def derive_seed(self, *parts: Any) -> int:
        """A seed for (run seed, *parts): each stage seeds its own RNG, nothing is carried between them."""
        return derive_seed(self.seed, *parts)


def _jsonable(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


# Params that say only where a stage's work runs, never what it computes: the executor of its units
# (flows/executors.py) and the device of its model (trainer/devices.py). No stage's identity sees them, so
# neither is part of any artifact id.
EXECUTION_PARAMS = frozenset({"fan_out", "device"})


def default_identity(cfg: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """The config that decides a stage's outputs: its whole section plus the params it was given."""
    settings = dict(_jsonable(cfg) or {}) if cfg is not None else {}
    settings.update({key: _jsonable(value) for key, value in params.items()})
    return settings


@dataclass(frozen=True)
class Stage(Generic[C]):
    """A pipeline stage: see the module docstring. `section` names its config in the run config and
    `config` is that section's type (a pydantic model, or a zero-argument callable returning a type
    for sections chosen by `type`, whose choices are known only once everything is registered)."""

    name: str
    code_version: str
    section: str | None
    config: Any
    inputs: tuple[str, ...]
    outputs: Mapping[str, Output]
    build: Callable[[Inputs, C, StageContext], Products]
    identity: Callable[[C, Mapping[str, Any]], dict[str, Any]] = default_identity  # never sees EXECUTION_PARAMS
    carries_state: bool = False
    default: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError(f"stage {self.name!r} declares no outputs")
        if self.carries_state and "state" not in self.inputs:
            raise ValueError(f"stage {self.name!r} carries state, so it needs an input named 'state'")
        seen_durable = False
        for name, output in self.outputs.items():
            seen_durable = seen_durable or not output.transient
            if output.transient and seen_durable:
                raise ValueError(f"stage {self.name!r}: declare transient output {name!r} before durable ones")
        if not seen_durable:
            raise ValueError(f"stage {self.name!r} needs at least one durable output")

    def config_type(self) -> Any:
        """The section's type (resolving a callable)."""
        if isinstance(self.config, type):
            return self.config
        return self.config()

    def settings(self, cfg: Any, params: Mapping[str, Any]) -> dict[str, Any]:
        """The config that decides the outputs: the stage's identity of its section and its params, the
        execution-only params (EXECUTION_PARAMS) left out."""
        return self.identity(cfg, {key: value for key, value in params.items() if key not in EXECUTION_PARAMS})

    def output_ids(
        self, run_id: str, step: int | None, cfg: Any, params: Mapping[str, Any], input_ids: Mapping[str, InputRef]
    ) -> dict[str, str]:
        """The id of every output, from what determines its content."""
        settings = self.settings(cfg, params)
        if step is not None:
            settings = {**settings, "step": step}
        parents = [aid for name in self.inputs for aid in input_ids_of(input_ids.get(name))]
        return {
            name: artifact_id(output.kind, self.name, self.code_version, settings, parents, run_id)
            for name, output in self.outputs.items()
        }


# ----- reading inputs -----------------------------------------------------------------------------


class TableCache:
    """Tables of committed artifacts, kept in memory by id (least recently used out past `max_bytes`).

    Artifacts are immutable, so a cached table can never be stale; a miss reads the store. Tables the
    runner has just committed go in too, so the next stage of a step reads them without touching disk.
    Per process: under another task runner each worker keeps its own, which only costs a re-read.
    """

    def __init__(self, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._tables: OrderedDict[tuple[str, str], pa.Table] = OrderedDict()
        self._bytes = 0

    def get(self, store: Store, artifact_id: str) -> pa.Table:
        key = (store.root, artifact_id)
        table = self._tables.get(key)
        if table is None:
            table = store.read_table(artifact_id)
            self.put(store, artifact_id, table)
        else:
            self._tables.move_to_end(key)
        return table

    def peek(self, store: Store, artifact_id: str) -> pa.Table | None:
        """The table if it is in memory, else None (never reads the store)."""
        return self._tables.get((store.root, artifact_id))

    def put(self, store: Store, artifact_id: str, table: pa.Table) -> None:
        key = (store.root, artifact_id)
        if key in self._tables or table.nbytes > self.max_bytes:
            return
        self._tables[key] = table
        self._bytes += table.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._tables.popitem(last=False)
            self._bytes -= dropped.nbytes

    def clear(self) -> None:
        self._tables.clear()
        self._bytes = 0


TABLES = TableCache()


class Residents:
    """The newest live object (a model and its optimizer) filed under the id of the artifact that holds
    it durably, so the next stage of the same process need not load it from the store. Only one is
    kept, so a large model is never held twice. A miss (a fresh process, another worker) loads from
    the store: the same result, only slower."""

    def __init__(self) -> None:
        self._held: tuple[str, Any] | None = None

    def keep(self, artifact_id: str, obj: Any) -> None:
        self._held = (artifact_id, obj)

    def get(self, artifact_id: str) -> Any:
        return self._held[1] if self._held is not None and self._held[0] == artifact_id else None

    def get_any(self) -> Any:
        """The object held, whatever its id (None when none)."""
        return self._held[1] if self._held is not None else None

    def take(self, artifact_id: str) -> Any:
        """The object, removed: the caller now owns it (and will change it)."""
        held = self.get(artifact_id)
        if held is not None:
            self._held = None
        return held

    def clear(self) -> None:
        self._held = None


RESIDENTS = Residents()


class Inputs:
    """A build's view of its inputs: tables by name, ids, manifests, carried state, and loaded objects.

    Backed by a store, or by plain values (`Inputs.given(...)`) so a build can be tested without one.
    """

    def __init__(
        self, store: Store | None, ids: Mapping[str, InputRef], given: Mapping[str, Any] | None = None
    ) -> None:
        self.store = store
        self.ids = {name: input_ids_of(ref) for name, ref in ids.items()}
        self._given = dict(given or {})
        self.read_seconds = 0.0

    @classmethod
    def given(cls, **values: Any) -> Inputs:
        """Inputs that are already values: tables for table inputs, objects for loaded ones."""
        return cls(None, {name: f"given-{name}" for name in values}, values)

    def id(self, name: str) -> str | None:
        """The artifact id of input `name` (None when absent); an input of several artifacts has no one id."""
        ids = self.ids.get(name, ())
        if len(ids) > 1:
            raise ValueError(f"input {name!r} names {len(ids)} artifacts; read it with table()")
        return ids[0] if ids else None

    def require_id(self, name: str) -> str:
        found = self.id(name)
        if found is None:
            raise ValueError(f"input {name!r} is missing")
        return found

    def table(self, name: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The rows of input `name` (optionally only some columns); several artifacts are concatenated in order."""
        if name in self._given:
            table = self._given[name]
        else:
            ids = self.ids.get(name, ())
            if not ids:
                raise ValueError(f"input {name!r} is missing")
            started = time.perf_counter()
            tables = [TABLES.get(self._require_store(), aid) for aid in ids]
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")
            self.read_seconds += time.perf_counter() - started
        return table.select(list(columns)) if columns is not None else table

    def rows(self, name: str, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
        return self.table(name, columns).to_pylist()

    def manifest(self, name: str) -> Manifest:
        return self._require_store().manifest(self.require_id(name))

    def load(self, name: str, loader: Callable[[Store, str], T]) -> T:
        """An object made from input `name` by `loader(store, id)` (a given value when there is no store)."""
        if name in self._given:
            return self._given[name]
        started = time.perf_counter()
        loaded = loader(self._require_store(), self.require_id(name))
        self.read_seconds += time.perf_counter() - started
        return loaded

    def _require_store(self) -> Store:
        if self.store is None:
            raise ValueError("these inputs have no store; pass the value with Inputs.given(...)")
        return self.store


def carried_state(store: Store, artifact_id: str) -> dict[str, Any]:
    """The state dict a stage carried out of the step that committed `artifact_id`."""
    return dict(store.manifest(artifact_id).extra.get("state") or {})


# ----- running a stage ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageRun:
    """What a run of a stage did: its output ids, whether it was skipped, and where its time went."""

    stage: str
    step: int | None
    ids: Mapping[str, str]
    skipped: bool
    read_seconds: float = 0.0
    build_seconds: float = 0.0
    commit_seconds: float = 0.0

    def __getitem__(self, output: str) -> str:
        return self.ids[output]

    @property
    def id(self) -> str:
        """The id of the first durable output (the one other stages usually take as input)."""
        return next(iter(self.ids.values()))

    def table(self, store: Store, output: str | None = None) -> pa.Table:
        return TABLES.get(store, self.ids[output] if output else self.id)

    def manifest(self, store: Store, output: str | None = None) -> Manifest:
        return store.manifest(self.ids[output] if output else self.id)


def failed_stage(exc: BaseException) -> tuple[str, int | None] | None:
    """The stage (and step) whose build or commit raised `exc`, as the runner noted it on the exception."""
    return getattr(exc, "rlvr_stage", None)


Listener = Callable[[StageRun], None]
_listeners: list[Listener] = []
# (store, stage name, run id, step, input ids, output ids, code version) -> a context around the build and commit
Observer = Callable[[Store, str, str, "int | None", Sequence[str], Sequence[str], str], AbstractContextManager[None]]
_observers: list[Observer] = []


def observe_stage_work(observer: Observer) -> None:
    """Enter `observer(...)` around every stage run of this process that does work (not a skipped one): it sees
    the run start, and its end or the exception. Idempotent: the same observer is kept once."""
    if observer not in _observers:
        _observers.append(observer)


@contextmanager
def _observed(
    store: Store, stage: Stage[Any], run_id: str, step: int | None, inputs: list[str], outputs: list[str]
) -> Iterator[None]:
    with ExitStack() as stack:
        for observer in list(_observers):
            stack.enter_context(observer(store, stage.name, run_id, step, inputs, outputs, stage.code_version))
        yield


def on_stage_run(listener: Listener) -> Callable[[], None]:
    """Call `listener` after every stage run of this process; returns the function that stops it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


_transient_latest: dict[tuple[str, str, str], tuple[str, tuple[str, ...]]] = {}


def run_stage(
    store: Store,
    stage: Stage[C],
    cfg: C,
    *,
    run_id: str,
    seed: int = 0,
    step: int | None = None,
    inputs: Mapping[str, InputRef] | None = None,
    params: Mapping[str, Any] | None = None,
) -> StageRun:
    """Run `stage` unless its durable outputs are committed; return their ids either way.

    `inputs` maps each declared input name to an artifact id, a sequence of ids of one kind, or None.
    """
    input_ids = {name: input_ids_of((inputs or {}).get(name)) for name in stage.inputs}
    unknown = set(inputs or {}) - set(stage.inputs)
    if unknown:
        raise ValueError(f"stage {stage.name!r} has no inputs {sorted(unknown)}; it declares {list(stage.inputs)}")
    params = dict(params or {})
    ids = stage.output_ids(run_id, step, cfg, params, input_ids)
    durable = [ids[name] for name, output in stage.outputs.items() if not output.transient]
    if all(store.exists(aid) for aid in durable):
        result = StageRun(stage.name, step, ids, skipped=True)
    else:
        inputs_read = [aid for refs in input_ids.values() for aid in refs]
        try:
            with _observed(store, stage, run_id, step, inputs_read, list(ids.values())):
                result = _build_and_commit(store, stage, cfg, run_id, seed, step, input_ids, params, ids)
        except BaseException as exc:
            if failed_stage(exc) is None:
                try:
                    exc.rlvr_stage = (stage.name, step)  # type: ignore[attr-defined]
                except AttributeError:
                    pass
            raise
    for listener in list(_listeners):
        listener(result)
    return result


def _build_and_commit(
    store: Store,
    stage: Stage[C],
    cfg: C,
    run_id: str,
    seed: int,
    step: int | None,
    input_ids: dict[str, tuple[str, ...]],
    params: dict[str, Any],
    ids: dict[str, str],
) -> StageRun:
    started_at = utc_now()
    reader = Inputs(store, input_ids)
    previous = input_ids.get("state", ())
    state = carried_state(store, previous[0]) if stage.carries_state and previous else None
    ctx = StageContext(run_id, seed, step, stage.name, input_ids, ids, params, state, store)
    started = time.perf_counter()
    products = _as_mapping(stage, stage.build(reader, cfg, ctx))
    built = time.perf_counter()
    record = {
        "outputs": dict(ids),
        "inputs": {name: list(ids) for name, ids in input_ids.items()},
        "started_at": started_at,
        "read_seconds": round(reader.read_seconds, 6),
        "build_seconds": round(built - started - reader.read_seconds, 6),
        **ctx.usage,
    }
    settings = stage.settings(cfg, params)
    parents = [aid for ids in input_ids.values() for aid in ids]
    common = dict(
        run_id=run_id, stage=stage.name, parents=parents, code_version=stage.code_version, config=settings, step=step
    )
    for name, output in stage.outputs.items():
        product = products[name]
        record["commit_seconds"] = round(time.perf_counter() - built, 6)  # of the outputs before this one
        if isinstance(product, Sharded):
            _commit_sharded(store, output.kind, ids[name], product, record, common, ctx.usage)
        else:
            _commit_built(store, output, ids[name], product, record, common, keeps_state=stage.carries_state)
    # Only once every output is committed may the previous transient one go: until then a resume
    # would still need it to redo this stage.
    for name, output in stage.outputs.items():
        if output.transient:
            needs = products[name].extra.get("needs", []) if isinstance(products[name], Built) else []
            _replace_transient(store, output.kind, run_id, ids[name], tuple(needs))
    commit_seconds = time.perf_counter() - built
    return StageRun(
        stage.name,
        step,
        ids,
        skipped=False,
        read_seconds=reader.read_seconds,
        build_seconds=built - started - reader.read_seconds,
        commit_seconds=commit_seconds,
    )


def _as_mapping(stage: Stage[Any], products: Products) -> Mapping[str, Built | Sharded]:
    if isinstance(products, (Built, Sharded)):
        if len(stage.outputs) != 1:
            raise ValueError(f"stage {stage.name!r} has {len(stage.outputs)} outputs; its build must return a dict")
        return {next(iter(stage.outputs)): products}
    missing = set(stage.outputs) - set(products)
    if missing:
        raise ValueError(f"stage {stage.name!r} built no {sorted(missing)}")
    return products


def _commit_built(
    store: Store,
    output: Output,
    aid: str,
    built: Built,
    record: dict[str, Any],
    common: dict[str, Any],
    keeps_state: bool,
) -> None:
    """Commit one output (unless a crashed earlier attempt already did) and keep its live object."""
    extra = {**built.extra, "stage_run": dict(record)}
    if keeps_state and built.state is not None:
        extra["state"] = dict(built.state)
    if not store.exists(aid):
        table = conform_to_schema(output.kind, built.table)
        files = dict(built.files) or None
        store.write_artifact(output.kind, aid, table, files=files, extra=extra, placed=built.placed, **common)
        TABLES.put(store, aid, table)
    if built.resident is not None:
        RESIDENTS.keep(aid, built.resident)


def _commit_sharded(
    store: Store,
    kind: str,
    aid: str,
    sharded: Sharded,
    record: dict[str, Any],
    common: dict[str, Any],
    usage: dict[str, Any],
) -> None:
    """Write the shards not yet committed, then the manifest; the shards' making counts as build time, and
    what they report in `usage` goes in the record."""
    writer = store.writer(kind, aid, extra=dict(sharded.extra), **common)
    done = writer.committed_shards()
    for index in range(sharded.count):
        if index not in done:
            started = time.perf_counter()
            table = sharded.make(index)
            record["build_seconds"] = round(record["build_seconds"] + time.perf_counter() - started, 6)
            writer.write_shard(index, table)
    writer.extra["stage_run"] = {**record, **usage}
    writer.commit(expected_shards=sharded.count)


def _replace_transient(store: Store, kind: str, run_id: str, keep: str, needs: tuple[str, ...] = ()) -> None:
    """Delete the run's other artifacts of this transient kind, except those `keep` needs (`needs` in its
    manifest: the stored trainer state a train step between stored states is rebuilt from). The first
    time in a process every one found in the store goes: a crash between a commit and a delete can
    leave one behind."""
    key = (store.root, run_id, kind)
    previous = _transient_latest.get(key)
    if previous is None:
        candidates = [m.artifact_id for m in store.manifests(kind=kind, run_id=run_id)]
    else:
        candidates = [aid for aid in (previous[0], *previous[1]) if store.exists(aid)]
    kept = {keep, *needs}
    for aid in dict.fromkeys(candidates):
        if aid not in kept:
            store.delete_artifact(aid)
    _transient_latest[key] = (keep, needs)


def prune_transient(store: Store, kind: str, run_id: str, keep: str) -> list[str]:
    """Delete every artifact of a transient kind of the run except `keep` and what it needs; returns the
    deleted ids."""
    needs = tuple(store.manifest(keep).extra.get("needs", ())) if keep and store.exists(keep) else ()
    stale = [m.artifact_id for m in store.manifests(kind=kind, run_id=run_id) if m.artifact_id not in {keep, *needs}]
    for aid in stale:
        store.delete_artifact(aid)
    _transient_latest[(store.root, run_id, kind)] = (keep, needs)
    return stale


def rows_to_table(kind: str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows as a table with the declared schema of `kind` (columns in schema order); an open kind's
    rows may leave declared columns out (null) and add their own after them."""
    schema = schema_for(kind)
    if schema is None:
        return pa.Table.from_pylist(list(rows))
    declared = pa.Table.from_pydict({name: [row.get(name) for row in rows] for name in schema.names}, schema=schema)
    if kind not in OPEN_KINDS:
        return declared
    extra_names = sorted({key for row in rows for key in row} - set(schema.names))
    if not extra_names:
        return declared
    extra = pa.Table.from_pylist([{name: row.get(name) for name in extra_names} for row in rows])
    return pa.Table.from_arrays([*declared.columns, *extra.columns], names=[*schema.names, *extra_names])
