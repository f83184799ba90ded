"""`train.state_every`: the weights and optimizer state are stored every k-th step; a policy between two
stored states is rebuilt by replaying the committed updates after the older one, bit for bit on the CPU."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from rlvr.storage.policy_chain import PolicyChain, holds_weights, policy_chain, weights_needed
from rlvr.storage.stage import _replace_transient, prune_transient, rows_to_table
from rlvr.storage.store import Store
from tests.cli_helpers import FolderChanges, committed, store_folders

RUN = "r"


def _write(store: Store, aid: str, kind: str, step: int, **extra: object) -> None:
    config = extra.pop("config", {})
    store.write_artifact(
        kind,
        aid,
        rows_to_table(kind, [{"run_id": RUN, "step": step}]),
        run_id=RUN,
        stage="train" if kind != "checkpoints" else "initialize",
        parents=[],
        code_version="1",
        config=config,  # type: ignore[arg-type]
        step=step,
        extra=extra,
    )


def _train_step(store: Store, step: int, previous: str, every: int, stored: bool) -> str:
    """Fake manifests of one train step: its train_steps and its train_state (with or without weights)."""
    state = f"train_state-{step:020d}"
    _write(store, state, "train_state", step, **({} if stored else {"weights": False}))
    steps = f"train_steps-{step:020d}"
    record = {"outputs": {"train_state": state, "train_steps": steps}, "inputs": {"policy": [previous]}}
    _write(store, steps, "train_steps", step, stage_run=record, config={"state_every": every} if every > 1 else {})
    return steps


def test_policy_chain_replays_back_to_the_newest_stored_state(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    _write(store, "checkpoints-00000000000000000000", "checkpoints", 0)
    refs = ["checkpoints-00000000000000000000"]
    for step in range(1, 6):
        refs.append(_train_step(store, step, refs[-1], every=3, stored=step % 3 == 0))
    assert policy_chain(store, refs[1]) == PolicyChain(base=refs[0], replay=(refs[1],))
    assert policy_chain(store, refs[2]) == PolicyChain(base=refs[0], replay=(refs[1], refs[2]))
    assert policy_chain(store, refs[3]) == PolicyChain(base=refs[3])
    assert policy_chain(store, refs[5]) == PolicyChain(base=refs[3], replay=(refs[4], refs[5]))
    assert weights_needed(store, refs[5]) == ["train_state-00000000000000000003"]
    assert weights_needed(store, refs[2]) == []  # a checkpoint is kept forever
    store.delete_artifact("train_state-00000000000000000003")  # a stored state that has been replaced
    assert policy_chain(store, refs[5]) is None
    assert policy_chain(store, refs[3]) is None


def test_a_step_that_stored_every_time_cannot_be_replayed_once_its_state_is_gone(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    _write(store, "checkpoints-00000000000000000000", "checkpoints", 0)
    one = _train_step(store, 1, "checkpoints-00000000000000000000", every=1, stored=True)
    two = _train_step(store, 2, one, every=1, stored=True)
    store.delete_artifact("train_state-00000000000000000001")
    assert policy_chain(store, one) is None  # state_every 1: its weights were stored, and are gone
    assert policy_chain(store, two) == PolicyChain(base=two)


def test_a_state_deleted_while_its_chain_is_read_holds_no_weights(tmp_path, monkeypatch):
    """The run's background commit deletes a replaced trainer state between `exists` and the manifest's read
    (here: `exists` still says yes after the delete): the chain replays past it instead of failing."""
    store = Store.open(str(tmp_path / "s"), create=True)
    _write(store, "checkpoints-00000000000000000000", "checkpoints", 0)
    one = _train_step(store, 1, "checkpoints-00000000000000000000", every=10, stored=False)
    two = _train_step(store, 2, one, every=10, stored=False)
    store.delete_artifact("train_state-00000000000000000001")
    monkeypatch.setattr(store, "exists", lambda artifact_id: True)  # the answer read just before the delete
    assert holds_weights(store, "train_state-00000000000000000001") is False
    assert policy_chain(store, two) == PolicyChain(base="checkpoints-00000000000000000000", replay=(one, two))


def test_replacing_the_trainer_state_keeps_what_the_newest_needs(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    states = [f"train_state-{step:020d}" for step in range(8)]
    needs = {1: (), 2: (), 3: (), 4: (states[3],), 5: (states[3],), 6: (), 7: (states[6],)}
    stored = lambda: sorted(m.artifact_id for m in store.manifests(kind="train_state"))  # noqa: E731
    for step in range(1, 8):
        _write(store, states[step], "train_state", step)
        _replace_transient(store, "train_state", RUN, states[step], needs[step])
        expected = {states[step], *needs[step]}
        assert stored() == sorted(expected), step  # the previous step's state, and what only it needed, are gone
    _write(store, states[1], "train_state", 1)  # a leftover of a crash, found by the next process's first prune
    _write(store, "train_state-x", "train_state", 8, weights=False, needs=[states[7]])
    assert sorted(prune_transient(store, "train_state", RUN, "train_state-x")) == [states[1], states[6]]
    assert stored() == sorted(["train_state-x", states[7]])


OVERRIDES = [
    "train.steps=6",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=5",
    "difficulty.k=2",
    "evaluate.every=6",
    "checkpoint.every=6",
    "synthesize.source.per_category=6",
    "select.type=sec",
    "allocate.type=knapsack",
]


def _command(store: Path, *sets: str) -> list[str]:
    """The `rlvr` arguments of the run."""
    args = ["run", "--store", str(store), "--run-id", "k"]
    for item in [*OVERRIDES, *sets]:
        args += ["--set", item]
    return args


def _run_here(store: Path, *sets: str) -> None:
    """The run `_command` starts, made in this process (`execute`, what `rlvr run` calls): an interpreter's
    imports spared (about 9 CPU-s) where the test is not about the process."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    execute(str(store), load_config(None, ["run_id=k", *OVERRIDES, *sets]), new=True)


def _final_weights(store: Path) -> bytes:
    s = Store.open(str(store))
    final = max(s.manifests(kind="checkpoints"), key=lambda m: m.step or 0)
    return s.read_file(final.artifact_id, "model.safetensors")


def _train_steps(store: Path) -> dict[int, str]:
    return {m.step or 0: m.artifact_id for m in Store.open(str(store)).manifests(kind="train_steps")}


@pytest.mark.slow
def test_a_run_killed_between_stored_states_resumes_to_the_same_weights(tmp_path, rlvr_forks):
    """Killed after step 4 (whose state was not stored), the resumed run rebuilds step 4's policy from step 3's
    state and ends with the weights of an uninterrupted run, and of a run that stored every step. The killed run is
    an `rlvr run` process (forked by the worker's ForkServer); the resume (`resume`, what `rlvr resume` calls) and
    the other two runs run here."""
    from rlvr.flows.runs import resume

    every_step, reference, killed = tmp_path / "every", tmp_path / "reference", tmp_path / "killed"
    proc = rlvr_forks.start(_command(killed, "train.state_every=3"))
    deadline = time.monotonic() + 300
    with FolderChanges() as changes:  # checked as each manifest is committed: a tiny step is over in a blink
        changes.watch(store_folders(killed))
        while committed(killed, "train_steps") < 4:  # a listing, not a Store: cheaper than opening one
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 4 committed"
            changes.wait(every=0.05)
            changes.watch(store_folders(killed))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = Store.open(str(killed))
    steps = _train_steps(killed)
    assert sorted(steps) == [1, 2, 3, 4], "the kill was meant to land between steps 4 and 5"
    assert policy_chain(store, steps[4]) == PolicyChain(base=steps[3], replay=(steps[4],))  # step 5 replays step 4
    resume(str(killed), "k")  # before the runs below: this process holds no live policy of these ids (a failure raises)
    _run_here(every_step)
    _run_here(reference, "train.state_every=3")
    ids = lambda root: sorted(m.artifact_id for m in Store.open(str(root)).manifests())  # noqa: E731
    assert ids(killed) == ids(reference)
    assert _final_weights(killed) == _final_weights(reference) == _final_weights(every_step)
    states = Store.open(str(reference)).manifests(kind="train_state")
    assert [(m.step, m.extra.get("weights", True)) for m in states] == [(6, True)]
    files = {f["path"] for f in states[0].files}
    assert {"files/model.safetensors", "files/optimizer.safetensors"} <= files
