"""The `gym` environment: a text environment written elsewhere with the gym-style `reset`/`step` API, run unmodified.

The wrapped object has `reset(seed=...) -> (observation, info)` and `step(action) -> (observation, reward,
terminated, truncated, info)`: GEM (`gem-llm`, the `gem` extra) and gymnasium-style text environments. Two other
shapes of a step's result are read as well: SkyRL-gym's `{"observations": [messages], "reward", "done"}` (its
environments open with `init(prompt)` rather than `reset`, which is called with the task's prompt messages), and
OpenEnv's `StepResult` (`.observation`, `.reward`, `.done`; its actions are objects: see `action_type`).

The opening is the first observation as a user message (after `options.system`, if set); each assistant turn is
passed as the action; the reply is the next observation as a user message (a `tool` message when GEM's info says
`use_tool`) with the step's reward, and the episode is done when the step says terminated or truncated (the
final observation is then not shown: nothing follows it). GEM's `info["prefix"]`/`info["suffix"]` are put around
the observation as GEM's own observation wrapper does. An exception inside the wrapped step ends the episode with
stop reason `error`.

Verdicts: the wrapped environment gives rewards, never a verdict, so an episode is solved when its summed reward
reaches `env.solved_at`, or for GEM (`make: gem`) its success reward, `GEM_SOLVED_AT`; another maker needs
`env.solved_at`, which the factory asks for before any work.

Limits: every call into the wrapped environment (making it, reset, step, close) runs under `env.step_timeout_s`,
in a helper thread or, with `env.isolation=process`, with the whole episode in a process of its own
(environments/isolation.py); past it the episode ends with stop reason `env_timeout`.

Seeds: the wrapped environment is made fresh in each `reset` and reset with `seed mod 2**32`. Many of these
environments draw from Python's and NumPy's global generators (GEM's `reset` reseeds them), which episodes in
other threads share: each episode keeps its own copy of both global states (`GlobalRandom`), swapped in under a
process-wide lock around each call, so an episode replays the same whatever runs beside it.

Options (`env.options`): `make` ("gem", or "package.module:callable" called as `callable(id, **kwargs)`, or
`callable(**kwargs)` without an id), `id`, `kwargs`, `system`, `affixes`, `reset_seed` (false for environments
whose reset takes no seed), `observation_key` (the attribute or key holding a structured observation's text),
`action_type` and `action_field` (an import path of a class built as `action_type(**{action_field: text})`).
"""

from __future__ import annotations

import importlib
import logging
import random
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.chat import as_messages
from rlvr.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentTimeout,
    Message,
    Opening,
    Reply,
    read_options,
)
from rlvr.environments.isolation import in_episode_process, isolated_factory, run_limited
from rlvr.errors import UserError
from rlvr.verifiers.base import Score, one_line

__all__ = [
    "GEM_INSTALL",
    "GEM_SOLVED_AT",
    "GlobalRandom",
    "GymEnvironment",
    "GymOptions",
    "import_callable",
    "quiet_import",
    "required_solved_at",
]

GEM_INSTALL = "pip install -e '.[gem]' && pip install --no-deps gem-llm==0.1.0 (or `make envs`)"
SEED_MODULUS = 2**32  # NumPy's legacy seeding takes seeds below 2**32
# GEM's reward for a won game (gem.utils.constants.LanguageGameReward.success_reward; its math, QA and code tasks give
# 1 for a right answer too). What else it pays stays below it: 0 for a hint, -0.1 for an unreadable action, and
# progress as fractions of 1 that sum to 1 only when the game is won (2048's tile progress, Minesweeper's revealed
# share); GuessTheNumber out of turns pays 1 - distance/range < 1.
GEM_SOLVED_AT = 1.0

_GLOBAL_RANDOM_LOCK = threading.RLock()


class GlobalRandom:
    """One episode's own copy of the global random states (Python's `random`, NumPy's `np.random`): swapped in on
    entering, saved and swapped back out on leaving, under a process-wide lock. Starts from `seed`."""

    def __init__(self, seed: int) -> None:
        self._seed = seed % SEED_MODULUS
        self._python: Any = random.Random(self._seed).getstate()
        self._numpy: Any = None
        self._outer: tuple[Any, Any] | None = None

    def __enter__(self) -> GlobalRandom:
        _GLOBAL_RANDOM_LOCK.acquire()
        numpy = sys.modules.get("numpy")
        outer_numpy = None
        if numpy is not None:
            outer_numpy = numpy.random.get_state()
            if self._numpy is None:
                self._numpy = numpy.random.RandomState(self._seed).get_state()
            numpy.random.set_state(self._numpy)
        self._outer = (random.getstate(), outer_numpy)
        random.setstate(self._python)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._outer is not None  # entered
        outer_python, outer_numpy = self._outer
        self._python = random.getstate()
        random.setstate(outer_python)
        if outer_numpy is not None:
            numpy = sys.modules["numpy"]
            self._numpy = numpy.random.get_state()
            numpy.random.set_state(outer_numpy)
        self._outer = None
        _GLOBAL_RANDOM_LOCK.release()


def quiet_import(module: str) -> Any:
    """Import `module` without letting it configure the root logger: GEM calls logging.basicConfig(level=INFO) on
    import, which would make every library's INFO lines print in our runs. basicConfig does nothing when the root
    logger has a handler, so one is there while importing."""
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)
    try:
        return importlib.import_module(module)
    finally:
        root.removeHandler(guard)


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable named by "package.module:attribute"; a one-line UserError when it cannot be had."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UserError(f"{what} {spec!r} must be an import path 'package.module:attribute'")
    try:
        obj: Any = quiet_import(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot import {what} {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise UserError(f"{what} {spec!r} is not callable")
    return obj


class GymOptions(BaseModel):
    """The gym adapter's own settings (`env.options`)."""

    model_config = ConfigDict(extra="forbid")

    make: str = Field("gem", description="'gem' (gem.make), or 'package.module:callable' making the environment")
    id: str | None = Field(None, description="the environment id passed to the maker (GEM: 'game:Wordle-v0', ...)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the maker")
    system: str | None = Field(None, description="a system message before the first observation")
    affixes: bool = Field(True, description="put GEM's info['prefix'] and info['suffix'] around observations")
    reset_seed: bool = Field(True, description="pass the episode's seed to reset (false: reset() takes none)")
    observation_key: str | None = Field(None, description="attribute or key of a structured observation's text")
    action_type: str | None = Field(None, description="'package.module:Class' of structured actions (OpenEnv)")
    action_field: str = Field("message", description="the action class's field that gets the assistant's text")

    @model_validator(mode="after")
    def _gem_needs_an_id(self) -> GymOptions:
        if self.make == "gem" and not self.id:
            raise ValueError("make=gem needs an id, e.g. 'game:GuessTheNumber-v0-easy'")
        return self


def _gem_maker(env_id: str) -> Callable[..., Any]:
    try:
        gem = quiet_import("gem")
    except ImportError as exc:
        raise UserError(f"env.type=gym with make=gem needs GEM: {GEM_INSTALL} ({exc})") from exc
    registry = importlib.import_module("gem.envs.registration").ENV_REGISTRY
    if env_id not in registry:
        examples = ", ".join(sorted(name for name in registry if name.startswith("game:"))[:6])
        raise UserError(f"unknown GEM environment {env_id!r}; GEM registers e.g. {examples}")
    return gem.make


def _maker(options: GymOptions) -> Callable[[], Any]:
    """What makes the wrapped environment afresh: the maker with the id and keyword arguments bound."""
    make = _gem_maker(str(options.id)) if options.make == "gem" else import_callable(options.make, "env.options.make")
    args = (options.id,) if options.id is not None else ()
    return lambda: make(*args, **options.kwargs)


@dataclass(frozen=True)
class _Step:
    observation: Any
    reward: float | None
    done: bool
    info: Mapping[str, Any]


def _read_step(result: Any) -> _Step:
    """A step's result in any of the shapes the module docstring names."""
    if isinstance(result, tuple) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        return _Step(observation, _reward(reward), bool(terminated or truncated), _info(info))
    if isinstance(result, tuple) and len(result) == 4:  # the older gym API: (observation, reward, done, info)
        observation, reward, done, info = result
        return _Step(observation, _reward(reward), bool(done), _info(info))
    if isinstance(result, Mapping) and "observations" in result:  # SkyRL-gym
        return _Step(result["observations"], _reward(result.get("reward")), bool(result.get("done")), {})
    if hasattr(result, "observation") and hasattr(result, "done"):  # OpenEnv's StepResult
        return _Step(result.observation, _reward(getattr(result, "reward", None)), bool(result.done), {})
    raise TypeError(f"step returned {type(result).__name__}, not (observation, reward, terminated, truncated, info)")


def _read_reset(result: Any) -> tuple[Any, Mapping[str, Any]]:
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], _info(result[1])
    if hasattr(result, "observation"):  # OpenEnv's StepResult
        return result.observation, {}
    return result, {}


def _reward(value: Any) -> float | None:
    return None if value is None else float(value)


def _info(info: Any) -> Mapping[str, Any]:
    return info if isinstance(info, Mapping) else {}


def required_solved_at(config: EnvConfig, own: float | None, what: str) -> None:
    """Refuse, in one line, an environment that rewards without a verdict when neither `env.solved_at` nor the
    type's own success reward (`own`) says which reward counts as solved."""
    if config.solved_at is None and own is None:
        raise UserError(
            f"{what} gives rewards and no verdict, so env.solved_at must say which episode reward counts as "
            "solved (status ok), e.g. --set env.solved_at=1"
        )


class GymEnvironment(Environment):
    """A gym-style environment made by `maker`, one per episode, played turn by turn; every call into it is held
    to `limit_s` seconds (None: unlimited)."""

    name = "gym"
    version = "1"
    env_keys = frozenset({"solved_at", "step_timeout_s", "isolation"})

    def __init__(self, maker: Callable[[], Any], options: GymOptions, limit_s: float | None = None) -> None:
        self.maker = maker
        self.options = options
        self.limit_s = limit_s
        self.solved_at = GEM_SOLVED_AT if options.make == "gem" else None
        self._action_type = import_callable(options.action_type, "action_type") if options.action_type else None
        self._env: Any = None
        self._random: GlobalRandom | None = None
        self._abandoned = False  # a call timed out and may still run inside the wrapped environment

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        options = read_options(GymOptions, config)
        maker = _maker(options)
        if options.action_type:
            import_callable(options.action_type, "action_type")  # a bad path fails here, once
        own = GEM_SOLVED_AT if options.make == "gem" else None
        required_solved_at(config, own, f"env.type=gym with env.options.make={options.make}")
        if config.isolation == "process" and not in_episode_process():
            return isolated_factory(cls, config, own)
        return lambda: cls(maker, options, config.step_timeout_s)

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self.close()
        self._random, self._abandoned = GlobalRandom(seed), False
        prompt = as_messages(str(task.get("prompt", "")))
        observation, info = self._wrapped("reset", lambda: self._open(prompt, seed))
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return Opening(messages=system + self._messages(observation, info))

    def step(self, response: str) -> Reply:
        if self._env is None or self._random is None:
            raise RuntimeError("step before reset")
        action = self._action_type(**{self.options.action_field: response}) if self._action_type else response
        env = self._env
        try:
            step = self._wrapped("step", lambda: _read_step(env.step(action)))
        except EnvironmentTimeout:
            raise
        except Exception as exc:  # the wrapped environment's fault, not the model's: the episode ends in error
            reason = one_line(f"the environment's step raised {type(exc).__name__}: {exc}")
            return Reply(done=True, stop_reason="error", verdict=Score(0.0, "error", reason=reason))
        if step.done:
            return Reply(reward=step.reward, done=True, stop_reason="done")
        return Reply(messages=self._messages(step.observation, step.info), reward=step.reward)

    def close(self) -> None:
        env, self._env = self._env, None
        closer = getattr(env, "close", None)
        if callable(closer) and not self._abandoned:  # a timed-out call may still be inside it
            run_limited(closer, self.limit_s, "close")

    def _open(self, prompt: list[Message], seed: int) -> tuple[Any, Mapping[str, Any]]:
        """Make the wrapped environment and reset it: its first observation and info."""
        self._env = self.maker()
        if not hasattr(self._env, "reset") and hasattr(self._env, "init"):  # SkyRL-gym
            return _read_reset(self._env.init(prompt))
        if self.options.reset_seed:
            return _read_reset(self._env.reset(seed=seed % SEED_MODULUS))
        return _read_reset(self._env.reset())

    def _wrapped(self, what: str, call: Callable[[], Any]) -> Any:
        """`call` (into the wrapped environment) with this episode's global random state, under the limit."""
        assert self._random is not None
        with self._random:
            try:
                return run_limited(call, self.limit_s, what)
            except EnvironmentTimeout:
                self._abandoned = True
                raise

    def _messages(self, observation: Any, info: Mapping[str, Any]) -> list[Message]:
        """The observation as conversation messages."""
        key = self.options.observation_key
        if key is not None:
            observation = observation[key] if isinstance(observation, Mapping) else getattr(observation, key)
        if isinstance(observation, list) and all(isinstance(m, Mapping) for m in observation):  # SkyRL: messages
            return [{"role": str(m["role"]), "content": str(m["content"])} for m in observation]
        text = observation if isinstance(observation, str) else str(observation)
        if self.options.affixes:
            text = _affixed(text, info)
        return [{"role": "tool" if info.get("use_tool") else "user", "content": text}]


def _affixed(text: str, info: Mapping[str, Any]) -> str:
    """GEM's rendering: info's prefix before the observation, its suffix on the line after."""
    prefix, suffix = info.get("prefix"), info.get("suffix")
    if isinstance(suffix, str) and suffix:
        text = (text if text.endswith("\n") or not text else text + "\n") + suffix
    if isinstance(prefix, str):
        text = prefix + text
    return text
