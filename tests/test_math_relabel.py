"""`rlvr relabel` on rewards labelled by math verifier version 1 shows the verdicts version 2 flips.

The old verdicts below were recorded by running version 1 (commit f7c1276, before issue 12) on
these exact responses: when a response had no \\boxed, "answer is", #### or bold answer, version 1
took its last number. The store is built only through public entry points (Store.write_artifact,
the CLI, the views), as a user's store labelled by the old version would look.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa

from rlvr.storage.stage import rows_to_table
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.verifiers.math import MathVerifier
from tests.cli_helpers import rlvr

RUN = "math-v1-run"
# (family, response, reference, version-1 score, version-1 status, version-1 extracted)
LABELLED_BY_VERSION_1 = [
    ("interval", "So the solution set is $[0,1)$", "[0,1)", 0.0, "wrong", "1"),
    ("interval", "The solution set is $(1, 2]$.", "2", 1.0, "ok", "2"),
    ("interval", "$-[0,1)$", "1", 1.0, "ok", "1"),
    ("inequality", "Therefore $x \\geq 5$ is the solution.", "x \\ge 5", 0.0, "wrong", "5"),
    ("expression", "Expanding, we get $(x+1)^2$", "x^2+2x+1", 0.0, "wrong", "2"),
    ("frac", "$\\frac3{3} $", "1", 0.0, "wrong", "3"),
    ("cfrac", "The ratio is $\\cfrac{1}{3}$", "1/3", 0.0, "wrong", "3"),
    ("sqrt", "$\\sqrt3 $", "\\sqrt{3}", 0.0, "unparseable", None),
    ("thousands", "The total is 1 000", "1000", 0.0, "wrong", "000"),
    ("thousands", "In all 7,425,000 people came", "7425000", 1.0, "ok", "7,425,000"),
    ("decimal comma", "It costs 1000,99 euros", "1000.99", 0.0, "wrong", "99"),
    ("set", "The roots form the set $\\{1, 2\\}$", "\\{1,2\\}", 0.0, "wrong", "2"),
    (
        "matrix",
        "We get $\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}$",
        "\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}",
        0.0,
        "error",
        "1",
    ),
    ("tuple", "The point is $(3, -4)$", "(3,-4)", 0.0, "wrong", "-4"),
    ("degrees", "The angle measures $30^\\circ$", "30", 1.0, "ok", "30"),
    ("equation", "Solving gives $x = 7$", "7", 1.0, "ok", "7"),
    ("plain text", "We add them and obtain .4 as the probability", "0.4", 0.0, "unparseable", None),
    ("boxed", "We add 8 and 9 to get \\boxed{17}.", "17", 1.0, "ok", "17"),
    ("####", "She sold 48 + 24 clips.\n#### 70", "72", 0.0, "wrong", "70"),
]

# rollout -> (old status, new status): false "wrong"s become "ok", false "ok"s stop being "ok"
EXPECTED_FLIPS = {
    "r00": ("wrong", "ok"),  # [0,1) is an interval, not its right end
    "r01": ("ok", "wrong"),  # (1, 2] is not the number 2
    "r02": ("ok", "unparseable"),  # -[0,1) is not the number 1
    "r03": ("wrong", "ok"),  # x >= 5 is an inequality
    "r04": ("wrong", "ok"),  # (x+1)^2 = x^2+2x+1
    "r05": ("wrong", "ok"),  # \frac3{3} = 1
    "r06": ("wrong", "ok"),  # \cfrac{1}{3} = 1/3
    "r07": ("unparseable", "ok"),  # \sqrt3 = \sqrt{3}
    "r08": ("wrong", "ok"),  # 1 000 = 1000
    "r10": ("wrong", "ok"),  # 1000,99 = 1000.99
    "r11": ("wrong", "ok"),  # a set
    "r12": ("error", "ok"),  # a matrix
    "r13": ("wrong", "ok"),  # a point
    "r16": ("unparseable", "ok"),  # .4 = 0.4
}


def _table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows)


def _write_store_labelled_by_version_1(root: str) -> str:
    """problems, rollouts and a rewards artifact as version 1 wrote them; returns the rewards id."""
    store = Store.open(root, create=True)
    problems, rollouts, rewards = [], [], []
    for i, (family, response, reference, score, status, extracted) in enumerate(LABELLED_BY_VERSION_1):
        problem_id, rollout_id = f"p{i:02d}", f"r{i:02d}"
        problems.append(
            {
                "problem_id": problem_id,
                "run_id": RUN,
                "split": "train",
                "domain": "math",
                "category": family,
                "prompt": f"question {i}",
                "reference": reference,
                "answer": reference,
                "verifier": "math",
                "source": "hand",
                "generator": "hand",
                "generator_version": "1",
                "params": "{}",
                "seed": 0,
                "source_index": i,
                "parent_problem_id": None,
                "derivation": None,
                "difficulty_label": None,
                "solution": None,
            }
        )
        rollouts.append(
            {
                "rollout_id": rollout_id,
                "run_id": RUN,
                "step": 0,
                "slot": i,
                "problem_id": problem_id,
                "sample_index": 0,
                "prompt": f"question {i}",
                "response": response,
                "completion_ids": [1, 2, 3],
                "n_tokens": 3,
                "finish_reason": "stop",
                "policy_id": "policy-0",
            }
        )
        rewards.append(
            {
                "rollout_id": rollout_id,
                "run_id": RUN,
                "step": 0,
                "problem_id": problem_id,
                "verifier": "math",
                "verifier_version": "1",
                "score": score,
                "status": status,
                "extracted": extracted,
                "reason": "recorded from version 1",
                "components": json.dumps({"correct": score}),
                "cache_hit": False,
            }
        )
    common = {"run_id": RUN, "code_version": "1", "config": {}, "step": 0}
    store.write_artifact("problems", "problems-math-v1", _table(problems), stage="data", parents=[], **common)
    store.write_artifact(
        "rollouts",
        "rollouts-math-v1",
        rows_to_table("rollouts", rollouts),
        stage="rollout",
        parents=["problems-math-v1"],
        **common,
    )
    store.write_artifact(
        "rewards",
        "rewards-math-v1",
        rows_to_table("rewards", rewards),
        stage="label",
        parents=["rollouts-math-v1", "problems-math-v1"],
        **common,
    )
    return "rewards-math-v1"


def test_the_recorded_verdicts_are_what_version_2_changes():
    """Guards the table above: version 2 gives the new status of each expected flip, the old one elsewhere."""
    verifier = MathVerifier()
    for i, (_, response, reference, _, old_status, _) in enumerate(LABELLED_BY_VERSION_1):
        new_status = verifier.score(response, reference).status
        assert new_status == EXPECTED_FLIPS.get(f"r{i:02d}", (old_status, old_status))[1], (response, new_status)


def test_relabel_shows_the_flips_from_version_1(tmp_path, rlvr_forks):
    root = str(tmp_path / "store")
    rewards_id = _write_store_labelled_by_version_1(root)
    # The worker's forked `rlvr` on the session's Prefect server: without PREFECT_API_URL `rlvr relabel` starts a
    # temporary one in the store, about 13 CPU-seconds of start-up this test does not check (test_ui.py checks it).
    result = rlvr("relabel", rewards_id, "--verifier", "math", "--store", root, "--workers", "1", forks=rlvr_forks)

    assert result.returncode == 0, result.stderr
    up = sum(new == "ok" for _, new in EXPECTED_FLIPS.values())
    summary = f"with math v{MathVerifier.version} (current versions): {len(EXPECTED_FLIPS)} verdicts flipped ({up} up, {len(EXPECTED_FLIPS) - up} down)"
    assert summary in re.sub(r"\s+", " ", result.stdout), result.stdout
    flips = query(Store.open(root), "SELECT * FROM relabel_flips ORDER BY rollout_id").to_pylist()
    assert {f["rollout_id"]: (f["old_status"], f["new_status"]) for f in flips} == EXPECTED_FLIPS
    assert {(f["old_verifier_version"], f["new_verifier_version"]) for f in flips} == {("1", MathVerifier.version)}
    assert {f["rollout_id"]: (f["old_score"], f["new_score"]) for f in flips}["r01"] == (1.0, 0.0)
    relabelled = query(
        Store.open(root), "SELECT count(*) AS n, min(verifier_version) AS v FROM relabeled_rewards"
    ).to_pylist()
    assert relabelled == [{"n": len(LABELLED_BY_VERSION_1), "v": MathVerifier.version}]
