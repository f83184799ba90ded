"""Damage in a store: files that no longer match their manifests, and what a resume can rebuild.

`find_damage` checks committed artifacts (each file's size and sha256 against its manifest, and that each
Parquet part reads) and lists manifests that cannot be read at all. `rebuild_blocker` says whether the
stage that made a damaged artifact can run again: its inputs must still be stored and intact, and a policy
input needs its weights. Only a run's newest `train_state` is kept, so the rollouts of an older step cannot
be sampled again, while its rewards can be labelled again from its rollouts.

`repair_run`, called whenever a run starts (so by `rlvr resume`), sets the run's rebuildable damaged
artifacts aside: their manifests move to `damaged/`, so the artifact no longer exists and the run's stage
makes it again, with the same id and the same bytes (a stage is a pure function of its inputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from rlvr.storage.errors import DamagedFile
from rlvr.storage.leases import RunClaimed, live_runs, newest_lease_number, owning
from rlvr.storage.manifest import Manifest
from rlvr.storage.policy_chain import policy_chain, train_state_of
from rlvr.storage.processes import heartbeat_timeout_s
from rlvr.storage.store import Store

TRANSIENT_KINDS = frozenset({"train_state"})


@dataclass(frozen=True)
class Damage:
    """One damaged artifact: the first file that fails, what is wrong, and why a resume cannot rebuild
    it (`blocker`; None when it can)."""

    artifact_id: str
    kind: str
    run_id: str | None
    step: int | None
    path: str
    problem: str
    blocker: str | None = None

    @property
    def rebuildable(self) -> bool:
        return self.blocker is None


def find_damage(
    store: Store, run_ids: Collection[str] | None = None, checked: Callable[[Manifest], None] | None = None
) -> list[Damage]:
    """Every damaged committed artifact of the store (or of `run_ids`), with whether a resume rebuilds it.

    `checked` is called after each artifact is verified (a progress bar).
    """
    store.unreadable.clear()
    manifests = store.manifests()
    found = []
    for manifest in manifests:
        if run_ids is not None and manifest.run_id not in run_ids:
            continue
        problems = store.verify_artifact(manifest.artifact_id)
        if problems:
            path, problem = problems[0]
            more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
            found.append(
                Damage(manifest.artifact_id, manifest.kind, manifest.run_id, manifest.step, path, problem + more)
            )
        if checked is not None:
            checked(manifest)
    found += [d for d in unreadable_manifests(store) if run_ids is None or d.run_id in run_ids]
    damaged = {d.artifact_id for d in found}
    judged = {d.artifact_id: replace(d, blocker=rebuild_blocker(store, d, damaged)) for d in found}
    return list(_blocked_by_inputs(store, judged).values())


def _blocked_by_inputs(store: Store, judged: dict[str, Damage]) -> dict[str, Damage]:
    """An artifact whose input is damaged beyond rebuilding cannot be rebuilt either (repeated to a fixed point)."""
    changed = True
    while changed:
        changed = False
        for aid, damage in judged.items():
            if damage.blocker is not None:
                continue
            try:
                parents = store.manifest(aid).parents
            except DamagedFile:
                continue
            stuck = next((p for p in parents if p in judged and judged[p].blocker is not None), None)
            if stuck is not None:
                judged[aid] = replace(damage, blocker=f"its input {stuck} is damaged too and cannot be rebuilt")
                changed = True
    return judged


def unreadable_manifests(store: Store) -> list[Damage]:
    """The manifests the last listing could not read; the run comes from the artifact folder's owner mark."""
    found = []
    manifests_dir = store.path("manifests")
    for path, reason in sorted(store.unreadable.items()):
        stripped = store.fs._strip_protocol(path).rstrip("/")
        if not stripped.startswith(store.fs._strip_protocol(manifests_dir)):
            continue  # a run record: not an artifact
        artifact_id = stripped.rsplit("/", 1)[-1].removesuffix(".json")
        kind = _kind_of(store, artifact_id)
        owner = store.owner_of(store.artifact_dir(kind, artifact_id))
        found.append(Damage(artifact_id, kind, owner, None, path, reason.split(" is unreadable ", 1)[-1]))
    return found


def _kind_of(store: Store, artifact_id: str) -> str:
    """The kind of an artifact whose manifest cannot be read: the folder holding its files (ids made by the
    runner start with their kind, which is tried first), else that prefix."""
    guess = artifact_id.rsplit("-", 1)[0]
    if store.fs.exists(store.artifact_dir(guess, artifact_id)):
        return guess
    try:
        kinds = [path.rstrip("/").rsplit("/", 1)[-1] for path in store.fs.ls(store.path("artifacts"), detail=False)]
    except FileNotFoundError:
        return guess
    return next((kind for kind in kinds if store.fs.exists(store.artifact_dir(kind, artifact_id))), guess)


def rebuild_blocker(store: Store, damage: Damage, damaged: Collection[str]) -> str | None:
    """Why the stage that made this artifact cannot make it again now, or None when it can."""
    if damage.kind in TRANSIENT_KINDS:
        return (
            "a trainer state is remade only by its train step, which needs the state before it, and only the "
            "newest is kept; start a new run from the last checkpoint (--set policy.checkpoint=ID)"
        )
    try:
        manifest = store.manifest(damage.artifact_id)
    except DamagedFile:
        return None  # its inputs are unknown: its stage remakes it if they are still there
    for parent in manifest.parents:
        blocker = _input_blocker(store, parent, damaged)
        if blocker is not None:
            return blocker
    return None


def _input_blocker(store: Store, parent: str, damaged: Collection[str]) -> str | None:
    if not store.exists(parent):
        return f"its input {parent} is no longer stored"
    try:
        manifest = store.manifest(parent)
    except DamagedFile:
        return f"the manifest of its input {parent} is unreadable"
    if manifest.kind != "train_steps":
        return None
    chain = policy_chain(store, parent)
    if chain is None:
        return (
            f"it needs the weights of the policy after step {manifest.step} ({parent}), and only the run's "
            "newest trainer state is kept"
        )
    base = chain.base  # where its weights are stored (the steps after it are replayed)
    weights = train_state_of(store, base) if store.manifest(base).kind == "train_steps" else base
    if weights in damaged:
        return f"the weights of its input policy ({weights}) are damaged too, and only a train step remakes them"
    return None


def repair_run(store: Store, run_id: str) -> list[str]:
    """Set the run's damaged artifacts that a resume can rebuild aside, and say what was found: one line
    each, for the run's warnings. Damage that cannot be rebuilt is left in place and reported; the run
    fails with a one-line DamagedArtifact only if it reads that artifact again."""
    lines = []
    for damage in find_damage(store, {run_id}):
        where = f"{damage.kind} {damage.artifact_id}" + (f" (step {damage.step})" if damage.step is not None else "")
        found = f"{where} is damaged ({damage.path}: {damage.problem})"
        if damage.rebuildable:
            store.set_aside(damage.artifact_id)
            lines.append(f"{found}; set aside, this run rebuilds it")
        else:
            lines.append(f"{found} and cannot be rebuilt: {damage.blocker}")
    return lines


@dataclass(frozen=True)
class Leftovers:
    """Uncommitted artifact folders of one run (None: a folder that names no run), and whether a live
    process owns that run (then they are its work in flight, not leftovers)."""

    run_id: str | None
    folders: tuple[str, ...]
    live: bool


def find_leftovers(store: Store) -> list[Leftovers]:
    """Uncommitted artifact folders, grouped by the run that writes them."""
    by_run: dict[str | None, list[str]] = {}
    for folder in store.uncommitted_dirs():
        by_run.setdefault(store.owner_of(folder), []).append(folder)
    live = live_runs(store)
    return [
        Leftovers(run_id, tuple(folders), run_id is not None and run_id in live)
        for run_id, folders in sorted(by_run.items(), key=lambda item: str(item[0]))
    ]


def clean_leftovers(store: Store) -> list[str]:
    """Remove what killed writers left in the whole store, never touching a live run's work: each dead run's
    folders while owning that run (so it cannot be resumed meanwhile), folders that name no run once
    nothing in them changed for longer than the heartbeat timeout, and temp files of dead writers."""
    removed = store.remove_dead_temp_files()
    for group in find_leftovers(store):
        if group.live:
            continue
        if group.run_id is None or newest_lease_number(store, group.run_id) is None:
            removed += [
                p for folder in group.folders if _idle(store, folder) for p in store.cleanup_artifact_dir(folder)
            ]
            continue
        try:
            with owning(store, group.run_id, purpose="cleanup"):
                removed += store.cleanup_run(group.run_id)
        except RunClaimed:
            continue  # it was resumed meanwhile: its folders are work in flight again
    return removed


def _idle(store: Store, folder: str) -> bool:
    """Whether nothing in `folder` changed for longer than the heartbeat timeout (no writer is that slow). The
    folder's own time counts: a folder made a moment ago, before its owner mark is written, is not idle."""
    newest = 0.0
    try:
        entries = [store.fs.info(folder), *store.fs.find(folder, detail=True).values()]
    except FileNotFoundError:
        return False  # removed meanwhile: nothing to clean
    for info in entries:
        modified = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
        stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0.0)
        newest = max(newest, stamp)
    return time.time() - newest > heartbeat_timeout_s()
