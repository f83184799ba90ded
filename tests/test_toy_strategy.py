"""Adding a selection strategy is one module and its registration: this test is that module, then two
real RL steps with it (config key, select, update, carried state and audit rows all come for free)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytest

from rlvr.curricula.base import Pick, PoolProblem, SelectConfig, SelectionStrategy, StepFeedback
from rlvr.curricula.registry import STRATEGIES
from rlvr.storage.store import Store
from rlvr.storage.views import query

pytestmark = pytest.mark.slow


# ----- the whole of a new strategy -------------------------------------------------------------------


class LowestFirstConfig(SelectConfig):
    type: Literal["lowest_first"] = "lowest_first"
    skip: int = 0


class LowestFirst(SelectionStrategy):
    """Takes the problems with the smallest ids it has not taken yet (a deterministic toy)."""

    type = "lowest_first"

    def __init__(self, cfg: SelectConfig) -> None:
        super().__init__(cfg)
        self.taken = 0

    def select(self, pool: Sequence[PoolProblem], batch_size: int, rng: random.Random) -> list[Pick]:
        start = self.taken + self.cfg.skip  # type: ignore[attr-defined]
        chosen = [pool[(start + i) % len(pool)] for i in range(batch_size)]
        return [Pick(p.problem_id, p.arm, 1.0 if i == 0 else 0.5) for i, p in enumerate(chosen)]

    def observe(self, feedback: StepFeedback) -> list[dict[str, Any]]:
        self.taken += len(feedback.outcomes)
        return [
            {"arm": "all", "pool_size": len(feedback.pool), "pulls": len(feedback.outcomes), "taken_so_far": self.taken}
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.taken = int(state.get("taken", 0))


# ----- using it ----------------------------------------------------------------------------------------


def test_a_registered_strategy_runs_two_steps(tmp_path, prefect_api):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    STRATEGIES.register(LowestFirstConfig, LowestFirst)
    try:
        cfg = load_config(
            None,
            [
                "run_id=toy",
                "select.type=lowest_first",
                "select.skip=1",
                "select.batch_size=3",
                "train.steps=2",
                "allocate.n=4",
                "warmstart.steps=5",
                "difficulty.k=2",
                "evaluate.every=2",
                "checkpoint.every=2",
                "synthesize.source.per_category=10",
            ],
        )
        root = str(tmp_path / "store")
        execute(root, cfg)
    finally:
        STRATEGIES.unregister("lowest_first")
    store = Store.open(root)
    pool = (
        query(store, "SELECT problem_id FROM problems WHERE split IN ('train', 'warmup') ORDER BY problem_id")
        .column("problem_id")
        .to_pylist()
    )
    picks = query(
        store, "SELECT step, slot, problem_id, probability, strategy FROM selections ORDER BY step, slot"
    ).to_pylist()
    assert [p["problem_id"] for p in picks] == pool[1:4] + pool[4:7]  # step 2 continues after step 1's three
    assert {p["strategy"] for p in picks} == {"lowest_first"}
    assert [p["probability"] for p in picks[:3]] == [1.0, 0.5, 0.5]
    audit = query(store, "SELECT step, arm, pulls, taken_so_far FROM curriculum_state ORDER BY step").to_pylist()
    assert audit == [
        {"step": 1, "arm": "all", "pulls": 3, "taken_so_far": 3},
        {"step": 2, "arm": "all", "pulls": 3, "taken_so_far": 6},
    ]
    assert query(store, "SELECT count(*) AS n FROM rollouts").column("n")[0].as_py() == 2 * 3 * 4
