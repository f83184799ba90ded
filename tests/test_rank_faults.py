"""Faults of a data-parallel run (`train.data_parallel=2`, trainer/ranks/launch.py): a SIGKILL of either rank ends
the whole run within 30 s with one line naming the rank, leaves no rank process behind, and `rlvr resume` then
gives exactly the artifact ids (and, at the same rank count, final weights) of the uninterrupted run, also when
resumed at another rank count.

Both runs share seed, config and run id in different stores, as in tests/test_kill_resume.py; the kill lands
after the third RL step's update is committed, and states are stored every second step, so the resume replays
step 3 from step 2's sharded state. One run is killed in each rank; each of its two resumes starts from a copy of
its store. One more run is killed in rank 1 in each stage the ranks share, one kill in each resume of it: a hook in
the forked process (`kill_rank_1_in_op`) places the kill inside the named operation, and the run's stop line names
that operation.

The kills are of `rlvr run` processes (forked by the worker's ForkServer, tests/fork_server.py). The uninterrupted
run and three of the four resumes run in this process (`execute`, `resume`: what `rlvr run` and `rlvr resume` call;
this process is then rank 0 and starts the other ranks as processes of their own), sparing an interpreter's imports
each (about 9 CPU-s); the first resume goes through `rlvr resume --set train.data_parallel=2`, the command line's
one check here. A run with ranks forgets its live policy when it stops them (flows/rl_run.py, `end_rank_group`), so
no resume here starts from another run's weights in memory, and the resume at 1 rank must stop the ranks its replay
started to pass."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlvr.storage.store import Store
from tests.cli_helpers import FolderChanges, committed, rank_processes, store_folders, wait_for
from tests.fork_server import Forked, ForkServer

pytestmark = pytest.mark.slow

RUN_ID = "ranks"
OVERRIDES = [
    "train.steps=5",
    "train.data_parallel=2",
    "train.state_every=2",  # a resume after step 3 replays it from step 2's sharded state
    "select.batch_size=8",
    "allocate.n=4",
    "warmstart.steps=10",
    "difficulty.k=2",
    "difficulty.shard_size=16",  # three shards on the ranks: a kill can land between two
    "evaluate.every=5",
    "checkpoint.every=5",
    "synthesize.source.per_category=6",
]


def start(
    forks: ForkServer, store: Path, env: dict[str, str], resume_ranks: int | None = None, **hook: object
) -> Forked:
    """`rlvr run`, or with `resume_ranks` `rlvr resume` on that many ranks: a process forked by `forks` (`hook`:
    a child hook and its arguments, tests/fork_server.py)."""
    if resume_ranks is None:
        args, sets = ["run", "--store", str(store), "--run-id", RUN_ID], OVERRIDES
    else:
        args, sets = ["resume", RUN_ID, "--store", str(store)], [f"train.data_parallel={resume_ranks}"]
    for item in sets:
        args += ["--set", item]
    return forks.start(args, env=env, **hook)


def artifact_ids(store: Path) -> list[str]:
    return sorted(m.artifact_id for m in Store.open(str(store)).manifests())


def final_weights(store: Path) -> bytes:
    s = Store.open(str(store))
    final = max(s.manifests(kind="checkpoints"), key=lambda m: m.step)
    return s.read_file(final.artifact_id, "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prefect_api) -> Path:
    """The uninterrupted run, made in this process (`execute`, what `rlvr run` calls); the tests only read it."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    store = tmp_path_factory.mktemp("reference") / "s"
    execute(str(store), load_config(None, [f"run_id={RUN_ID}", *OVERRIDES]), new=True)
    return store


def after_three_updates(store: Path) -> bool:
    return committed(store, "train_steps") >= 3


def between_difficulty_shards(store: Path) -> bool:
    """Some shards of the difficulty stage (decoded on the ranks in lockstep) written, its artifact not."""
    return any(any(shards.iterdir()) for shards in (store / "artifacts" / "difficulty").glob("*/_shards")) and (
        committed(store, "difficulty") == 0
    )


def kill_rank_1_in_op(spec: dict) -> None:
    """A child hook (tests/fork_server.py): SIGKILL rank 1 as rank 0 begins its share of the spec's `kill_op`, the
    `kill_nth` of that name in this process, so the kill lands inside that operation, every rank in it."""
    from rlvr.trainer.ranks import launch

    announce = launch.RankGroup.op
    seen = itertools.count(1)

    @contextmanager
    def op(group: launch.RankGroup, name: str, header: dict | None = None, *blobs: bytes) -> Iterator[None]:
        with announce(group, name, header, *blobs):
            if name == spec["kill_op"] and next(seen) == spec["kill_nth"]:
                os.kill(group.workers[0].pid, signal.SIGKILL)
            yield

    launch.RankGroup.op = op  # type: ignore[method-assign]


def kill_a_rank(
    root: Path,
    forks: ForkServer,
    victim: str,
    moment: Callable[[Path], bool] | tuple[str, int] = after_three_updates,
    resumed: bool = False,
) -> Path:
    """A store whose two-rank run (`resumed`: its `rlvr resume` at 2 ranks) was SIGKILLed in `victim` (rank 0: the
    run's own process) once `moment` held (by default after its third committed update), or, when `moment` is
    (operation, n), in rank 1 inside the run's n-th operation of that name (`kill_rank_1_in_op`); checked to have
    ended as it should: within 30 s, with one line naming a killed rank 1, and leaving no rank process behind."""
    mark = f"rank-faults-{root.name}"
    env = {**forks.env, "RLVR_TEST_MARK": mark}  # the server's environment, marked for rank_processes
    store = root / "s"
    if isinstance(moment, tuple):
        assert victim == "rank 1", "the hook kills rank 1"
        hook = {"hook": "tests.test_rank_faults:kill_rank_1_in_op", "kill_op": moment[0], "kill_nth": moment[1]}
        proc = start(forks, store, env, 2 if resumed else None, **hook)
        killed_at, during = time.monotonic(), f" during operation {moment[0]!r}"
    else:
        proc = start(forks, store, env, 2 if resumed else None)
        watch_until(store, proc, moment)
        (worker,) = rank_processes(mark, parent=proc.pid)
        killed_at, during = time.monotonic(), r"( during operation '\w+')?"
        os.kill(worker if victim == "rank 1" else proc.pid, signal.SIGKILL)
    code = proc.wait(timeout=600 if isinstance(moment, tuple) else 30)
    if victim == "rank 1":
        stderr = proc.stderr_text()
        lines = [line for line in stderr.splitlines() if "data-parallel rank 1" in line]
        assert len(lines) == 1, stderr
        lost = rf"run 'ranks' stopped: data-parallel rank 1 \(pid \d+\) was killed by SIGKILL{during}; "
        assert re.search(lost, lines[0]), lines[0]
        assert "Traceback" not in stderr
        assert code != 0
    else:
        wait_for(lambda: worker not in rank_processes(mark), 30, "the worker rank to exit after rank 0 died")
    assert isinstance(moment, tuple) or time.monotonic() - killed_at < 30
    wait_for(lambda: not rank_processes(mark), 10, "no rank process left")
    return store


def watch_until(store: Path, proc: Forked, moment: Callable[[Path], bool]) -> None:
    """Return as soon as `moment` holds of the run's store (checked as each manifest or shard is written: a tiny
    step is over in a blink)."""
    deadline = time.monotonic() + 600
    difficulty = store / "artifacts" / "difficulty"
    with FolderChanges() as changes:
        changes.watch(store_folders(store, "difficulty"))
        while not moment(store):
            assert proc.poll() is None, proc.stderr_text()[-3000:]
            assert time.monotonic() < deadline, f"{moment.__name__} never held"
            changes.wait(every=0.05)
            changes.watch([*store_folders(store, "difficulty"), *difficulty.glob("*"), *difficulty.glob("*/_shards")])


@pytest.fixture(scope="module")
def killed(tmp_path_factory, rlvr_forks) -> Callable[[str], Path]:
    """The store of a run killed in rank 0 or rank 1 (`kill_a_rank`), made once per victim: each resume below
    starts from a copy, so the two resumes after one victim's kill cost one killed run, not two."""
    made: dict[str, Path] = {}

    def store_killed_in(victim: str) -> Path:
        if victim not in made:
            made[victim] = kill_a_rank(tmp_path_factory.mktemp(victim.replace(" ", "")), rlvr_forks, victim)
        return made[victim]

    return store_killed_in


RESUMED_BY_THE_CLI = ("rank 1", 2)  # `rlvr resume --set train.data_parallel=2`; the other cases call `resume`


@pytest.mark.parametrize(("victim", "resume_ranks"), [("rank 1", 2), ("rank 0", 2), ("rank 1", 1), ("rank 0", 4)])
def test_a_killed_rank_ends_the_run_and_resume_gives_the_uninterrupted_artifacts(
    tmp_path, monkeypatch, rlvr_forks, uninterrupted, killed, victim, resume_ranks
):
    """Resumed at 1 or 4 ranks, the sharded training state saved by 2 is read at the new count (each rank the
    slices it needs): the same artifact ids; the weights then differ from the 2-rank run's by float sums only.
    The first case resumes through the command line, the others in this process (the module docstring)."""
    mark = f"rank-faults-{tmp_path.name}"
    store = tmp_path / "s"
    shutil.copytree(killed(victim), store)  # the killed run as it was left: its leftovers, its dead owner's lease
    assert 3 <= committed(store, "train_steps") < 5  # killed between its third update and its last

    if (victim, resume_ranks) == RESUMED_BY_THE_CLI:
        env = {**rlvr_forks.env, "RLVR_TEST_MARK": mark}
        resumed = start(rlvr_forks, store, env, resume_ranks)
        assert resumed.wait(timeout=900) == 0, resumed.stderr_text()[-3000:]
    else:
        from rlvr.flows.runs import resume

        monkeypatch.setenv("RLVR_TEST_MARK", mark)  # the ranks this process starts inherit it
        resume(str(store), RUN_ID, [f"train.data_parallel={resume_ranks}"])
    assert artifact_ids(store) == artifact_ids(uninterrupted)
    if resume_ranks == 2:
        assert final_weights(store) == final_weights(uninterrupted)
    wait_for(lambda: not rank_processes(mark), 10, "no rank process left after the resumed run")


def test_a_rank_killed_in_each_sharded_stage_resumes_to_the_uninterrupted_artifacts(
    tmp_path, monkeypatch, rlvr_forks, uninterrupted
):
    """Rank 1 SIGKILLed in each stage the ranks share, one after another, each in the `rlvr resume` of the run the
    kill before ended: the first evaluation (its episodes), the warm start (sft), between two of the difficulty
    estimate's shards, the first sharded training state (save_state, after step 2) and the last checkpoint, written
    from the shards (write_weights). Each time the run ends as `kill_a_rank` checks, and a last resume at 2 ranks
    (in this process) gives the uninterrupted run's ids and final weights."""
    from rlvr.flows.runs import resume

    store = kill_a_rank(tmp_path, rlvr_forks, "rank 1", ("episodes", 1))
    assert committed(store, "evals") == 0
    kill_a_rank(tmp_path, rlvr_forks, "rank 1", ("sft", 1), resumed=True)
    assert committed(store, "evals") == 1 and committed(store, "warmstart") == 0
    kill_a_rank(tmp_path, rlvr_forks, "rank 1", between_difficulty_shards, resumed=True)
    assert committed(store, "warmstart") == 1 and committed(store, "train_steps") == 0
    kill_a_rank(tmp_path, rlvr_forks, "rank 1", ("save_state", 1), resumed=True)
    assert committed(store, "difficulty") == 1 and committed(store, "train_steps") == 1  # step 2 commits with its state
    kill_a_rank(tmp_path, rlvr_forks, "rank 1", ("write_weights", 1), resumed=True)
    assert (
        committed(store, "train_steps") == 5 and committed(store, "checkpoints") == 2
    )  # the initial, the warm start's
    mark = f"rank-faults-{tmp_path.name}-resumed"
    monkeypatch.setenv("RLVR_TEST_MARK", mark)
    resume(str(store), RUN_ID, ["train.data_parallel=2"])
    assert artifact_ids(store) == artifact_ids(uninterrupted)
    assert final_weights(store) == final_weights(uninterrupted)
    wait_for(lambda: not rank_processes(mark), 10, "no rank process left after the resumed run")
