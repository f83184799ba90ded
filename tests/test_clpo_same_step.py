"""CLPO as the paper has it (`restructure.join: same_step`): rewrites of a step's hard problems are sampled in
that step, and the kept ones train in it beside the drawn groups, within the step's rollout budget."""

from __future__ import annotations

import pytest

from rlvr.curricula.clpo import RestructureConfig
from rlvr.errors import UserError

pytestmark = pytest.mark.slow

BATCH, N, STEPS = 4, 4, 6


@pytest.fixture(scope="module")
def same_step_run(tmp_path_factory, prefect_api):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.store import Store

    cfg = load_config(
        None,
        [
            "run_id=clpo",
            f"train.steps={STEPS}",
            f"select.batch_size={BATCH}",
            f"allocate.n={N}",
            "warmstart.steps=30",
            "difficulty.k=2",
            "evaluate.every=6",
            "checkpoint.every=6",
            "restructure.enabled=true",
            "restructure.join=same_step",
            "restructure.share=0.5",
            "synthesize.source.type=arithmetic",
            "synthesize.source.terms=3",
            "synthesize.source.count=60",
        ],
    )
    root = str(tmp_path_factory.mktemp("clpo"))
    execute(root, cfg)
    return Store.open(root)


def rows(store, sql: str) -> list[dict]:
    from rlvr.storage.views import query

    return query(store, sql).to_pylist()


def test_rewrite_slots() -> None:
    same = RestructureConfig(enabled=True, join="same_step")
    assert [same.rewrite_slots(b) for b in (1, 4, 8, 64)] == [1, 1, 2, 16]
    assert RestructureConfig(enabled=True).rewrite_slots(8) == 0
    assert RestructureConfig(join="same_step").rewrite_slots(8) == 0  # CLPO off


def test_same_step_needs_prompts_left_to_draw(tmp_path) -> None:
    from rlvr.flows.config import load_config
    from rlvr.flows.run_preflight import check_clpo

    cfg = load_config(None, ["select.batch_size=1", "restructure.enabled=true", "restructure.join=same_step"])
    with pytest.raises(UserError, match=r"keeps 1 of select.batch_size=1 prompts for rewrites, leaving none"):
        check_clpo(cfg)


def test_kept_rewrites_train_in_the_step_that_made_them(same_step_run) -> None:
    store = same_step_run
    kept = rows(
        store,
        "SELECT step, problem_id, rewrite_prompt FROM restructured WHERE kept ORDER BY step, slot",
    )
    assert kept, "no rewrite was kept: the same-step path was not exercised"
    for rewrite in kept:
        trained = rows(
            store,
            f"SELECT DISTINCT r.prompt, p.parent_problem_id FROM rollouts r JOIN problems p USING (problem_id) "
            f"WHERE r.step = {rewrite['step']} AND p.derivation != 'original'",
        )
        assert {"prompt": rewrite["rewrite_prompt"], "parent_problem_id": rewrite["problem_id"]} in trained
    per_step = rows(
        store,
        "SELECT t.step, t.groups, t.rollouts, (SELECT count(*) FROM restructured s WHERE s.step = t.step AND s.kept) "
        "AS kept FROM train_steps t ORDER BY t.step",
    )
    drawn = BATCH - 2  # share 0.5 of 4 prompts are the rewrites'
    assert [(r["groups"], r["rollouts"]) for r in per_step] == [
        (drawn + r["kept"], (drawn + r["kept"]) * N) for r in per_step
    ]


def test_every_step_stays_within_its_rollout_budget(same_step_run) -> None:
    """Drawn groups and every sampled rewrite (kept or not) together: at most batch_size x n rollouts."""
    store = same_step_run
    drawn = {r["step"]: r["n"] for r in rows(store, "SELECT step, count(*) AS n FROM allocations GROUP BY step")}
    sampled = {m.step: m.extra["sampled"] for m in store.manifests(kind="restructured")}
    assert sorted(sampled) == list(range(1, STEPS + 1))
    for step in sampled:
        assert drawn[step] == BATCH - 2
        assert drawn[step] * N + sampled[step] <= BATCH * N
    assert sum(sampled.values()) > 0


def test_rewrite_rollouts_have_their_problems_and_rewards(same_step_run) -> None:
    store = same_step_run
    orphans = rows(
        store, "SELECT count(*) AS n FROM rollouts WHERE problem_id NOT IN (SELECT problem_id FROM problems)"
    )
    assert orphans == [{"n": 0}]
    unlabelled = rows(
        store, "SELECT count(*) AS n FROM rollouts WHERE rollout_id NOT IN (SELECT rollout_id FROM rewards)"
    )
    assert unlabelled == [{"n": 0}]
