"""The RL run end to end on a tiny config: real Prefect, real Parquet, real DuckDB, the real tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlvr.flows.runs import execute
from rlvr.storage.lineage import ancestors
from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import REPO
from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow


def scalar(store: Store, sql: str):
    return query(store, sql).to_pylist()[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, prefect_api, request):
    from rlvr.flows.config import load_config

    root = str(tmp_path_factory.mktemp("store"))
    cfg = load_config(None, ["run_id=tiny", *TINY_OVERRIDES])
    summary = execute(root, cfg)
    return Store.open(root), cfg, summary


def test_counts_match_the_run(finished_run):
    store, cfg, _ = finished_run
    per_step = cfg.select.batch_size * cfg.allocate.n
    assert scalar(store, "SELECT count(*) AS n FROM rollouts")["n"] == cfg.train.steps * per_step
    joined = scalar(
        store,
        """
        SELECT count(*) AS n, count(DISTINCT p.problem_id) AS problems, sum(w.score) AS reward
        FROM rewards w JOIN rollouts r USING (rollout_id) JOIN problems p ON p.problem_id = r.problem_id
    """,
    )
    assert joined["n"] == cfg.train.steps * per_step
    direct = scalar(store, "SELECT sum(score) AS reward FROM rewards")
    assert joined["reward"] == direct["reward"]
    mean_by_step = query(store, "SELECT step, avg(score) AS r FROM rewards GROUP BY step ORDER BY step").to_pylist()
    train_rows = query(store, "SELECT step, mean_reward FROM train_steps ORDER BY step").to_pylist()
    assert [round(r["r"], 9) for r in mean_by_step] == [round(t["mean_reward"], 9) for t in train_rows]
    assert [t["step"] for t in train_rows] == list(range(1, cfg.train.steps + 1))


def test_rows_in_equal_accepted_plus_quarantined(finished_run):
    store, _, _ = finished_run
    accepted = scalar(store, "SELECT count(*) AS n FROM problems")["n"]
    quarantined = scalar(store, "SELECT count(*) AS n FROM quarantine")["n"]
    rows_in = store.manifests(kind="problems")[0].extra["rows_in"]
    assert accepted + quarantined == rows_in == 80  # 8 skills categories x 10
    counts = query(store, "SELECT split, count(*) AS n FROM problems GROUP BY split").to_pylist()
    splits = {r["split"]: r["n"] for r in counts}
    assert splits == {"test": 16, "warmup": 16, "train": 48}


def test_evals_checkpoints_runs(finished_run):
    store, _, summary = finished_run
    evals = query(store, "SELECT step, phase FROM evals ORDER BY step, phase").to_pylist()
    assert [(e["step"], e["phase"]) for e in evals] == [(0, "init"), (0, "warmstart"), (3, "rl"), (6, "rl")]
    ckpts = query(store, "SELECT step, stage FROM checkpoints ORDER BY step, stage").to_pylist()
    assert [(c["step"], c["stage"]) for c in ckpts] == [
        (0, "initialize"),
        (0, "warmstart"),
        (3, "checkpoint"),
        (6, "checkpoint"),
    ]
    assert scalar(store, "SELECT status FROM runs WHERE run_id = 'tiny'")["status"] == "completed"
    # only the newest train_state survives; train_steps are all kept
    assert scalar(store, "SELECT count(*) AS n FROM artifacts WHERE kind = 'train_state'")["n"] == 1
    assert summary["accuracy_init"] is not None and summary["accuracy_final"] is not None


def test_lineage_of_final_checkpoint(finished_run):
    store, cfg, _ = finished_run
    final = scalar(store, f"SELECT artifact_id FROM checkpoints WHERE step = {cfg.train.steps}")["artifact_id"]
    kinds = {m.kind for m in ancestors(store, final)}
    assert {
        "config",
        "problems",
        "rollouts",
        "rewards",
        "selections",
        "allocations",
        "train_steps",
        "difficulty",
        "checkpoints",
        "curriculum_state",
    } <= kinds
    assert {"initialize", "warmstart"} <= {m.stage for m in ancestors(store, final)}
    rollouts_up = [m for m in ancestors(store, final) if m.kind == "rollouts"]
    assert len(rollouts_up) == cfg.train.steps


def test_second_execution_skips_everything(finished_run):
    store, cfg, _ = finished_run
    before = {m.artifact_id: m.created_at for m in store.manifests()}
    execute(store.root, cfg)
    after = {m.artifact_id: m.created_at for m in Store.open(store.root).manifests()}
    assert after == before


def test_cached_verdicts_equal_fresh_ones(finished_run):
    from rlvr.verifiers.arithmetic import ArithmeticVerifier

    store, _, _ = finished_run
    rows = query(
        store,
        """SELECT w.score, w.status, w.cache_hit, r.response, p.answer FROM rewards w
        JOIN rollouts r USING (rollout_id) JOIN problems p ON p.problem_id = r.problem_id""",
    ).to_pylist()
    assert any(r["cache_hit"] for r in rows) and not all(r["cache_hit"] for r in rows)
    verifier = ArithmeticVerifier()
    for r in rows:
        fresh = verifier.score(r["response"], r["answer"])
        assert (fresh.value, fresh.status) == (r["score"], r["status"])


def test_relabel_reports_exactly_the_flipped_verdicts(finished_run):
    from rlvr.flows.relabel import relabel_rewards
    from rlvr.verifiers.cache import VerifierConfig

    store, _, _ = finished_run
    rewards_ids = [m.artifact_id for m in store.manifests(kind="rewards")]
    cfg = VerifierConfig(verifier="tests.plugins.lenient:LenientArithmetic", workers=1)
    results = relabel_rewards(store.root, rewards_ids, cfg)
    assert len(results) == len(rewards_ids)
    expected = scalar(
        store,
        r"""SELECT count(*) AS n FROM rewards w JOIN rollouts r USING (rollout_id)
        WHERE w.status = 'unparseable' AND regexp_matches(r.response, '^\s*[+-]?\d')""",
    )["n"]
    flips = query(store, "SELECT * FROM relabel_flips").to_pylist()
    assert len(flips) == expected
    assert all(f["old_status"] == "unparseable" and f["new_status"] in ("ok", "wrong") for f in flips)
    assert {f["new_verifier_version"] for f in flips} <= {"2-lenient"}
    relabelled = scalar(store, "SELECT count(*) AS n FROM relabeled_rewards")["n"]
    assert relabelled == scalar(store, "SELECT count(*) AS n FROM rewards")["n"]
    again = relabel_rewards(store.root, rewards_ids, cfg)  # same version: nothing new
    assert again == results


def test_importing_the_flow_module_imports_neither_the_stages_nor_torch():
    """`import rlvr.flows.rl_run` costs Prefect and the run config (issue 52: under 2.5 s of user CPU, from 5.4);
    the run imports the steps, the stages and the trainer when it starts. A fresh interpreter, as `rlvr` has."""
    code = (
        "import sys, rlvr.flows.rl_run; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'sympy', 'math_verify') "
        "or m.startswith(('rlvr.tasks.', 'rlvr.trainer.'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
