"""evaluate: greedy accuracy of a policy on a held-out split, verified like the training rewards: one greedy episode
per problem of the run's environment, played by the rollout loop (trainer/episodes.py) as rollouts are, the
one-turn default's included (its answers are `greedy`'s). An episode is scored by the verdict the rollout loop gave
it (the environment's own, its reward against `env.solved_at`, or an error), and by the problem's verifier where the
environment leaves its final answer to one (the one-turn default always does). An answer whose verdict failed
(status error) is not correct; past `reward.max_error_rate` of them the run stops (verifiers/outcomes.py)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.environments.registry import EnvConfig
from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.engine_base import RolloutEngine
from rlvr.trainer.engines import EngineConfig, engine_for
from rlvr.trainer.episodes import episode_budgets, play_episodes
from rlvr.trainer.policy import Policy
from rlvr.trainer.prompts import check_readable
from rlvr.verifiers.base import Score
from rlvr.verifiers.cache import VerifierConfig, score_cached, verifier_identity
from rlvr.verifiers.outcomes import DEFAULT_MAX_ERROR_RATE, check_error_share, solved


class EvaluateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(50, ge=1, description="RL steps between evaluations (the last step always gets one)")
    split: str = "test"
    max_new_tokens: int = Field(3, ge=1)
    # Both left out of dumps at their defaults (`exclude_if`), so the config ids of runs from before them stay.
    samples: int = Field(
        0,
        ge=0,
        description="k answers sampled a problem beside the greedy one, scored as mean@k (0: greedy only)",
        exclude_if=lambda value: value == 0,
    )
    temperature: float = Field(
        1.0, gt=0, description="the sampled answers' temperature (top_p 1)", exclude_if=lambda value: value == 1.0
    )


def build(inputs: Inputs, cfg: EvaluateConfig, ctx: StageContext) -> Built:
    """params: `phase` (init, warmstart, rl), `verifier` (the label section: how answers are scored),
    `device` (the run's policy.device) and, when the run samples through another engine than transformers,
    `rollout` (that engine's config: the answers come from it, as the rollouts do)."""
    problems = [p for p in inputs.rows("problems") if p["split"] == cfg.split]
    if not problems:
        raise ValueError(f"evaluation split {cfg.split!r} has no problems")
    policy = inputs.load("policy", partial(load_policy, device=stage_device(ctx.params.get("device"))))
    env = ctx.params.get("env")  # None: the one-turn default
    engine = run_engine(policy, inputs.require_id("policy"), ctx)
    environment = EnvConfig() if env is None else EnvConfig.model_validate(env)
    answers, given = greedy_episodes(policy, environment, problems, cfg, engine)
    ctx.usage.update(usage(policy.model))
    max_error_rate = float(ctx.params.get("max_error_rate", DEFAULT_MAX_ERROR_RATE))
    phase = ctx.params["phase"]
    correct = count_solved(ctx, problems, answers, given, f"answers of the {phase} evaluation", max_error_rate)
    row = {
        "run_id": ctx.run_id,
        "step": ctx.step,
        "phase": phase,
        "split": cfg.split,
        "policy_id": inputs.id("policy"),
        "accuracy": correct / len(problems),
        "correct": correct,
        "n": len(problems),
    }
    if cfg.samples:
        seed = ctx.derive_seed("evaluate", ctx.step, phase)
        answers, given = sampled_episodes(policy, environment, problems, cfg, seed, engine)
        each = [p for p in problems for _ in range(cfg.samples)]
        what = f"sampled answers of the {phase} evaluation"
        row |= mean_at_k(count_solved(ctx, each, answers, given, what, max_error_rate), len(problems), cfg.samples)
    return Built(rows_to_table("evals", [row]))


def count_solved(
    ctx: StageContext,
    problems: list[dict[str, Any]],
    answers: list[str],
    given: list[Score | None],
    what: str,
    max_error_rate: float,
) -> int:
    """How many of `answers` (one a problem of `problems`, in order) are solved: by the environment's verdict where
    `given` has one, else by the problem's verifier (through the run's cache); past `max_error_rate` failed
    verdicts the run stops, naming `what`."""
    verifier: VerifierConfig = ctx.params["verifier"]
    missing = [i for i, verdict in enumerate(given) if verdict is None]  # scored by the problem's verifier
    pairs = [(answers[i], problems[i]["reference"]) for i in missing]
    names, questions = [problems[i]["verifier"] for i in missing], [problems[i]["prompt"] for i in missing]
    scores, _, _ = score_cached(ctx.store, verifier, pairs, names, questions=questions)
    verdicts, scorer = list(given), [str(ctx.params.get("environment"))] * len(problems)  # what gave each verdict
    for i, score in zip(missing, scores):
        verdicts[i], scorer[i] = score, verifier.verifier_of(problems[i]["verifier"])
    rows = [{"status": v.status, "reason": v.reason or "", "verifier": who} for v, who in zip(verdicts, scorer) if v]
    check_error_share(rows, what, max_error_rate)
    return sum(solved(who, v.status) is True for v, who in zip(verdicts, scorer) if v)


def mean_at_k(solved_answers: int, problems: int, k: int) -> dict[str, Any]:
    """mean@k of `k` sampled answers to each of `problems` problems, `solved_answers` of them right, with its Wilson
    95% interval (every answer a Bernoulli trial: the interval of the pooled proportion)."""
    from scipy.stats import binomtest  # only when sampled answers are asked for: scipy is slow to import

    trials = problems * k
    interval = binomtest(solved_answers, trials).proportion_ci(confidence_level=0.95, method="wilson")
    return {
        "samples": k,
        "sampled_correct": solved_answers,
        "mean_at_k": solved_answers / trials,
        "mean_at_k_low": float(interval.low),
        "mean_at_k_high": float(interval.high),
    }


def run_engine(policy: Policy, policy_ref: str, ctx: StageContext) -> RolloutEngine | None:
    """The run's engine, given the policy, when params name one (not transformers); None: decode on the policy
    itself (what the `transformers` engine does too)."""
    engine_cfg: EngineConfig | None = ctx.params.get("rollout")
    if engine_cfg is None:
        return None
    engine = engine_for(engine_cfg)
    engine.update_weights(policy, policy_ref)
    return engine


def greedy_episodes(
    policy: Policy,
    env: EnvConfig,
    problems: list[dict[str, Any]],
    cfg: EvaluateConfig,
    engine: RolloutEngine | None = None,
) -> tuple[list[str], list[Score | None]]:
    """One greedy episode of environment `env` per problem: each one's last answer, and the environment's verdict
    where it gave one (None: the problem's verifier scores the answer). A turn decodes at most
    `evaluate.max_new_tokens` tokens; through the run's `engine` when it has one. The one-turn default's answers
    are drawn as the engine decodes a batch of prompts greedily (`greedy`; through vllm or openai one temperature-0
    request a prompt, as `engine.greedy` sends them); an environment's episodes are keyed by the problems' places."""
    budgets = episode_budgets(env, cfg.max_new_tokens)
    settings = {"temperature": 0.0, "top_p": 1.0, "seed": 0}
    counts, keys = [1] * len(problems), list(range(len(problems))) if env.multi_turn else None
    trajectories = play_episodes(
        policy, env, problems, counts, budgets=budgets, settings=settings, row_keys=keys, engine=engine
    )
    if env.multi_turn:
        check_readable(policy.tokenizer, [t.prompt_ids for t in trajectories], f"env.type={env.type}")
    return [t.response for t in trajectories], [t.verdict for t in trajectories]


def sampled_episodes(
    policy: Policy,
    env: EnvConfig,
    problems: list[dict[str, Any]],
    cfg: EvaluateConfig,
    seed: int,
    engine: RolloutEngine | None = None,
) -> tuple[list[str], list[Score | None]]:
    """`cfg.samples` episodes a problem at `cfg.temperature`, problem by problem (all of the first problem's, then
    the next's): each one's last answer and the environment's verdict where it gave one. Keyed by the problems'
    places and `seed`, as rollouts are (rollout.seeding=row), so data-parallel ranks draw what one process draws."""
    budgets = episode_budgets(env, cfg.max_new_tokens)
    settings = {"temperature": cfg.temperature, "top_p": 1.0, "seed": seed}
    counts, keys = [cfg.samples] * len(problems), list(range(len(problems)))
    trajectories = play_episodes(
        policy, env, problems, counts, budgets=budgets, settings=settings, row_keys=keys, engine=engine
    )
    trajectories = sorted(trajectories, key=lambda t: (t.prompt_index, t.sample_index))
    return [t.response for t in trajectories], [t.verdict for t in trajectories]


def identity(cfg: EvaluateConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """How often evaluations run does not change one, and only the verifiers matter, not their pool; the
    engine counts when it is not transformers (its greedy decoding may differ in the last bits)."""
    engine = {"engine": params["rollout"].type} if params.get("rollout") is not None else {}
    return {
        "split": cfg.split,
        "max_new_tokens": cfg.max_new_tokens,
        **verifier_identity(params["verifier"]),
        "phase": params["phase"],
        **({"samples": cfg.samples, "temperature": cfg.temperature} if cfg.samples else {}),
        **engine,
        **({"env": params["env"], "environment": params["environment"]} if params.get("env") is not None else {}),
    }


EVALUATE: Stage[EvaluateConfig] = Stage(
    name="evaluate",
    code_version="4",  # 4: untaught tools taught with tool_prompt (as rollout 7); 3: solved read through
    # verifiers/outcomes.py; error verdicts counted and bounded
    section="evaluate",
    config=EvaluateConfig,
    inputs=("policy", "problems"),
    outputs={"evals": Output("evals")},
    build=build,
    identity=identity,
)
