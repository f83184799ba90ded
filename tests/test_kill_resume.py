"""Fault injection: SIGKILL a real run at several moments, resume it, and get the uninterrupted result.

The killed run and a reference run share seed, config and run id but live in different stores; the reference runs in
the test's process (the same config and flow as `rlvr run`, without paying its imports again), the killed run and
its resumes as `rlvr` processes (forked by the worker's ForkServer, tests/fork_server.py: each a process of its own,
which a SIGKILL ends, without ~7 CPU-s of imports apiece). After three kills (one inside the difficulty stage,
between two of its shards, one near the middle of the RL steps and one near their end; five, two more in between,
cost the suite about two minutes on 2 cores) and the resumes that follow them, both stores hold exactly the same
artifact ids, the same decisions (SEC's selections and arm values, Knapsack's allocations, the training figures) and
final checkpoints with byte-identical weights. The run is the default task with SEC and Knapsack RL on, and in the
synchronous case GHPO's hints and CLPO's rewrites too (their levels and rewrites must survive a kill).

With flow.async_level=1 (sampling a step beside training the one before) the same holds, with a fourth kill
while generation is ahead of training: a step's rollouts committed, its update not, and the next step's
sampling in flight. Every rollout is then sampled once: the (problem, sample index, sampling policy) triples
of the two stores are the same.

With multi-turn episodes (env.type=retry: a wrong answer is told so and answers again), sampled ahead of training
(flow.async_level=1) and trained with turn-level credit, the same holds, and the `turns` tables (every turn's role,
token span, text and the trajectories' stop reasons) are equal too.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import FolderChanges, committed, store_folders
from tests.fork_server import Forked, ForkServer

pytestmark = pytest.mark.slow

RUN_ID = "killme"
OVERRIDES = [
    "train.steps=8",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=20",
    "difficulty.k=4",
    "difficulty.shard_size=4",
    "evaluate.every=4",
    "checkpoint.every=4",
    "flow.steps_per_subflow=4",
    "select.type=sec",  # the curricula whose decisions carry state from step to step
    "allocate.type=knapsack",
]


def start(forks: ForkServer, command: str, store: Path, extra: tuple[str, ...] = ()) -> Forked:
    args = (
        ["run", "--store", str(store), "--run-id", RUN_ID]
        if command == "run"
        else ["resume", RUN_ID, "--store", str(store)]
    )
    if command == "run":
        for o in (*OVERRIDES, *extra):
            args += ["--set", o]
    return forks.start(args)


def run_in_this_process(store: Path, extra: tuple[str, ...]) -> None:
    """The reference run: `rlvr run`'s config and flow, in this process, whose imports are paid already (a process
    costs ~7 CPU-s of them). The killed run's processes must reach the same bytes as this one."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    execute(str(store), load_config(None, [*OVERRIDES, *extra, f"run_id={RUN_ID}"]), new=True)


def generation_ahead(store: Path) -> bool:
    """True while a step's rollouts are committed and its update is not (past the first steps)."""
    trained = committed(store, "train_steps")
    return trained >= 3 and committed(store, "rollouts") > trained


def between_difficulty_shards(store: Path) -> bool:
    """True while the difficulty stage has committed some shards but not the artifact."""
    for shards in (store / "artifacts" / "difficulty").glob("*/_shards"):
        aid = shards.parent.name
        if any(shards.iterdir()) and not (store / "manifests" / f"{aid}.json").exists():
            return True
    return False


def kill_when(proc: Forked, condition: Callable[[], bool], store: Path, timeout: float = 240) -> bool:
    """SIGKILL `proc` as soon as `condition` holds, checked whenever the run changes a folder of `store` that the
    conditions read (a manifest committed, a difficulty shard written); False if the process ended first."""
    deadline = time.monotonic() + timeout
    difficulty = store / "artifacts" / "difficulty"
    with FolderChanges() as changes:
        while time.monotonic() < deadline:
            changes.watch([*store_folders(store, "difficulty"), *difficulty.glob("*"), *difficulty.glob("*/_shards")])
            if condition():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            if proc.poll() is not None:
                return False
            changes.wait(every=0.05)
    proc.kill()
    raise AssertionError("condition never held")


def final_weights(store: Path) -> bytes:
    s = Store.open(str(store))
    final = max((m for m in s.manifests(kind="checkpoints")), key=lambda m: m.step)
    return s.read_file(final.artifact_id, "model.safetensors")


def decisions(store: Path) -> dict[str, list[dict]]:
    """Every curriculum decision and training figure, in order: what must match, not just the ids."""
    s = Store.open(str(store))
    sql = {
        "selections": "SELECT step, slot, problem_id, arm, probability, hint_ratio FROM selections ORDER BY step, slot",
        "allocations": 'SELECT step, slot, n_rollouts, p_hat, p_hat_source, "case", value FROM allocations '
        "ORDER BY step, slot",
        "curriculum_state": "SELECT step, arm, q_before, probability, q_after FROM curriculum_state ORDER BY step, arm",
        "train_steps": "SELECT step, loss, mean_reward, effective_ratio FROM train_steps ORDER BY step",
        "restructured": "SELECT step, slot, label, mode, rewrite_prompt, kept FROM restructured ORDER BY step, slot",
    }
    return {name: query(s, text).to_pylist() for name, text in sql.items()}


def sampled(store: Path) -> list[tuple]:
    s = Store.open(str(store))
    sql = "SELECT step, problem_id, sample_index, policy_id, staleness FROM rollouts ORDER BY ALL"
    return [tuple(row.values()) for row in query(s, sql).to_pylist()]


def turns(store: Path) -> list[tuple]:
    s = Store.open(str(store))
    sql = "SELECT rollout_id, turn, role, token_start, token_end, text, stop_reason FROM turns ORDER BY ALL"
    return [tuple(row.values()) for row in query(s, sql).to_pylist()]


SKILLS = ("synthesize.source.per_category=10",)
SYNC_WITH_HINTS_AND_REWRITES = (
    # two-step solutions: a one-step one (every skills problem) states its answer at once and is never hinted
    "synthesize.source.type=arithmetic",
    "synthesize.source.terms=3",
    "synthesize.source.count=80",
    "select.hints.enabled=true",
    "select.hints.from_difficulty=true",  # hinted from a problem's first draw: 8 steps draw few problems twice
    "select.hints.template={prompt}{hint}",  # text the tiny model reads (flows/compatibility.py)
    "restructure.enabled=true",
    "restructure.join=same_step",
    "restructure.share=0.5",
)


# Multi-turn episodes (a wrong answer is told so and answers again), a step sampled beside the update of the one
# before, each turn credited with the reward still to come: the kills land between the stages of steps whose
# rollouts are whole trajectories; their turns must come back the same. The skills source's default size (about
# 770 problems) made the difficulty stage and each evaluation of this run ten times the others'; 10 per category
# (80 problems) gives the same stages, shards and multi-turn episodes.
MULTI_TURN = (
    *SKILLS,
    "train.steps=6",
    "env.type=retry",
    "env.max_turns=3",
    "flow.async_level=1",
    "train.grpo.turn_credit=return_to_go",
)


@pytest.mark.parametrize(
    ("async_level", "extra"),
    [(0, SYNC_WITH_HINTS_AND_REWRITES), (1, (*SKILLS, "flow.async_level=1")), (1, MULTI_TURN)],
    ids=["sync", "async", "multi_turn"],
)
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, rlvr_forks, async_level, extra):
    reference, killed = tmp_path / "reference", tmp_path / "killed"

    run_in_this_process(reference, extra)
    total = committed(reference)
    assert total > 40

    moments: list[Callable[[], bool]] = [lambda: between_difficulty_shards(killed)]
    moments += [lambda f=f: committed(killed) >= int(total * f) for f in (0.45, 0.85)]
    if async_level:
        moments.insert(2, lambda: generation_ahead(killed))
    missed = []
    proc = start(rlvr_forks, "run", killed, extra)
    for index, moment in enumerate(moments):
        if kill_when(proc, moment, killed):
            if index == 0:  # the first kill landed inside the sharded stage: shards on disk, no manifest
                assert not Store.open(str(killed)).manifests(kind="difficulty")
        else:  # the process ended before the moment came: say how
            missed.append((index, proc.returncode, proc.stderr_text()[-1000:]))
        proc = start(rlvr_forks, "resume", killed)
    assert proc.wait(timeout=600) == 0, proc.stderr_text()
    assert missed == []

    ids = lambda root: sorted(m.artifact_id for m in Store.open(str(root)).manifests())  # noqa: E731
    assert ids(killed) == ids(reference)
    assert final_weights(killed) == final_weights(reference)
    assert decisions(killed) == decisions(reference)
    assert sampled(killed) == sampled(reference)
    assert {row[-1] for row in sampled(reference)} == ({0, 1} if async_level else {0})
    assert turns(killed) == turns(reference)
    if "env.type=retry" in extra:  # the episodes had several turns, so their resume was tested
        assert any(row[2] == "user" for row in turns(reference))
    elif not async_level:  # the hints and rewrites happened, so their resume was tested
        made = decisions(reference)
        assert any(row["hint_ratio"] > 0 for row in made["selections"])
        assert any(row["kept"] for row in made["restructured"])
    runs = Store.open(str(killed)).read_run(RUN_ID)
    assert runs["status"] == "completed"
