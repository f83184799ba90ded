"""SEC + Knapsack + dynamic sampling + CLPO + a KL term in one real run: every decision is a row, and the
rows agree with the algorithms (TD(0), the budget, the buffers, the filter, the rewrites)."""

from __future__ import annotations

import pytest

from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.tasks.allocate import _kept, buffers_before, rebuild_buffers

pytestmark = pytest.mark.slow

BATCH, N, STEPS = 4, 4, 5


@pytest.fixture(scope="module")
def combo_run(tmp_path_factory, prefect_api):
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    cfg = load_config(
        None,
        [
            "run_id=combo",
            f"train.steps={STEPS}",
            f"select.batch_size={BATCH}",
            f"allocate.n={N}",
            "warmstart.steps=30",
            "difficulty.k=4",
            "evaluate.every=5",
            "checkpoint.every=5",
            "flow.steps_per_subflow=5",
            "select.type=sec",
            "select.arms=bin",
            "allocate.type=knapsack",
            "filter.enabled=true",
            "filter.max_refills=1",
            "restructure.enabled=true",
            "train.grpo.kl_beta=0.01",
            "synthesize.source.type=arithmetic",
            "synthesize.source.terms=3",
            "synthesize.source.count=120",
        ],
    )
    root = str(tmp_path_factory.mktemp("combo"))
    execute(root, cfg)
    return Store.open(root), cfg


def rows(store: Store, sql: str) -> list[dict]:
    return query(store, sql).to_pylist()


def test_sec_values_follow_td0_and_carry_over(combo_run):
    store, _ = combo_run
    audit = rows(
        store,
        "SELECT step, arm, q_before, q_after, reward, pulls, probability FROM curriculum_state ORDER BY step, arm",
    )
    by_step: dict[int, dict[str, dict]] = {}
    for row in audit:
        by_step.setdefault(row["step"], {})[row["arm"]] = row
    for step, arms in by_step.items():
        assert sum(a["probability"] for a in arms.values()) == pytest.approx(1.0)
        for arm in arms.values():
            expected = arm["q_before"] if arm["reward"] is None else 0.5 * arm["reward"] + 0.5 * arm["q_before"]
            assert arm["q_after"] == pytest.approx(expected)
            if step + 1 in by_step and arm["arm"] in by_step[step + 1]:
                assert by_step[step + 1][arm["arm"]]["q_before"] == arm["q_after"]
    picks = rows(
        store,
        "SELECT s.step, s.arm, s.probability * c.pool_size AS arm_probability, c.probability "
        "FROM selections s JOIN curriculum_state c USING (step, arm)",
    )
    assert picks and all(p["arm_probability"] == pytest.approx(p["probability"]) for p in picks)


def test_budgets_sum_to_prompts_times_n_and_explain_themselves(combo_run):
    store, _ = combo_run
    for row in rows(store, "SELECT step, count(*) AS prompts, sum(n_rollouts) AS total FROM allocations GROUP BY step"):
        assert row["total"] == row["prompts"] * N
    for row in rows(store, 'SELECT p_hat, "case", p_hat_source, buffer_count FROM allocations'):
        p = row["p_hat"]
        expected = "unknown" if p is None else "zero" if p == 0 else "one" if p == 1 else "effective"
        assert row["case"] == expected
        if row["p_hat_source"] == "buffer":
            assert row["buffer_count"] >= 8


def test_buffers_rebuilt_by_query_equal_the_ones_kept_in_memory(combo_run):
    store, _ = combo_run
    _kept.clear()
    rebuilt = rebuild_buffers(store, "combo", STEPS + 1)
    incremental = buffers_before(
        store,
        "combo",
        2,
        query(store, "SELECT problem_id, step, rollout_id, verifier, status, score FROM rewards WHERE step = 1"),
    )
    for step in range(2, STEPS + 1):
        previous = query(
            store, f"SELECT problem_id, step, rollout_id, verifier, status, score FROM rewards WHERE step = {step}"
        )
        incremental = buffers_before(store, "combo", step + 1, previous)
    assert incremental == rebuilt
    assert any(
        incremental.estimate(pid) is not None
        for pid in query(store, "SELECT DISTINCT problem_id FROM rewards").column("problem_id").to_pylist()
    )


def test_filter_keeps_at_most_the_batch_and_train_sees_exactly_those(combo_run):
    store, _ = combo_run
    kept = {
        r["step"]: r["n"] for r in rows(store, "SELECT step, sum(kept::int) AS n FROM filtered_groups GROUP BY step")
    }
    trained = {r["step"]: r["groups"] for r in rows(store, "SELECT step, groups FROM train_steps")}
    for step in range(1, STEPS + 1):
        assert kept.get(step, 0) <= BATCH
        assert trained[step] == kept.get(step, 0)
    zero = rows(store, "SELECT count(*) AS n FROM filtered_groups WHERE reason = 'zero variance' AND kept")
    assert zero[0]["n"] == 0


def test_rewrites_are_labelled_verified_and_linked_to_their_parents(combo_run):
    store, _ = combo_run
    audit = rows(
        store,
        "SELECT accuracy, label, kl_weight, mode, rewrite_prompt, rewrite_accuracy, kept, reason FROM restructured",
    )
    assert audit
    for row in audit:
        label = "hard" if row["accuracy"] <= 0.3 else "medium" if row["accuracy"] <= 0.7 else "easy"
        assert row["label"] == label and row["kl_weight"] == (0.5 if label == "hard" else 1.0)
        if row["kept"]:
            assert 0 < row["rewrite_accuracy"] < 1 and row["reason"] == "kept"
    kept = rows(
        store,
        "SELECT r.rewrite_prompt, p.prompt, p.parent_problem_id, p.derivation, parent.answer AS parent_answer, "
        "p.answer FROM restructured r JOIN problems p ON p.prompt = r.rewrite_prompt "
        "JOIN problems parent ON parent.problem_id = p.parent_problem_id WHERE r.kept",
    )
    assert all(k["derivation"] in ("simplify", "diversify") and k["answer"] == k["parent_answer"] for k in kept)
    assert rows(store, "SELECT min(ref_kl) AS m FROM train_steps")[0]["m"] >= 0
