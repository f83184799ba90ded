"""The `textarena` environment: a TextArena game (`textarena` 0.7.4, the `textarena` extra), run unmodified.

TextArena's API differs from gym's: `ta.make(id)`, `reset(num_players, seed)`, then `get_observation() ->
(player_id, observation)` and `step(action) -> (done, info)` for whichever player is to move, and at the end
`close() -> (rewards by player, game info)`. The model plays `options.player`; the other players of a
multi-player game are played by `options.opponent`, an import path of a callable that takes the observation text
and returns an action (a class, such as a TextArena agent, is instantiated first with no arguments).

Use the "-raw" ids (`GuessTheNumber-v0-raw`): their observations are the messages since the player's last turn,
which become one user message per turn, each line "[GAME] ..." or "[Player 1] ..." as TextArena's own wrappers
write them (the model's own action is not echoed back). The default ids wrap the game so that every observation
repeats the whole game so far, which a chat would then hold twice. Rewards come only at the end: the final
turn's reward is the model's player's, and earlier turns carry none. TextArena seeds Python's global generator
in `reset`, so each episode keeps its own global random state (environments/gym_adapter.py, `GlobalRandom`).

Verdicts: a game gives rewards, never a verdict; TextArena pays 1 for a win (`set_winner`, a one-player game's
`set_outcome(1)`), -1 for a loss, 0 for a draw and a share below 1 for a one-player game out of turns, so an episode
is solved at `TEXTARENA_SOLVED_AT` = 1 unless `env.solved_at` says otherwise. Every call into the game (the model's
move, the opponent's, reading the reward) runs under `env.step_timeout_s`, in a helper thread or, with
`env.isolation=process`, with the whole episode in a process of its own (environments/isolation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlvr.environments.base import (
    EnvConfig,
    Environment,
    EnvironmentTimeout,
    Message,
    Opening,
    Reply,
    read_options,
)
from rlvr.environments.gym_adapter import (
    SEED_MODULUS,
    GlobalRandom,
    import_callable,
    quiet_import,
    required_solved_at,
)
from rlvr.environments.isolation import in_episode_process, isolated_factory, run_limited
from rlvr.errors import UserError
from rlvr.verifiers.base import Score, one_line

__all__ = ["TEXTARENA_INSTALL", "TEXTARENA_SOLVED_AT", "TextArenaEnvironment", "TextArenaOptions"]

TEXTARENA_INSTALL = "pip install -e '.[textarena]' (or `make envs`)"
TEXTARENA_SOLVED_AT = 1.0  # a won game's reward (textarena/state.py: set_winner, set_outcome(1))
GAME_ID = -1  # TextArena's sender id of the game's own messages
MAX_OPPONENT_MOVES = 10_000  # between two of the model's turns: a game that never hands the turn back is an error


class TextArenaOptions(BaseModel):
    """The TextArena adapter's own settings (`env.options`)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(..., min_length=1, description="the game's id, e.g. 'GuessTheNumber-v0-raw'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for ta.make")
    num_players: int = Field(1, ge=1)
    player: int = Field(0, ge=0, description="the player the model plays")
    opponent: str | None = Field(None, description="'package.module:callable' playing the other players")
    system: str | None = Field(None, description="a system message before the first observation")

    @model_validator(mode="after")
    def _players(self) -> TextArenaOptions:
        if self.player >= self.num_players:
            raise ValueError(f"player {self.player} does not exist in a {self.num_players}-player game")
        if self.num_players > 1 and self.opponent is None:
            raise ValueError("a game of several players needs an opponent to play the others")
        return self


def _textarena() -> Any:
    try:
        return quiet_import("textarena")
    except ImportError as exc:
        raise UserError(f"env.type=textarena needs TextArena: {TEXTARENA_INSTALL} ({exc})") from exc


def _opponent(spec: str) -> Callable[[str], str]:
    made = import_callable(spec, "env.options.opponent")
    return made() if isinstance(made, type) else made


class TextArenaEnvironment(Environment):
    """A TextArena game, the model one of its players; every call into the game is held to `limit_s` seconds."""

    name = "textarena"
    version = "1"
    env_keys = frozenset({"solved_at", "step_timeout_s", "isolation"})
    solved_at = TEXTARENA_SOLVED_AT

    def __init__(self, make: Callable[[], Any], options: TextArenaOptions, limit_s: float | None = None) -> None:
        self.make = make
        self.options = options
        self.limit_s = limit_s
        self.opponent = _opponent(options.opponent) if options.opponent else None
        self._game: Any = None
        self._random: GlobalRandom | None = None

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        options = read_options(TextArenaOptions, config)
        textarena = _textarena()
        registry = textarena.envs.registration.ENV_REGISTRY
        if options.id not in registry:
            examples = ", ".join(sorted(name for name in registry if name.endswith("-v0-raw"))[:5])
            raise UserError(f"unknown TextArena game {options.id!r}; e.g. {examples}")
        if options.opponent:
            _opponent(options.opponent)  # a bad path fails here, once
        required_solved_at(config, cls.solved_at, "env.type=textarena")
        if config.isolation == "process" and not in_episode_process():
            return isolated_factory(cls, config, cls.solved_at)
        return lambda: cls(lambda: textarena.make(options.id, **options.kwargs), options, config.step_timeout_s)

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self.close()
        self._random = GlobalRandom(seed)
        observation = self._wrapped("reset", lambda: self._open(seed))
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return Opening(messages=system + [self._message(observation)])

    def step(self, response: str) -> Reply:
        if self._game is None or self._random is None:
            raise RuntimeError("step before reset")
        try:
            done, reward, observation = self._wrapped("step", lambda: self._move(response))
        except EnvironmentTimeout:
            raise
        except Exception as exc:  # the game's (or the opponent's) fault, not the model's: the episode ends in error
            reason = one_line(f"the game raised {type(exc).__name__}: {exc}")
            return Reply(done=True, stop_reason="error", verdict=Score(0.0, "error", reason=reason))
        if done:
            return Reply(reward=reward, done=True, stop_reason="done")
        return Reply(messages=[self._message(observation)])

    def close(self) -> None:
        self._game = None  # a game holds nothing to release; its close() is where it reports the rewards

    def _open(self, seed: int) -> Any:
        """Make the game, reset it, let the others move first where they do: the model's first observation."""
        self._game = self.make()
        self._game.reset(num_players=self.options.num_players, seed=seed % SEED_MODULUS)
        self._play_others(done=False)
        return self._game.get_observation()[1]

    def _move(self, response: str) -> tuple[bool, float | None, Any]:
        """The model's move, then the others': (done, the model's final reward, its next observation)."""
        done, _ = self._game.step(response)
        if self._play_others(done):
            return True, self._final_reward(), None
        return False, None, self._game.get_observation()[1]

    def _wrapped(self, what: str, call: Callable[[], Any]) -> Any:
        """`call` (into the game) with this episode's global random state, under the limit."""
        assert self._random is not None
        with self._random:
            return run_limited(call, self.limit_s, what)

    def _play_others(self, done: bool) -> bool:
        """Let the opponent move until it is the model's turn again or the game ends; whether it ended."""
        for _ in range(MAX_OPPONENT_MOVES):
            if done or self._game.state.current_player_id == self.options.player:
                return bool(done)
            assert self.opponent is not None  # a one-player game is always the model's turn
            player, observation = self._game.get_observation()
            done, _ = self._game.step(self.opponent(self._text(observation, player)))
        raise RuntimeError(f"the opponent moved {MAX_OPPONENT_MOVES} times without the model's turn coming")

    def _final_reward(self) -> float | None:
        closed = self._game.close()
        rewards = closed[0] if isinstance(closed, tuple) else closed  # 0.7: (rewards, game info); earlier: rewards
        if isinstance(rewards, Mapping):
            value = rewards.get(self.options.player)
            return None if value is None else float(value)
        return None if rewards is None else float(rewards)

    def _message(self, observation: Any) -> Message:
        return {"role": "user", "content": self._text(observation, self.options.player)}

    def _text(self, observation: Any, viewer: int) -> str:
        """A raw observation (a list of (sender, message, kind)) as lines "[sender] message", without the viewer's
        own actions. A wrapped game's observation is already text."""
        if isinstance(observation, str):
            return observation
        names = getattr(self._game.state, "role_mapping", {}) or {}
        lines = []
        for sender, message, *_ in observation:
            if sender == viewer:
                continue
            name = names.get(sender, "GAME" if sender == GAME_ID else f"Player {sender}")
            lines.append(f"[{name}] {message}")
        return "\n".join(lines)
