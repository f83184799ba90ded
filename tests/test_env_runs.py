"""Whole runs with environments: the rollouts are episodes, the `turns` table records them, the loss trains only
on sampled tokens, and an environment from a registry package that no one here wrote (GEM) runs unmodified."""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import pytest
import torch

from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import SMALL_RUN, rlvr

pytestmark = pytest.mark.slow

SMALL = SMALL_RUN
RETRY = [*SMALL, "env.type=retry", "env.max_turns=3"]


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    return query(store, sql).to_pylist()


@pytest.fixture(scope="module")
def retry_run(tmp_path_factory, prefect_api):
    """A run of the `retry` environment (a wrong answer is told so and answers again) with turn-level credit, with
    every minibatch the loss saw recorded: its rows' prompt and completion ids, the token mask the loss weighed them
    by, and their advantages."""
    import rlvr.trainer.grpo as grpo
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = grpo.minibatch_loss

    def recording(policy, training, selected, *args, **kwargs):
        seen.append(
            (
                training.prompt_ids[selected].cpu(),
                training.completion_ids[selected].cpu(),
                training.mask[selected].cpu(),
                training.advantages[selected].cpu(),
            )
        )
        return original(policy, training, selected, *args, **kwargs)

    root = str(tmp_path_factory.mktemp("retry") / "store")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo, "minibatch_loss", recording)
        execute(root, load_config(None, ["run_id=retry", *RETRY, "train.grpo.turn_credit=return_to_go"]))
    return Store.open(root), seen


def test_episodes_are_stored_with_their_turns_and_stop_reasons(retry_run) -> None:
    store, _ = retry_run
    episodes = rows(store, "SELECT rollout_id, n_turns, stop_reason, env, env_reward FROM rollouts")
    assert {e["env"] for e in episodes} == {"retry@1"}
    assert {e["stop_reason"] for e in episodes} <= {"done", "max_turns", "token_budget"}
    assert any(e["n_turns"] == 3 for e in episodes) and any(e["n_turns"] == 1 for e in episodes)
    turns = rows(store, "SELECT rollout_id, count(*) FILTER (role = 'assistant') AS n FROM turns GROUP BY 1")
    assert {t["rollout_id"]: t["n"] for t in turns} == {e["rollout_id"]: e["n_turns"] for e in episodes}
    # each episode's assistant turns, as the loss's turn credit reads them, are the turns table's
    # (a reply's reward sits on the environment's turn after the assistant's, or on the assistant's when it ended)
    assistant = rows(
        store,
        "SELECT rollout_id, list(token_start ORDER BY turn) AS starts, list(r ORDER BY turn) AS rewards FROM ("
        " SELECT *, coalesce(reward, CASE WHEN lead(role) OVER w <> 'assistant' THEN lead(reward) OVER w END) AS r"
        " FROM turns WINDOW w AS (PARTITION BY rollout_id ORDER BY turn)) WHERE role = 'assistant' GROUP BY 1",
    )
    stored = rows(store, "SELECT rollout_id, turn_starts, turn_rewards FROM rollouts")
    assert {a["rollout_id"]: (a["starts"], a["rewards"]) for a in assistant} == {
        e["rollout_id"]: (e["turn_starts"], e["turn_rewards"]) for e in stored
    }
    last = rows(store, "SELECT rollout_id, stop_reason FROM turns WHERE stop_reason IS NOT NULL")
    assert {t["rollout_id"]: t["stop_reason"] for t in last} == {e["rollout_id"]: e["stop_reason"] for e in episodes}
    # the environment's reward where it gave one (a right answer), the verifier's 0 on the last answer elsewhere
    rewards = rows(store, "SELECT r.env_reward, w.verifier, w.score FROM rollouts r JOIN rewards w USING (rollout_id)")
    for r in rewards:
        if r["env_reward"] is None:
            assert r["verifier"] != "env:retry" and r["score"] == 0.0
        else:
            assert (r["verifier"], r["score"]) == ("env:retry", r["env_reward"])


def test_a_trajectory_is_its_sampled_turns_and_the_environments_tokens_exactly(retry_run) -> None:
    from rlvr.trainer.checkpoints import load_policy

    store, _ = retry_run
    policy_id = rows(store, "SELECT policy_id FROM rollouts LIMIT 1")[0]["policy_id"]
    tokenizer = load_policy(store, policy_id, device=torch.device("cpu")).tokenizer
    episodes = {e["rollout_id"]: e for e in rows(store, "SELECT rollout_id, completion_ids, loss_mask FROM rollouts")}
    turns = rows(store, "SELECT rollout_id, turn, role, token_start, token_end, text FROM turns ORDER BY ALL")
    covered: dict[str, int] = {}
    for t in turns:
        episode = episodes[t["rollout_id"]]
        assert t["token_start"] == covered.get(t["rollout_id"], 0)  # the spans tile the trajectory in order
        covered[t["rollout_id"]] = t["token_end"]
        span = slice(t["token_start"], t["token_end"])
        mask = episode["loss_mask"][span]
        if t["role"] == "assistant":
            assert mask == [1] * len(mask)
        else:  # the tiny model has no chat template: a message is its content on a line of its own
            assert t["role"] == "user" and mask == [0] * len(mask)
            assert episode["completion_ids"][span] == tokenizer(f"\n{t['text']}", add_special_tokens=False)["input_ids"]
    assert covered == {rid: len(e["completion_ids"]) for rid, e in episodes.items()}
    assert any(0 in e["loss_mask"] for e in episodes.values())


def test_the_loss_never_weighs_an_environment_token(retry_run) -> None:
    store, seen = retry_run
    stored = rows(store, "SELECT prompt_ids, completion_ids, loss_mask FROM rollouts")
    mask_of = {(tuple(r["prompt_ids"]), tuple(r["completion_ids"])): r["loss_mask"] for r in stored}
    pad = 0  # the tiny tokenizer's <pad>
    checked = with_environment_tokens = 0
    assert all(advantages.dim() == 2 for *_, advantages in seen)  # one a token: turn_credit reached the loss
    for prompt_ids, completion_ids, mask, _ in seen:
        for prompt, completion, weights in zip(prompt_ids.tolist(), completion_ids.tolist(), mask.tolist()):
            prompt = prompt[next(i for i, token in enumerate(prompt) if token != pad) :]  # left padding
            key = next(k for k in mask_of if k[0] == tuple(prompt) and completion[: len(k[1])] == list(k[1]))
            expected = mask_of[key]
            assert [int(w) for w in weights] == expected + [0] * (len(weights) - len(expected))
            checked += 1
            with_environment_tokens += 0 in expected
    assert checked and with_environment_tokens  # the loss saw multi-turn rows, and none of their env tokens


GEM = ["env.type=gym", "env.max_turns=3", 'env.options={make: gem, id: "game:GuessTheNumber-v0-easy"}']
NO_GEM = importlib.util.find_spec("gem") is None and not os.environ.get("CI")  # CI installs it: there it must run


@pytest.mark.skipif(NO_GEM, reason="the gem extra is not installed (make envs)")
def test_a_game_the_policy_cannot_read_is_refused_in_one_line_naming_the_share(tmp_path, rlvr_forks) -> None:
    """The tiny model's vocabulary (digits and + - * =) turns GEM's English into unknown tokens: every episode would
    be one empty turn scored -0.1, and the run would print "completed"."""
    sets = [arg for o in [*SMALL, *GEM] for arg in ("--set", o)]
    done = rlvr("run", "--store", str(tmp_path / "store"), *sets, forks=rlvr_forks)
    assert done.returncode == 2  # the CLI's status for a user's error
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: 9\d% of the tokens of env.type=gym's openings are unknown to the policy's tokenizer: the model "
        r"cannot read the environment's text; choose a policy.model whose vocabulary covers it "
        r"\(e.g. smollm2-135m-instruct\)",
        last,
    ), last


@pytest.mark.skipif(NO_GEM, reason="the gem extra is not installed (make envs)")
def test_a_gem_environment_runs_unmodified_through_a_whole_run(tmp_path, prefect_api, smollm2_tokenizer) -> None:
    """GEM's GuessTheNumber through the gym adapter, played by SmolLM2-135M-Instruct (which reads its text): two
    steps as small as they go: 8 problems (4 to train on, 2 held out), the weights and optimizer state (1.6 GB)
    stored at the last step only. Made in this process: the test reads the store, and a subprocess would cost ~7
    CPU-s of imports (the CLI's exit status and error line are the test above's)."""
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.stage import RESIDENTS
    from rlvr.trainer.checkpoints import reference_policy

    store = tmp_path / "store"
    small = [
        "policy.model=smollm2-135m-instruct",
        "synthesize.source.per_category=1",
        "warmstart.steps=0",
        "difficulty.max_new_tokens=2",
        "select.batch_size=2",
        "allocate.n=2",
        "rollout.max_new_tokens=8",
        "evaluate.max_new_tokens=8",
        "train.state_every=2",
    ]
    config = load_config(None, ["run_id=gem", *SMALL, *small, *GEM])
    try:
        execute(str(store), config)
    finally:  # the run leaves its live model (and optimizer) for a next run in this process: 1.6 GB here
        RESIDENTS.clear()
        reference_policy.cache_clear()
    s = Store.open(str(store))
    assert rows(s, "SELECT DISTINCT env FROM rollouts") == [{"env": "gym@1"}]
    rewards = rows(s, "SELECT verifier, status, score FROM rewards")
    assert rewards and {r["verifier"] for r in rewards} == {"env:gym"}
    # GEM's own rewards: -0.1 for a malformed guess, 0.0 for a game lost on guesses, 1.0 for the number; solved
    # (`ok`) only at GEM's success reward, 1.0: a -0.1 is `wrong`, never `ok` (it was, before the loop gave verdicts)
    assert {r["score"] for r in rewards} <= {-0.1, 0.0, 1.0}
    assert all(r["status"] == ("ok" if r["score"] >= 1.0 else "wrong") for r in rewards)
    verdicts = rows(s, "SELECT env_reward, json_extract_string(env_verdict, '$.status') AS status FROM rollouts")
    assert all(v["status"] == ("ok" if v["env_reward"] >= 1.0 else "wrong") for v in verdicts)
    assert rows(s, "SELECT count(*) AS n FROM train_steps")[0]["n"] == 2
    # the evaluation's accuracy is the game's own success: the last one's greedy episodes, played again, each end
    # with GEM's verdict (none scored by the synthesized problem's verifier), and `correct` counts GEM's wins
    from rlvr.tasks.evaluate import greedy_episodes
    from rlvr.trainer.checkpoints import load_policy

    last = rows(s, "SELECT correct, n, policy_id FROM evals WHERE phase = 'rl' ORDER BY step DESC LIMIT 1")[0]
    held_out = rows(s, f"SELECT * FROM problems WHERE split = '{config.evaluate.split}' ORDER BY problem_id")
    policy = load_policy(s, last["policy_id"], device=torch.device("cpu"))
    _, verdicts_again = greedy_episodes(policy, config.env, held_out, config.evaluate)
    assert last["n"] == len(held_out) and all(v is not None for v in verdicts_again)
    assert last["correct"] == sum(v.status == "ok" for v in verdicts_again)


def test_evaluation_plays_one_greedy_episode_a_problem_whose_first_turn_is_the_one_turn_answer(retry_run) -> None:
    from rlvr.environments.registry import EnvConfig
    from rlvr.tasks.evaluate import EvaluateConfig, greedy_episodes
    from rlvr.trainer.checkpoints import load_policy
    from rlvr.trainer.generation import greedy
    from rlvr.verifiers.registry import get_verifier

    store, _ = retry_run
    evals = rows(store, "SELECT phase, step, accuracy, policy_id FROM evals WHERE phase = 'rl' ORDER BY step")
    assert [e["step"] for e in evals] == [2]
    policy = load_policy(store, evals[-1]["policy_id"], device=torch.device("cpu"))
    problems = rows(store, "SELECT * FROM problems WHERE split = 'test' ORDER BY problem_id LIMIT 40")
    cfg = EvaluateConfig()
    answers, verdicts = greedy_episodes(policy, EnvConfig(type="retry", max_turns=3), problems, cfg)
    one_turn = greedy(policy, [p["prompt"] for p in problems], max_new_tokens=cfg.max_new_tokens)
    first_right = [
        get_verifier(p["verifier"]).score(a, p["reference"]).status == "ok" for p, a in zip(problems, one_turn)
    ]
    for right, verdict, answer, single in zip(first_right, verdicts, answers, one_turn):
        if right:  # greedy: the episode's first turn is the one-turn answer, so it ends there, right
            assert verdict is not None and verdict.status == "ok" and answer == single
    retried = sum(v is not None and v.status == "ok" for v in verdicts)
    assert retried >= sum(first_right)
