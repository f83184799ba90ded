"""The `retry` environment: answer, hear whether it was right, try again (multi-turn self-correction).

The opening is the problem's prompt. Each assistant turn is scored by the verifier (`env.verifier`, else the
problem's own); a correct answer ends the episode with its reward, a wrong one is answered with a user message
(`options.feedback`) and the model answers again, until `env.max_turns`. An episode that never answers right ends
on max_turns without a reward of the environment's: the label stage then scores its last answer, a 0. A verdict of
status `error` (the verifier failed: a judge asked in this process, a broken reference) ends the episode with that
verdict and stop reason `error`: the model is never told that an answer no one scored is wrong.
`options.turn_discount` d scales a correct answer on assistant turn t (0-based) to d**t, so that a first-turn answer
is worth more than a corrected one (1.0, the default: any correct answer is worth 1).

No tools and no randomness: the episode is a pure function of the model's turns, so the seed is unused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlvr.chat import as_messages
from rlvr.environments.base import EnvConfig, Environment, Opening, Reply, read_options, refuse_model_verifier
from rlvr.verifiers.base import Score, Verifier


class RetryOptions(BaseModel):
    """The retry environment's own settings (`env.options`)."""

    model_config = ConfigDict(extra="forbid")

    feedback: str = Field("That is not right. Try again.", min_length=1, description="the user's reply to a miss")
    turn_discount: float = Field(1.0, gt=0, le=1, description="a correct answer on turn t earns turn_discount**t")


class RetryEnvironment(Environment):
    name = "retry"
    version = "1"
    env_keys = frozenset({"verifier"})  # every reward comes with the verifier's verdict: no solved_at
    scores_unrewarded = True  # never right within max_turns: the label stage scores the last answer

    def __init__(self, verifier: Verifier | None, options: RetryOptions) -> None:
        self.verifier, self.options = verifier, options
        self._scorer: Verifier | None = None
        self._reference: Any = None
        self._turn = 0

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        from rlvr.verifiers.registry import get_verifier

        options = read_options(RetryOptions, config)
        verifier = refuse_model_verifier(get_verifier(config.verifier)) if config.verifier else None
        return lambda: cls(verifier, options)

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        from rlvr.verifiers.registry import get_verifier

        self._scorer = self.verifier or get_verifier(str(task["verifier"]))
        self._reference, self._turn = task.get("reference"), 0
        return Opening(messages=as_messages(str(task["prompt"])))

    def step(self, response: str) -> Reply:
        assert self._scorer is not None, "reset before step"
        score: Score = self._scorer.score(response, self._reference)
        turn, self._turn = self._turn, self._turn + 1
        if score.status == "ok":
            return Reply(reward=score.value * self.options.turn_discount**turn, done=True, verdict=score)
        if score.status == "error":  # the verifier failed, not the answer: the model is not told it is wrong
            return Reply(done=True, stop_reason="error", verdict=score)
        return Reply(messages=[{"role": "user", "content": self.options.feedback}])
