"""One rollout path (issue 51): the one-turn default's rollouts and evaluation answers are episodes of the `OneTurn`
environment played by the episode loop (trainer/episodes.py), as every environment's are, and they are exactly
what the one-turn default drew before the loop played them: `engine.generate`'s samples (completion ids, texts,
finish reasons, and log-probs where a run stores them) and `greedy`'s answers. Checked through the stages' own
builds, for `rollout.seeding` batch (the default) and row, a refill round of dynamic sampling, the three caches,
a chat template, `flow.async_level`'s log-probs (recorded while sampling, or computed for an engine that gives
none), and the `openai` engine against a local server; the one-turn rows keep the columns they had (the
environment's columns null)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest
import torch

from rlvr.environments.base import OneTurn, Reply
from rlvr.storage.stage import Inputs, StageContext
from rlvr.tasks.evaluate import EVALUATE, EvaluateConfig
from rlvr.tasks.rollout import ROLLOUT
from rlvr.trainer.engine_base import EngineConfig, RolloutEngine
from rlvr.trainer.engines import TransformersEngine, TransformersEngineConfig
from rlvr.trainer.generation import Sample, greedy
from rlvr.trainer.grpo import GRPOConfig, behaviour_logprobs
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.remote import OpenAIEngine, OpenAIEngineConfig
from rlvr.verifiers.cache import VerifierConfig
from tests.local_servers import Server, ServerState, serving
from tests.test_multi_turn import CHATML

# Text prompts and a chat prompt (JSON messages); ragged counts with a zero, as allocations give them.
PROMPTS = ["12+3=", "7*8=", "5-2=", '[{"role": "user", "content": "9-4="}]', "40+2="]
COUNTS = [8, 5, 0, 3, 1]
BEHAVIOUR = GRPOConfig().model_dump(include={"temperature", "autocast", "micro_batch_tokens"})
ASYNC = {"behaviour": BEHAVIOUR, "staleness": 1, "logprobs": "sampling"}  # what flows/rl_step.py passes


def noisy_policy() -> Policy:
    """The tiny model with its weights shaken (fixed noise): its draws end at varied lengths, and its greedy answers
    differ from prompt to prompt (the untrained model's are all "=====")."""
    policy = init_policy(PolicyConfig(), seed=0)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=noise) * 0.3)
    return policy


@pytest.fixture
def policy() -> Policy:
    return noisy_policy()


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every response the `OneTurn` environment is asked to answer, in order."""
    seen: list[str] = []
    real = OneTurn.step

    def step(self: OneTurn, response: str) -> Reply:
        seen.append(response)
        return real(self, response)

    monkeypatch.setattr(OneTurn, "step", step)
    return seen


def problems(split: str = "train") -> pa.Table:
    return pa.Table.from_pylist(
        [
            {"problem_id": f"p{i}", "prompt": prompt, "reference": "15", "verifier": "arithmetic", "split": split}
            for i, prompt in enumerate(PROMPTS)
        ]
    )


def context(stage: str, params: dict[str, Any]) -> StageContext:
    return StageContext("one-path", 11, 2, stage, {}, {}, params={"device": "cpu", **params})


def rollouts(
    policy: Policy, cfg: EngineConfig, params: dict[str, Any], first_slot: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The rollout stage's rows (rollouts, turns) for PROMPTS x COUNTS in slots from `first_slot` (> 0: a refill
    round of dynamic sampling), and the seed it sampled with."""
    slots = [{"slot": first_slot + i, "problem_id": f"p{i}", "n_rollouts": count} for i, count in enumerate(COUNTS)]
    ctx = context("rollout", params)
    inputs = Inputs.given(allocations=pa.Table.from_pylist(slots), problems=problems(), policy=policy)
    built = ROLLOUT.build(inputs, cfg, ctx)
    seed = ctx.derive_seed("rollout", ctx.step, first_slot) if first_slot else ctx.derive_seed("rollout", ctx.step)
    return built["rollouts"].table.to_pylist(), built["turns"].table.to_pylist(), seed


def todays_draw(engine: RolloutEngine, policy: Policy, cfg: EngineConfig, seed: int, logprobs: bool) -> list[Sample]:
    """What the one-turn default sampled before the episode loop played it: `engine.generate`, the sampling policy's
    log-probs recorded at the train stage's temperature, or computed as its π_old pass would where none came."""
    engine.update_weights(policy, "given-policy")
    sampling = cfg.sampling(seed)
    if logprobs:
        sampling = replace(sampling, logprob_temperature=BEHAVIOUR["temperature"])
    samples = engine.generate(PROMPTS, COUNTS, sampling)
    if logprobs and any(s.logprobs is None for s in samples):
        computed = behaviour_logprobs(policy, PROMPTS, samples, GRPOConfig.model_validate(BEHAVIOUR))
        samples = [replace(s, logprobs=lp) for s, lp in zip(samples, computed)]
    return samples


ENV_COLUMNS = ("prompt_ids", "loss_mask", "n_turns", "stop_reason", "env", "env_reward", "env_verdict", "turn_starts")


def assert_rows_are_the_draw(
    rows: list[dict[str, Any]], drawn: list[Sample], steps: list[str], first_slot: int
) -> None:
    assert len(rows) == len(drawn) == sum(COUNTS)
    assert {(s.finish_reason) for s in drawn} == {"stop", "length"}  # both endings are compared
    for row, s in zip(rows, drawn, strict=True):
        assert (row["slot"], row["sample_index"]) == (first_slot + s.prompt_index, s.sample_index)
        assert (row["completion_ids"], row["response"], row["finish_reason"]) == (
            s.completion_ids,
            s.text,
            s.finish_reason,
        )
        assert (row["n_tokens"], row["logprobs"], row["prompt"]) == (s.n_tokens, s.logprobs, PROMPTS[s.prompt_index])
        assert [row[column] for column in ENV_COLUMNS] == [None] * len(ENV_COLUMNS)  # as before: one turn, no env
    assert steps == [s.text for s in drawn]  # each rollout was an episode of OneTurn, which answered it


TRANSFORMERS = [
    pytest.param(TransformersEngineConfig(max_new_tokens=6), {}, 0, id="default"),
    pytest.param(TransformersEngineConfig(max_new_tokens=6, seeding="row"), {}, 4, id="row-seeded-refill"),
    pytest.param(TransformersEngineConfig(max_new_tokens=6), ASYNC, 0, id="async-recorded"),
    pytest.param(
        TransformersEngineConfig(max_new_tokens=6, seeding="row", temperature=0.7, top_p=0.9), ASYNC, 0, id="row-hot"
    ),
    pytest.param(TransformersEngineConfig(max_new_tokens=6, cache="static"), ASYNC, 0, id="static-cache"),
    pytest.param(TransformersEngineConfig(max_new_tokens=6, cache="graph"), {}, 4, id="graph-cache"),
]


@pytest.mark.parametrize("cfg, params, first_slot", TRANSFORMERS)
def test_the_one_turn_default_samples_todays_tokens_through_the_episode_loop(policy, steps, cfg, params, first_slot):
    rows, turns, seed = rollouts(policy, cfg, params, first_slot)
    drawn = todays_draw(TransformersEngine(cfg), policy, cfg, seed, logprobs=bool(params))
    assert_rows_are_the_draw(rows, drawn, steps, first_slot)
    assert [(t["turn"], t["role"], t["token_start"], t["token_end"]) for t in turns] == [
        (0, "assistant", 0, s.n_tokens) for s in drawn
    ]
    assert [t["stop_reason"] for t in turns] == ["done" if s.finish_reason == "stop" else "token_budget" for s in drawn]


def test_a_chat_templates_one_turn_rollouts_are_todays_tokens(policy, steps):
    policy.tokenizer.chat_template = CHATML
    cfg = TransformersEngineConfig(max_new_tokens=6)
    rows, _, seed = rollouts(policy, cfg, ASYNC)
    assert_rows_are_the_draw(rows, todays_draw(TransformersEngine(cfg), policy, cfg, seed, logprobs=True), steps, 0)


@pytest.fixture
def server(policy: Policy) -> Iterator[tuple[str, ServerState]]:
    """The noisy tiny model behind OpenAI's completions endpoint: (base_url, what it saw)."""
    state = ServerState(policy=noisy_policy())
    with serving(Server(state)) as url:
        yield f"{url}/v1", state


@pytest.mark.parametrize("params", [{}, ASYNC], ids=["plain", "async-computed"])
def test_one_turn_rollouts_through_the_openai_engine_are_its_samples(policy, steps, server, params):
    """One request a group (n = its count, the group's seed), as `engine.generate` sends them; the server gives no
    log-probs, so with flow.async_level they are computed from the sampling policy, as before."""
    url, state = server
    cfg = OpenAIEngineConfig(base_url=url, max_new_tokens=6, model="tiny")
    rows, _, seed = rollouts(policy, cfg, params)
    sent = sorted((r["n"], r["temperature"]) for r in state.requests)  # concurrent: in any order
    assert sent == sorted((n, 1.0) for n in COUNTS if n)
    state.requests.clear()
    drawn = todays_draw(OpenAIEngine(cfg), policy, cfg, seed, logprobs=bool(params))
    assert_rows_are_the_draw(rows, drawn, steps, 0)
    assert sorted((r["n"], r["temperature"]) for r in state.requests) == sent


def evaluated(policy: Policy, params: dict[str, Any]) -> dict[str, Any]:
    cfg = EvaluateConfig(split="test", max_new_tokens=5)
    params = {"verifier": VerifierConfig(workers=0), "phase": "rl", **params}
    built = EVALUATE.build(Inputs.given(policy=policy, problems=problems("test")), cfg, context("evaluate", params))
    (row,) = built.table.to_pylist()
    return row


def test_evaluation_answers_are_todays_greedy_answers_through_the_episode_loop(policy, steps):
    row = evaluated(policy, {})
    answers = greedy(policy, PROMPTS, max_new_tokens=5)
    assert len(set(answers)) == len(PROMPTS) and "" in answers  # varied, one ends at once
    assert steps == answers and row["n"] == len(PROMPTS)


def test_evaluation_answers_through_the_openai_engine_are_its_greedy_answers(policy, steps, server):
    url, state = server
    cfg = OpenAIEngineConfig(base_url=url, model="tiny")
    evaluated(policy, {"rollout": cfg})
    assert [(r["n"], r["temperature"], r["max_tokens"]) for r in state.requests] == [(1, 0.0, 5)] * len(PROMPTS)
    engine = OpenAIEngine(cfg)
    engine.update_weights(policy, "given-policy")
    assert steps == engine.greedy(PROMPTS, 5)


def test_the_transformers_engine_continues_rows_with_the_loops_one_implementation(policy, monkeypatch):
    """One `continue_rows` on the policy: the engine's call is the loop's (`turn_decoding.continue_rows`), so its rows
    draw what the loop's keyed turns draw."""
    import rlvr.trainer.turn_decoding as turn_decoding

    calls: list[list[list[int]]] = []
    real = turn_decoding._generate_ids

    def record(policy: Policy, rows: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        calls.append([list(row) for row in rows])
        return real(policy, rows, *args, **kwargs)

    monkeypatch.setattr(turn_decoding, "_generate_ids", record)
    engine = TransformersEngine(TransformersEngineConfig())
    engine.update_weights(policy, "given-policy")
    rows, keys = [[1, 5, 6], [1, 7, 8, 9], [1, 5, 6]], [3, -4, 5]
    continued = engine.continue_rows(rows, [6, 2, 6], 0.9, 0.95, keys)
    assert calls == [rows]
    decoding = turn_decoding.PolicyDecoding(policy, 0.9, 0.95, 0, "shared_prompt", "auto", None)
    drawn = decoding.turn(rows, keys, [6, 2, 6])
    assert [ids for ids, _ in continued] == [d.ids for d in drawn] and len(continued[1][0]) <= 2
    assert continued[0][0] != continued[2][0]  # one prompt, two keys: two draws


class Ranks:
    """A rank group outside an operation that records the episodes requests it is given."""

    in_op = False

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def episodes(self, request: dict[str, Any]) -> list[Any]:
        self.requests.append(request)
        return []


def test_over_data_parallel_ranks_a_grouped_call_is_keyed_by_the_problems_places(policy):
    """Greedy answers (an evaluation) are the same whatever the keys, so the ranks split them keyed by place; a
    sampled grouped call would draw from one torch stream, which ranks cannot split: refused in one line."""
    from rlvr.environments.registry import EnvConfig
    from rlvr.trainer.episodes import Budgets, play_episodes

    policy.ranks = Ranks()
    tasks, budgets = [{"prompt": p} for p in PROMPTS], Budgets(1, 5, 5, 8)
    greedy_settings = {"temperature": 0.0, "top_p": 1.0, "seed": 0}
    play_episodes(policy, EnvConfig(), tasks, [1] * 5, budgets=budgets, settings=greedy_settings, row_keys=None)
    assert [r["keys"] for r in policy.ranks.requests] == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"^a grouped draw \(row_keys=None\) samples from one torch stream"):
        settings = {"temperature": 1.0, "top_p": 1.0, "seed": 0}
        play_episodes(policy, EnvConfig(), tasks, COUNTS, budgets=budgets, settings=settings, row_keys=None)


def test_mean_at_k_is_the_pooled_share_with_its_wilson_interval():
    from rlvr.tasks.evaluate import mean_at_k

    row = mean_at_k(7, 5, 4)  # 7 of 20 sampled answers right
    assert (row["samples"], row["sampled_correct"], row["mean_at_k"]) == (4, 7, 0.35)
    assert row["mean_at_k_low"] == pytest.approx(0.181192, abs=1e-6)  # Wilson: (p + z²/2n ± z√(p(1-p)/n + z²/4n²))
    assert row["mean_at_k_high"] == pytest.approx(0.567146, abs=1e-6)  # / (1 + z²/n), z = 1.95996
    none = mean_at_k(0, 5, 4)
    assert none["mean_at_k"] == 0.0 == none["mean_at_k_low"] and 0.0 < none["mean_at_k_high"] < 0.17


def test_a_sampled_evaluation_scores_k_answers_a_problem_with_the_problems_verifier(policy, steps):
    """evaluate.samples = 3: after the greedy answers, three sampled a problem (at evaluate.temperature, seeded by
    the step), each scored against its own problem's reference; the row's mean@k is their share, the same on a
    second evaluation, and an evaluation without samples leaves the columns null and its identity as before."""
    from rlvr.tasks.evaluate import identity
    from rlvr.verifiers.registry import get_verifier

    references = ["45", "18", "3", "18", "8731"]
    table = problems("test").set_column(2, "reference", pa.array(references))
    cfg = EvaluateConfig(split="test", max_new_tokens=5, samples=3)
    params = {"verifier": VerifierConfig(workers=0), "phase": "rl"}

    def evaluate() -> dict[str, Any]:
        built = EVALUATE.build(Inputs.given(policy=policy, problems=table), cfg, context("evaluate", params))
        return built.table.to_pylist()[0]

    row = evaluate()
    greedy_answers, sampled = steps[: len(PROMPTS)], steps[len(PROMPTS) :]
    assert greedy_answers == greedy(policy, PROMPTS, max_new_tokens=5) and len(sampled) == 3 * len(PROMPTS)
    arithmetic = get_verifier("arithmetic")
    right = [arithmetic.score(a, references[i // 3]).status == "ok" for i, a in enumerate(sampled)]
    assert 0 < sum(right) < len(right)  # the references were picked so that some are right, some wrong
    assert row["samples"] == 3 and row["sampled_correct"] == sum(right) and row["n"] == len(PROMPTS)
    assert row["mean_at_k"] == sum(right) / 15 and row["mean_at_k_low"] <= row["mean_at_k"] <= row["mean_at_k_high"]
    assert evaluate() == row and steps[-15:] == sampled  # seeded: the same draw again
    plain = EvaluateConfig(split="test", max_new_tokens=5)
    assert "samples" not in identity(plain, params) and identity(cfg, params)["samples"] == 3
    built = EVALUATE.build(Inputs.given(policy=policy, problems=table), plain, context("evaluate", params))
    assert {k: v for k, v in built.table.to_pylist()[0].items() if "k" in k or "sample" in k} == {
        "samples": None,
        "sampled_correct": None,
        "mean_at_k": None,
        "mean_at_k_low": None,
        "mean_at_k_high": None,
    }
