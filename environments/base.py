"""The environment contract (docs/environments.md): what a multi-turn rollout talks to.

An `Environment` generalises a verifier. Given a task row it opens an episode with its first messages and the
tools it offers (JSON schemas); it then answers each assistant turn with its own messages (tool results, a
user's follow-up), an optional reward and whether the episode is done. A verifier is the one-turn case
(`OneTurn`): it ends after the first assistant turn, and its verdict is the reward.

One instance plays one episode: `reset` once, then `step` per assistant turn until a reply says `done` (or the
rollout loop's budgets stop the episode first), then `close`. Instances of one environment run side by side in
threads, one episode each, so an environment keeps its state on the instance. `step` never raises for what a
model wrote (a malformed tool call is answered with an error message); a tool that hangs or floods is cut by
the environment's limits and recorded in `Reply.tool_uses`.

`EnvConfig` is the run's `env` section (the type, its options and the limits every episode runs under); it sits
here so that an environment's `factory` classmethod can read it, and environments/registry.py turns it into one
instance per episode.

The rollout loop (trainer/episodes.py) owns the tokens: it renders each reply's messages with the chat template
and appends their token ids to the trajectory at loss mask 0, and never decodes and re-tokenizes earlier turns.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlvr.chat import as_messages
from rlvr.errors import UserError
from rlvr.verifiers.base import Score, Status, Verifier

__all__ = [
    "LOOP_KEYS",
    "ROLES",
    "STOP_REASONS",
    "TOOL_KEYS",
    "EnvConfig",
    "Environment",
    "EnvironmentTimeout",
    "OneTurn",
    "Opening",
    "Reply",
    "StopReason",
    "ToolUse",
    "episode_reward",
    "read_options",
    "refuse_model_verifier",
    "reward_verdict",
]

Message = dict[str, str]  # {"role": ..., "content": ...}; role one of ROLES
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
StopReason = Literal["done", "max_turns", "token_budget", "tool_timeout", "env_timeout", "error"]
STOP_REASONS: tuple[str, ...] = ("done", "max_turns", "token_budget", "tool_timeout", "env_timeout", "error")
ToolStatus = Literal["ok", "error", "timeout", "malformed"]
# The env keys the rollout loop applies to every environment that plays episodes; the others (`TOOL_KEYS`, verifier,
# step_timeout_s, isolation, solved_at) apply only to the types that name them in `Environment.env_keys`.
LOOP_KEYS: frozenset[str] = frozenset(
    {"type", "max_turns", "max_tokens", "max_tool_output_tokens", "parallel_steps", "options"}
)
TOOL_KEYS: frozenset[str] = frozenset({"tool_timeout_s", "tool_memory_mb", "parallel_tools", "max_tool_calls"})
TOOL_OUTPUT_BYTES_PER_TOKEN = 16  # the byte cap on a tool's output where it runs, per token of the later token cut
Options = TypeVar("Options", bound=BaseModel)


class EnvConfig(BaseModel):
    """The run's environment (`env`): what each rollout is an episode of, and the limits every episode runs under.
    The rollout loop enforces the turn and token budgets; the environment the tool limits. Built by the registry
    (environments/registry.py, which also exports it) into one environment per episode."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field("one_turn", min_length=1, description="a registered environment, or 'package.module:Class'")
    max_turns: int = Field(1, ge=1, description="assistant turns per episode; then stop reason max_turns")
    max_tokens: int = Field(1024, ge=1, description="tokens per trajectory after the prompt (sampled + environment's)")
    max_tool_output_tokens: int = Field(
        256, ge=1, description="an environment's message (a tool's output, an observation) is cut to this many tokens"
    )
    tool_timeout_s: float = Field(5.0, gt=0, le=600, description="wall-clock seconds per tool call")
    tool_memory_mb: int = Field(512, ge=16, description="memory per tool call (the python tool's address space)")
    parallel_tools: int = Field(2, ge=1, description="tool calls running at once, across the episodes")
    max_tool_calls: int = Field(8, ge=1, description="tool calls run per assistant turn; those past it get an error")
    parallel_steps: int = Field(8, ge=1, description="environment resets and steps running at once, across episodes")
    step_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="wall-clock seconds of a reset or step; past it: stop reason env_timeout"
    )
    isolation: Literal["thread", "process"] = Field(
        "thread", description="where a wrapped environment runs: a thread of the run's, or a process of its own"
    )
    solved_at: float | None = Field(
        None,
        allow_inf_nan=False,
        description="an episode rewarded without a verdict is solved at this reward or more (unset: the type's own)",
    )
    verifier: str | None = Field(None, description="scores the final answer (calculator, retry)")
    options: dict[str, Any] = Field(default_factory=dict, description="the environment type's own settings")

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes of an environment; `one_turn` is the one-completion path of old."""
        return self.type != "one_turn"

    @property
    def max_tool_output_bytes(self) -> int:
        """The byte cap applied where a tool runs (a generous bound on the token cut that follows)."""
        return self.max_tool_output_tokens * TOOL_OUTPUT_BYTES_PER_TOKEN


def read_options(model: type[Options], config: EnvConfig) -> Options:
    """`config.options` checked against an environment's options model (extra="forbid" catches misspelt keys);
    a bad one is a one-line UserError naming the key."""
    try:
        return model.model_validate(config.options)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = "".join(f".{part}" for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        raise UserError(f"env.options{where} for {config.type!r}: {message}") from exc


@dataclass(frozen=True)
class Opening:
    """An episode's start: the conversation before the first assistant turn and the tools offered
    (OpenAI-style function schemas: {"type": "function", "function": {"name", "description", "parameters"}}).
    `tools_described`: the messages already teach the tools (the calculator's own tool prompt), so the rollout loop
    adds no tools message of its own for a chat template that renders none."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tools_described: bool = False


@dataclass(frozen=True)
class ToolUse:
    """One tool call the environment ran (or refused) while answering a turn: for the `turns` table.
    `arguments` is the call's arguments as JSON text (for a malformed call, the call's text as the model wrote it);
    `output` what the model is shown (already cut to the environment's output limit in bytes; the rollout loop cuts
    it to tokens); `status` "malformed" for a call that did not parse, named no tool or an unknown one, or gave
    arguments the tool does not take."""

    name: str | None
    arguments: str
    output: str
    status: ToolStatus
    seconds: float


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one assistant turn.

    `messages`: what it appends to the conversation (role "tool" for tool results, "user" for a follow-up;
    none when the episode ends). `reward`: this turn's reward, when the environment gives one (a finite number;
    the episode's reward is the sum of its turns'; NaN or infinity ends the episode in error). `done`: the episode
    is over. `stop_reason`: why it ended, when `done` ("done" unless the environment ended it on a fault:
    "tool_timeout", "error"). `tool_uses`: the calls run. `verdict`: the episode's `Score` when the environment
    judged it (a verifier's status, extracted answer, components; a fault's `error`); without one the rollout loop
    decides by the reward and `solved_at`.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    stop_reason: StopReason | None = None
    tool_uses: tuple[ToolUse, ...] = ()
    verdict: Score | None = None

    def __post_init__(self) -> None:
        if self.done and self.messages:
            raise ValueError("a reply that ends the episode appends no messages")
        if self.stop_reason is not None and self.stop_reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {self.stop_reason!r}; expected one of {STOP_REASONS}")


class EnvironmentTimeout(Exception):
    """A reset or step that ran past `env.step_timeout_s` (raised by the wrapped environments' adapters): the
    rollout loop ends the episode with stop reason `env_timeout` and an `error` verdict whose reason is this
    exception's message (whether the hung work was killed, interrupted, or could not be stopped)."""


class Environment(ABC):
    """Base class of every environment. Subclasses set `name` and `version` (part of the rollout stage's
    identity: a new version samples again) and implement `reset` and `step`.

    What a type declares about itself, read by the rollout loop and by `check_environment`
    (environments/registry.py), which refuses the `env` keys a type would ignore:
    - `env_keys`: the keys of `env` it honours beyond the rollout loop's own (`LOOP_KEYS`, which every type that
      plays episodes honours): `verifier` (it scores with one), the tool keys (`TOOL_KEYS`: it runs tools),
      `step_timeout_s` and `isolation` (its reset and step run under the limit, where `isolation` says), and
      `solved_at` (it may reward an episode without a verdict; the default, as the loop cannot know).
    - `solved_at`: the reward at or above which an episode it rewards without a verdict is solved (status `ok`),
      unless `env.solved_at` says otherwise; None: the type has no such reward, and a reward without a verdict
      needs `env.solved_at`. An instance may set its own (the gym adapter: GEM's success reward for `make: gem`).
    - `scores_unrewarded`: an episode that ends with no reward and no verdict is left to the label stage, which
      scores its last answer with the problem's verifier (one_turn, calculator, retry); otherwise it is `wrong`.
    - `instant`: its reset, step and close return at once (no tool, no process, no network), so the rollout loop
      calls them in place, one after another, rather than handing each to its thread pool, which costs more than
      the call (the one-turn default: every rollout of a run is one of its episodes).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    env_keys: ClassVar[frozenset[str]] = frozenset({"solved_at"})
    solved_at: float | None = None
    scores_unrewarded: ClassVar[bool] = False
    instant: ClassVar[bool] = False

    @abstractmethod
    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        """Open an episode for `task` (a problems row: prompt, reference, metadata ...). `seed` derives from the
        run, step, problem and sample, never from the process: an environment that draws anything draws from it,
        so that a resumed step replays the same episode."""

    @abstractmethod
    def step(self, response: str) -> Reply:
        """Answer the assistant's turn `response` (its decoded text, special tokens removed)."""

    def close(self) -> None:  # optional: most environments hold nothing to release
        """Release what the episode holds (processes, files). Called once, after the last step or a failure."""

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        """How the registry (environments/registry.py) builds this environment's episodes from a run's `env` config:
        check the config once, here, and return what is called once per episode. By default the episode is
        `cls(**config.options)`; an environment that reads the shared limits (tool timeout, memory, verifier)
        overrides this. Raises UserError for options the class does not take."""
        options = dict(config.options)
        try:
            inspect.signature(cls).bind(**options)
        except TypeError as exc:
            raise UserError(f"env.options for {cls.name!r}: {exc}") from exc
        return partial(cls, **options)


class OneTurn(Environment):
    """A verifier as an environment: the problem's prompt is the conversation, no tools, and the first assistant
    turn ends the episode with the verifier's verdict as its reward. Without a verifier the episode ends with no
    reward, and the label stage scores the response with the problem's own verifier.

    The default environment (`env.type=one_turn`): every rollout and evaluation answer of a run without another
    environment is one of its episodes, with no verifier (the label stage scores them; `env.verifier` is refused),
    played by the rollout loop (trainer/episodes.py), which draws its one turn as the engine samples a batch of
    prompts, so its tokens are `engine.generate`'s. `instant`: its step is a verifier's score at most."""

    name = "one_turn"
    version = "1"
    env_keys = frozenset({"verifier"})
    scores_unrewarded = True
    instant = True

    def __init__(self, verifier: Verifier | None = None) -> None:
        self.verifier = verifier
        self._reference: Any = None

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        from rlvr.verifiers.registry import get_verifier

        if config.options:
            raise UserError(f"env.type=one_turn takes no options; got {', '.join(sorted(config.options))}")
        verifier = refuse_model_verifier(get_verifier(config.verifier)) if config.verifier else None
        return partial(cls, verifier)

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self._reference = task.get("reference")
        return Opening(messages=as_messages(str(task["prompt"])))

    def step(self, response: str) -> Reply:
        if self.verifier is None:
            return Reply(done=True, stop_reason="done")
        score = self.verifier.score(response, self._reference)
        return Reply(reward=score.value, done=True, stop_reason="done", verdict=score)


def refuse_model_verifier(verifier: Verifier) -> Verifier:
    """`verifier`, unless it asks a model (a judge, a reward model: `needs` an endpoint): an environment scores in
    its own process, where no endpoint is configured and a failed call would be a silent 0; a one-line UserError."""
    if verifier.needs != "nothing":
        raise UserError(
            f"env.verifier={verifier.name} asks a model, which an environment cannot (it scores in its own process); "
            f"the label stage asks models for one-turn rollouts: env.type=one_turn with label.verifier={verifier.name}"
        )
    return verifier


def reward_verdict(reward: float, solved_at: float) -> Score:
    """The verdict of an episode whose environment gave `reward` and no verdict of its own: solved (status `ok`) at
    `solved_at` or more, else `wrong`; a reward that is not a finite number is no reward (`error`), never trained on."""
    if not math.isfinite(reward):
        return Score(0.0, "error", reason=f"the environment gave a reward of {reward!r}, not a finite number")
    status: Status = "ok" if reward >= solved_at else "wrong"
    relation = ">=" if status == "ok" else "<"
    return Score(reward, status, reason=f"reward {reward:g} {relation} env.solved_at {solved_at:g}")


def episode_reward(replies: Sequence[Reply]) -> float | None:
    """The sum of the turns' rewards, or None when no turn gave one. Summed exactly (`math.fsum`): games that pay
    progress in fractions of their success reward (GEM's 2048: 1/3 + 1/3 + 1/3) reach it exactly, where a plain
    sum can stop one ulp short of `solved_at`."""
    given = [float(r.reward) for r in replies if r.reward is not None]
    return math.fsum(given) if given else None
