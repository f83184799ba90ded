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

The rollout loop (trainer/multi_turn.py) owns the tokens: it renders each reply's messages with the chat template
and appends their token ids to the trajectory at loss mask 0, and never decodes and re-tokenizes earlier turns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rlvr.verifiers.base import Score, Verifier

__all__ = ["STOP_REASONS", "Environment", "OneTurn", "Opening", "Reply", "StopReason", "ToolUse"]

Message = dict[str, str]  # {"role": ..., "content": ...}; role one of system, user, assistant, tool
StopReason = Literal["done", "max_turns", "token_budget", "tool_timeout", "error"]
STOP_REASONS: tuple[str, ...] = ("done", "max_turns", "token_budget", "tool_timeout", "error")
ToolStatus = Literal["ok", "error", "timeout", "malformed"]


@dataclass(frozen=True)
class Opening:
    """An episode's start: the conversation before the first assistant turn and the tools offered
    (OpenAI-style function schemas: {"type": "function", "function": {"name", "description", "parameters"}})."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ToolUse:
    """One tool call the environment ran (or refused) while answering a turn: for the `turns` table.
    `arguments` is the call's JSON text as the model wrote it; `output` what the model is shown (already cut
    to the environment's output limit); `status` "malformed" for a call that did not parse or named no tool."""

    name: str | None
    arguments: str
    output: str
    status: ToolStatus
    seconds: float


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one assistant turn.

    `messages`: what it appends to the conversation (role "tool" for tool results, "user" for a follow-up;
    none when the episode ends). `reward`: this turn's reward, when the environment gives one (the episode's
    reward is the sum of its turns'). `done`: the episode is over. `stop_reason`: why it ended, when `done`
    ("done" unless the environment ended it on a fault: "tool_timeout", "error"). `tool_uses`: the calls run.
    `verdict`: for a verifier's one-turn episode, its full `Score` (status, extracted answer, components).
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


class Environment(ABC):
    """Base class of every environment. Subclasses set `name` and `version` (part of the rollout stage's
    identity: a new version samples again) and implement `reset` and `step`."""

    name: ClassVar[str]
    version: ClassVar[str]

    @abstractmethod
    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        """Open an episode for `task` (a problems row: prompt, reference, metadata ...). `seed` derives from the
        run, step, problem and sample, never from the process: an environment that draws anything draws from it,
        so that a resumed step replays the same episode."""

    @abstractmethod
    def step(self, response: str) -> Reply:
        """Answer the assistant's turn `response` (its decoded text, special tokens removed)."""

    def close(self) -> None:  # noqa: B027  # optional: most environments hold nothing to release
        """Release what the episode holds (processes, files). Called once, after the last step or a failure."""


class OneTurn(Environment):
    """A verifier as an environment: the problem's prompt is the conversation, no tools, and the first assistant
    turn ends the episode with the verifier's verdict as its reward."""

    name = "one_turn"
    version = "1"

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier
        self._reference: Any = None

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        from rlvr.chat import as_messages

        self._reference = task.get("reference")
        return Opening(messages=as_messages(str(task["prompt"])))

    def step(self, response: str) -> Reply:
        score = self.verifier.score(response, self._reference)
        return Reply(reward=score.value, done=True, stop_reason="done", verdict=score)


def episode_reward(replies: Sequence[Reply]) -> float | None:
    """The sum of the turns' rewards, or None when no turn gave one."""
    given = [r.reward for r in replies if r.reward is not None]
    return float(sum(given)) if given else None
