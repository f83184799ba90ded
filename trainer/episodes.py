"""The rollout loop: every rollout and every evaluation answer of a run is an episode of its environment
(environments/base.py), the one-turn default (`OneTurn`) included, played here in batches, tokens kept from the
first turn to the last, decoded on the policy in this process or through a rollout engine (vllm, openai).

Tokens in, tokens out. An episode's prompt is its opening rendered as the model reads it (`ChatRendering`); each
assistant turn's sampled ids are appended as they were drawn (loss mask 1), and each environment reply's
messages as the token ids the chat template gives them (loss mask 0), so no earlier turn is ever decoded and
tokenized again: what the loss trains on is exactly what was sampled (TRL 5224 and verl 6719 drifted there).

Batched: at each turn every running episode decodes in one batch of token-id rows (each episode's whole context).
How a turn is seeded:
- Keyed (`row_keys` given: environments' rollouts, every evaluation of an environment, a run over data-parallel
  ranks): each episode draws every turn with a key of (seed, task key, sample, turn), so its tokens do not depend on
  which others are in the batch or still running, nor on the rank count.
- Grouped (`row_keys=None`: the one-turn default's rollouts and evaluations): the first turn is a GRPO group's
  draw, `counts[i]` samples of task i's opening, decoded as the engine samples a batch of prompts (on the policy:
  every row from one torch stream seeded with `seed`, as `generation.sample` draws; through an engine: its
  `generate`, one request a group), so the one-turn default draws the tokens it drew before it was an episode.
  Later turns, for an environment that has them, are keyed by the task's place in the call.
On the policy (`PolicyDecoding`) a turn is one `continue_rows` call, the one implementation of continuing token rows
on the policy (the transformers engine's `continue_rows` is it too); through an engine (`EngineDecoding`) it is one
`engine.continue_rows` call, each row with a seed of its key (vLLM: one `generate`; a server: one request a row).
The environments' steps of a turn run side by side in a thread pool, so a slow tool does not hold the others'
steps; an environment whose calls return at once (`Environment.instant`: the one-turn default) steps in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from rlvr.environments.base import (
    ROLES,
    EnvConfig,
    Environment,
    EnvironmentTimeout,
    Opening,
    Reply,
    StopReason,
    ToolUse,
    episode_reward,
    reward_verdict,
)
from rlvr.environments.registry import environment_class, environment_factory
from rlvr.trainer.chat_tokens import ChatRendering
from rlvr.trainer.engine_base import RolloutEngine
from rlvr.trainer.generation import Cache, Precision, _decode, _eos_ids
from rlvr.trainer.policy import Policy
from rlvr.trainer.row_sampling import mix64, row_key
from rlvr.trainer.turn_decoding import EngineDecoding, PolicyDecoding, TurnDecoding
from rlvr.verifiers.base import Score, one_line

__all__ = [
    "Budgets",
    "Trajectory",
    "Turn",
    "environment_seed",
    "episode_budgets",
    "play_episodes",
    "run_episodes",
    "trajectory_from_dict",
    "turn_key",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_FAULTS = ("tool_timeout", "env_timeout", "error")  # a reply's stop reasons that outrank the turn's own cut
_ENVIRONMENT_STREAM = 0x452821E638D01377  # mixed into an episode's key to make the seed its environment resets with


@dataclass(frozen=True)
class Budgets:
    """What an episode may spend. `max_tokens` counts a trajectory's tokens after its prompt, sampled and
    environment tokens alike; a turn samples at most min(`max_new_tokens`, what `max_tokens` leaves).
    `max_tool_output_tokens`: an environment message's content is cut to this many tokens before it is appended."""

    max_turns: int
    max_tokens: int
    max_new_tokens: int
    max_tool_output_tokens: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"budget {name} must be >= 1, got {value}")


def episode_budgets(env: EnvConfig, max_new_tokens: int) -> Budgets:
    """A run's budgets for episodes of `env` whose turns sample at most `max_new_tokens` each. A one-turn episode's
    only budget is its turn's: env.max_tokens, which the one-turn default refuses to set, never cuts it."""
    max_tokens = env.max_tokens if env.multi_turn else max_new_tokens
    return Budgets(env.max_turns, max_tokens, max_new_tokens, env.max_tool_output_tokens)


@dataclass
class Turn:
    """One turn of a trajectory (a row of the store's `turns` table). `start`, `end`: its token span in
    `Trajectory.completion_ids` (empty for an environment that raised). `reward`, `tool_uses`: the reply's, on
    the environment turn that appends its messages, or on the assistant turn when the reply's messages are not
    appended (it ended the episode, or a budget did). `seconds`: the turn's share of its batch's decoding, or
    the environment's step; an assistant turn that carries the reply holds the step's seconds too (a tool
    that hung and ended the episode is timed on the turn that called it)."""

    turn: int
    role: str  # "assistant"; "tool": the reply holds a tool message, or step raised; "user": else, or reset raised
    start: int
    end: int
    text: str
    tool_uses: tuple[ToolUse, ...]
    reward: float | None
    seconds: float


@dataclass
class Trajectory:
    """One episode: its prompt, every token after it (sampled at loss mask 1, the environment's at 0), its turns
    and how it ended. `reward`: the sum of its replies' rewards (`episode_reward`; None when none gave one or the sum
    is not finite); `verdict`: how it went (`episode_verdict`), None only where the label stage scores the last
    answer. `finish_reason`: the last assistant turn's ("stop": it ended with eos; "length": a budget cut it)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None
    turns: list[Turn]
    response: str
    reward: float | None
    verdict: Score | None
    stop_reason: StopReason
    finish_reason: Literal["stop", "length"]


@dataclass
class _Episode:
    """An episode while it plays: its environment, the tokens so far and the turns."""

    prompt_index: int
    sample_index: int
    key: int  # row_key(seed, the task's key, sample index): the first turn's sampling key
    reset_seed: int = 0  # environment_seed of row_key(seed, the task's key, 0): the group's one instance
    environment: Environment | None = None
    opening: Opening | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_whole: bool = True  # every sampled token's log-prob was given (an engine's keyed turn gives none)
    turns: list[Turn] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    response: str = ""
    finish_reason: Literal["stop", "length"] = "stop"
    stop_reason: StopReason | None = None
    fault_reason: str | None = None  # why the loop ended the episode on a fault (the `error` verdict's reason)

    def add(self, ids: list[int], mask: int, logprobs: list[float] | None) -> tuple[int, int]:
        start = len(self.completion_ids)
        self.completion_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.logprobs_whole &= logprobs is not None or mask == 0 or not ids
        return start, len(self.completion_ids)

    def fault(self, role: str, problem: BaseException | str, seconds: float) -> None:
        """A fault of the environment's (it raised, timed out, or gave what cannot be used): a turn with no tokens
        saying what happened, and the episode ends (`env_timeout` for a timeout, else `error`)."""
        end = len(self.completion_ids)
        text = problem if isinstance(problem, str) else _exception_text(problem)
        self.turns.append(Turn(len(self.turns), role, end, end, text, (), None, seconds))
        self.stop_reason = "env_timeout" if isinstance(problem, EnvironmentTimeout) else "error"
        self.fault_reason = text

    def trajectory(self, with_logprobs: bool, solved_at: float | None) -> Trajectory:
        assert self.stop_reason is not None
        reward = _summed_reward(self.replies)
        return Trajectory(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs if with_logprobs and self.logprobs_whole else None,
            turns=self.turns,
            response=self.response,
            reward=reward if reward is not None and math.isfinite(reward) else None,
            verdict=self.verdict(reward, solved_at),
            stop_reason=self.stop_reason,
            finish_reason=self.finish_reason,
        )

    def verdict(self, reward: float | None, solved_at: float | None) -> Score | None:
        """The episode's verdict, so that no later stage guesses (docs/environments.md, "Verdicts"): a fault's
        `error`; else the environment's own; else, for a reward, `reward_verdict` at `solved_at` (the run's
        env.solved_at, else the environment's own); else None where the label stage scores the last answer
        (`scores_unrewarded`), `wrong` elsewhere."""
        if self.fault_reason is not None:
            return Score(0.0, "error", reason=self.fault_reason)
        if reward is not None and not math.isfinite(reward):
            return reward_verdict(reward, 0.0)  # the turns' rewards sum past the float range: an error
        last = self.replies[-1] if self.replies else None
        if last is not None and last.verdict is not None:
            return last.verdict
        if self.stop_reason in ("error", "env_timeout"):
            return Score(0.0, "error", reason=f"the environment ended the episode with stop reason {self.stop_reason}")
        threshold = solved_at if solved_at is not None else getattr(self.environment, "solved_at", None)
        if reward is not None:
            if threshold is None:
                return Score(
                    0.0,
                    "error",
                    reason="the environment gave a reward and no verdict, and env.solved_at is not set (the reward "
                    "at or above which an episode is solved)",
                )
            return reward_verdict(reward, threshold)
        if getattr(self.environment, "scores_unrewarded", False):
            return None
        return Score(0.0, "wrong", reason="the environment gave no reward")


def _exception_text(exc: BaseException) -> str:
    """An exception as one line: a timeout's own message, else "Type: message"."""
    return one_line(str(exc) if isinstance(exc, EnvironmentTimeout) else f"{type(exc).__name__}: {exc}")


def _summed_reward(replies: Sequence[Reply]) -> float | None:
    """`episode_reward`, with a sum past the float range as infinity (fsum raises there) rather than a raise."""
    try:
        return episode_reward(replies)
    except OverflowError:
        return math.inf


def _message_problem(messages: Any, what: str) -> str | None:
    """Why `messages` (an opening's or a reply's) cannot be rendered, or None: each must be a mapping whose role is
    one of ROLES and whose content is a string."""
    if not isinstance(messages, (list, tuple)):
        return f"{what} messages must be a list, got {type(messages).__name__}"
    for k, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        content = m.get("content") if isinstance(m, Mapping) else None
        if role not in ROLES:
            return one_line(f"{what} message {k} has role {role!r}; an environment's roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            return f"{what} message {k} ({role}) has content {type(content).__name__}, not a string"
    return None


def _reply_problem(reply: Reply) -> str | None:
    """Why `reply` ends its episode as a fault, or None: a reward that is not a finite number, or bad messages."""
    reward = reply.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            return one_line(f"the environment gave a reward of {reward!r}, not a number")
        if not math.isfinite(float(reward)):
            return f"the environment gave a reward of {float(reward)!r}, not a finite number"
    return _message_problem(reply.messages, "a reply's")


def turn_key(key: int, turn: int) -> int:
    """The sampling key of an episode's assistant turn `turn`, given its first turn's key (`row_key` of (seed,
    task key, sample index)): the first turn draws as `generation.sample` draws that row."""
    return key if turn == 0 else row_key(key, turn, 0)


def environment_seed(key: int) -> int:
    """The seed an episode's environment resets with: from the episode's key, never from the process; a
    non-negative 63-bit int (numpy's generators refuse negative seeds)."""
    return mix64(key ^ _ENVIRONMENT_STREAM) >> 1


def run_episodes(
    policy: Policy,
    factories: Sequence[Callable[[], Environment]],
    tasks: Sequence[Mapping[str, Any]],
    counts: Sequence[int],
    *,
    budgets: Budgets,
    temperature: float,
    top_p: float,
    seed: int,
    row_keys: Sequence[int] | None,
    cache: Cache = "shared_prompt",
    precision: Precision = "auto",
    logprob_temperature: float | None = None,
    environment_threads: int = 8,
    engine: RolloutEngine | None = None,
    solved_at: float | None = None,
) -> list[Trajectory]:
    """`counts[i]` episodes of task i, each with a fresh environment from `factories[i]`, grouped by task in order
    (as `generation.sample` groups samples). Every episode of task i resets with `environment_seed` of the key
    (seed, key i, 0), so a GRPO group plays one instance (one game, one hidden number), and episode j samples its
    turns with `turn_key`s of its key (seed, key i, j), where key i is `row_keys[i]` (one distinct int a task).
    `row_keys=None`: the call is grouped (the module's docstring): the first turn draws each task's episodes as one
    prompt's group, as the engine samples a batch of prompts, and key i is i.

    Each turn: every running episode samples at most min(max_new_tokens, what max_tokens leaves) tokens, all in
    one batch; then their environments step, side by side. An episode ends when a turn did not end with eos
    ("token_budget", unless the reply ends it on a fault: "tool_timeout", "error"), when a reply is done (its stop
    reason, "done" by default), after `max_turns` ("max_turns"), when the reply's rendered messages would leave no
    token of `max_tokens` ("token_budget"), or on a fault of its environment's, in a turn of its own while the others
    play on: "env_timeout" when a reset or step ran past its limit, "error" when the factory, reset or step raised,
    or gave what cannot be used (a reward not finite, a message of an unknown role or not text, messages the chat
    template refuses). The environment steps on every sampled turn, a cut one too, so a verifier's one-turn episode
    scores what `sample` would give it. Each
    trajectory carries its verdict (`_Episode.verdict`); `solved_at` overrides the environments' threshold for an
    episode rewarded without one (the run's env.solved_at). `environment_threads`: resets and steps at once. With
    `logprob_temperature`, the sampled tokens' log-probs (0.0 on environment tokens); `temperature` 0: greedy.
    `engine`: decode through it (`cache` and `precision` unused; a trajectory carries log-probs only when the engine
    gave all its tokens'); None: on `policy`, which always renders messages and names the eos.
    """
    _check_arguments(policy, factories, tasks, counts, row_keys, temperature, environment_threads, engine)
    rendering = ChatRendering(policy.tokenizer, _eos_ids(policy))
    decoding: TurnDecoding = (
        PolicyDecoding(policy, temperature, top_p, seed, cache, precision, logprob_temperature)
        if engine is None
        else EngineDecoding(engine, temperature, top_p, seed, logprob_temperature)
    )
    keys = list(range(len(tasks))) if row_keys is None else list(row_keys)
    resets = [environment_seed(row_key(seed, key, 0)) for key in keys]
    episodes = [
        _Episode(i, j, row_key(seed, keys[i], j), resets[i]) for i, count in enumerate(counts) for j in range(count)
    ]
    pool = ThreadPoolExecutor(environment_threads, "environment") if environment_threads else None  # 0: in place
    with pool or contextlib.nullcontext():
        try:
            _open_all(episodes, factories, tasks, rendering, pool)
            _play_turns(episodes, budgets, decoding, rendering, policy, pool, len(tasks) if row_keys is None else 0)
        finally:
            list(_each(pool, _close, [e for e in episodes if e.environment is not None]))
    return [e.trajectory(decoding.records_logprobs, solved_at) for e in episodes]


def _each(pool: ThreadPoolExecutor | None, work: Callable[[_Episode], _T], episodes: list[_Episode]) -> Iterator[_T]:
    """`work` on every episode, in order: side by side in the pool, or one after another in place without one (for
    environments that answer at once, where handing each call to a thread costs more than the call)."""
    return map(work, episodes) if pool is None else pool.map(work, episodes)


def _play_turns(
    episodes: list[_Episode],
    budgets: Budgets,
    decoding: TurnDecoding,
    rendering: ChatRendering,
    policy: Policy,
    pool: ThreadPoolExecutor | None,
    grouped_tasks: int,
) -> None:
    """Turn after turn until every episode has stopped or `max_turns` are taken: the running episodes sample in one
    batch, then their environments step side by side. `grouped_tasks` > 0: the call's task count, its first turn
    drawn by groups."""
    for turn in range(budgets.max_turns):
        running = [e for e in episodes if e.stop_reason is None]
        if not running:
            return
        _sample_turn(running, turn, budgets, decoding, policy, grouped_tasks if turn == 0 else 0)
        _step_all(running, turn == budgets.max_turns - 1, budgets, rendering, pool)


def _check_arguments(
    policy: Policy,
    factories: Sequence[Any],
    tasks: Sequence[Any],
    counts: Sequence[int],
    row_keys: Sequence[int] | None,
    temperature: float,
    environment_threads: int,
    engine: RolloutEngine | None,
) -> None:
    if engine is None and policy.ranks is not None and not policy.ranks.in_op:
        raise ValueError(
            "a policy over data-parallel ranks (train.data_parallel) plays episodes through play_episodes, which "
            "splits them over the ranks"
        )
    keys = len(tasks) if row_keys is None else len(row_keys)
    if not len(factories) == len(tasks) == len(counts) == keys:
        raise ValueError(
            f"one factory, count and row key a task: {len(tasks)} tasks, {len(factories)} factories, "
            f"{len(counts)} counts, {keys} row keys"
        )
    if any(count < 0 for count in counts):
        raise ValueError(f"counts must be >= 0, got {list(counts)}")
    if row_keys is not None and len(set(row_keys)) != len(row_keys):
        raise ValueError(f"row_keys must be distinct, got {list(row_keys)}")
    if temperature < 0:
        raise ValueError("temperature must be >= 0 (0: greedy decoding, as evaluations decode)")
    if environment_threads < 0:
        raise ValueError(f"environment_threads must be >= 0 (0: in place), got {environment_threads}")


def _open_all(
    episodes: list[_Episode],
    factories: Sequence[Callable[[], Environment]],
    tasks: Sequence[Mapping[str, Any]],
    rendering: ChatRendering,
    pool: ThreadPoolExecutor | None,
) -> None:
    """Make and reset every episode's environment (side by side) and render its prompt."""

    def open_one(episode: _Episode) -> tuple[Opening | BaseException, float]:
        started = time.perf_counter()
        try:
            episode.environment = factories[episode.prompt_index]()
            opening = episode.environment.reset(tasks[episode.prompt_index], episode.reset_seed)
            if not isinstance(opening, Opening):
                raise TypeError(f"reset returned {type(opening).__name__}, not an Opening")
            return opening, time.perf_counter() - started
        except Exception as exc:
            return exc, time.perf_counter() - started

    usable: list[tuple[_Episode, Opening, float]] = []
    for episode, (opened, seconds) in zip(episodes, _each(pool, open_one, episodes)):
        problem = opened if not isinstance(opened, Opening) else _message_problem(opened.messages, "the opening's")
        if problem is not None:
            episode.fault("user", problem, seconds)
        else:
            assert isinstance(opened, Opening)
            usable.append((episode, opened, seconds))
    rendered = rendering.openings([opened for _, opened, _ in usable])
    for (episode, opened, seconds), ids in zip(usable, rendered):
        if isinstance(ids, Exception):  # the chat template refused the opening: this episode ends, the others play
            episode.fault("user", _exception_text(ids), seconds)
        else:
            episode.prompt_ids, episode.opening = ids, opened


def _sample_turn(
    running: list[_Episode], turn: int, budgets: Budgets, decoding: TurnDecoding, policy: Policy, grouped_tasks: int
) -> None:
    """One assistant turn of every running episode, decoded in one batch: keyed, or by groups when `grouped_tasks`
    (the call's task count) is set."""
    limits = [min(budgets.max_new_tokens, budgets.max_tokens - len(e.completion_ids)) for e in running]
    rows = [e.prompt_ids + e.completion_ids for e in running]
    started = time.perf_counter()
    if grouped_tasks:
        openings: list[Opening | None] = [None] * grouped_tasks
        counts = [0] * grouped_tasks
        for episode in running:
            openings[episode.prompt_index] = openings[episode.prompt_index] or episode.opening
            counts[episode.prompt_index] += 1
        drawn = decoding.groups(rows, openings, counts, max(limits))
    else:
        drawn = decoding.turn(rows, [turn_key(e.key, turn) for e in running], limits)
    share = (time.perf_counter() - started) / len(running)
    eos = _eos_ids(policy)
    for episode, draw in zip(running, drawn, strict=True):
        ids = draw.ids
        start, end = episode.add(ids, 1, draw.logprobs)
        episode.response = _decode(policy, ids) if draw.text is None else draw.text
        episode.finish_reason = draw.finish_reason or ("stop" if ids and ids[-1] in eos else "length")
        episode.turns.append(Turn(len(episode.turns), "assistant", start, end, episode.response, (), None, share))


def _step_all(
    running: list[_Episode],
    last_turn: bool,
    budgets: Budgets,
    rendering: ChatRendering,
    pool: ThreadPoolExecutor | None,
) -> None:
    """Every running episode's environment answers its last turn (side by side); each reply is appended or
    ends the episode."""

    def step_one(episode: _Episode) -> tuple[Reply | BaseException, float]:
        assert episode.environment is not None
        started = time.perf_counter()
        try:
            reply = episode.environment.step(episode.response)
            if not isinstance(reply, Reply):
                raise TypeError(f"step returned {type(reply).__name__}, not a Reply")
            return reply, time.perf_counter() - started
        except Exception as exc:
            return exc, time.perf_counter() - started

    for episode, (reply, seconds) in zip(running, _each(pool, step_one, running)):
        if not isinstance(reply, Reply):
            episode.fault("tool", reply, seconds)
            continue
        problem = _reply_problem(reply)
        if problem is not None:
            episode.fault("tool", problem, seconds)
            continue
        try:
            _take_reply(episode, reply, seconds, last_turn, budgets, rendering)
        except Exception as exc:  # the chat template refused the reply's messages: this episode ends
            episode.fault("tool", exc, seconds)


def _take_reply(
    episode: _Episode, reply: Reply, seconds: float, last_turn: bool, budgets: Budgets, rendering: ChatRendering
) -> None:
    """Append the reply's messages as environment tokens, or end the episode (the reply's reward and tool uses
    then go on the assistant turn)."""
    episode.replies.append(reply)
    stop = _stop_reason(episode, reply, last_turn)
    if stop is None:
        limit = budgets.max_tool_output_tokens
        messages = [{**m, "content": rendering.cut(m["content"], limit)} for m in reply.messages]
        ids = rendering.reply(messages)
        if len(episode.completion_ids) + len(ids) < budgets.max_tokens:  # a token at least left to sample
            start, end = episode.add(ids, 0, None)
            role = "tool" if any(m["role"] == "tool" for m in messages) else "user"
            text = "\n".join(m["content"] for m in messages)
            episode.turns.append(
                Turn(len(episode.turns), role, start, end, text, reply.tool_uses, reply.reward, seconds)
            )
            return
        stop = "token_budget"
    assistant = episode.turns[-1]
    assistant.reward, assistant.tool_uses = reply.reward, reply.tool_uses
    assistant.seconds += seconds
    episode.stop_reason = stop


def _stop_reason(episode: _Episode, reply: Reply, last_turn: bool) -> StopReason | None:
    """Why the episode ends after this reply, before its messages are rendered; None when it goes on. An
    environment's fault names the stop even on a turn its budget cut: the tool ran and would end it anyway."""
    if reply.done and reply.stop_reason in _FAULTS:
        return reply.stop_reason
    if episode.finish_reason == "length":
        return "token_budget"
    if reply.done:
        return reply.stop_reason or "done"
    return "max_turns" if last_turn else None


def _close(episode: _Episode) -> None:
    """Close the episode's environment; a failure to close is logged, never raised over the episodes."""
    assert episode.environment is not None
    try:
        episode.environment.close()
    except Exception as exc:
        log.warning("closing environment %s failed: %s", type(episode.environment).__name__, one_line(str(exc)))


def play_episodes(
    policy: Policy,
    env: EnvConfig,
    tasks: Sequence[Mapping[str, Any]],
    counts: Sequence[int],
    *,
    budgets: Budgets,
    settings: Mapping[str, Any],
    row_keys: Sequence[int] | None,
    engine: RolloutEngine | None = None,
) -> list[Trajectory]:
    """`run_episodes` of environment `env` (one environment per episode, from its registry factory), in this
    process or, for a policy over data-parallel ranks (`policy.ranks`) decoding on itself, split over them by
    tasks: each rank plays its share with its own environments from the whole weights, and rank 0 gathers the
    trajectories. Reset seeds and sampling keys come from (seed, task key, sample, turn), so the rank count
    changes no token; a grouped call (`row_keys=None`) is keyed by the tasks' places there, which draws what one
    process draws greedily (an evaluation) and is refused when sampling (one torch stream cannot be split: the run
    config refuses rollout.seeding=batch with ranks). With an `engine` (vllm, openai) every episode plays here and
    decodes through it. `settings`: run_episodes' temperature, top_p, seed, cache, precision and
    logprob_temperature."""
    if engine is None and policy.ranks is not None and not policy.ranks.in_op:
        if row_keys is None:
            if settings.get("temperature", 0.0) != 0:
                raise ValueError(
                    "a grouped draw (row_keys=None) samples from one torch stream, which data-parallel ranks cannot "
                    "split: give row keys (rollout.seeding=row)"
                )
            row_keys = range(len(tasks))
        request = {
            "env": env.model_dump(mode="json"),
            "tasks": [dict(task) for task in tasks],
            "counts": list(counts),
            "budgets": dataclasses.asdict(budgets),
            "settings": dict(settings),
            "keys": list(row_keys),
        }
        return list(policy.ranks.episodes(request))
    make = environment_factory(env)
    return run_episodes(
        policy,
        [make] * len(tasks),
        tasks,
        counts,
        budgets=budgets,
        row_keys=row_keys,
        environment_threads=0 if environment_class(env.type).instant else env.parallel_steps,
        engine=engine,
        solved_at=env.solved_at,
        **settings,
    )


def trajectory_from_dict(raw: Mapping[str, Any]) -> Trajectory:
    """A `Trajectory` from `dataclasses.asdict` of one (as data-parallel ranks send it to rank 0)."""
    turns = [Turn(**{**turn, "tool_uses": tuple(ToolUse(**use) for use in turn["tool_uses"])}) for turn in raw["turns"]]
    verdict = None if raw["verdict"] is None else Score(**raw["verdict"])
    return Trajectory(**{**raw, "turns": turns, "verdict": verdict})
