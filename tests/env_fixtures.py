"""A test-only environment that stands in for a hostile model, over the real tool path.

The built-in tiny model writes digits and `+ - * =` only, so it never writes a `<tool_call>` itself, and a whole
run of it cannot show how the rollout loop and the calculator environment bear a hanging tool, a flooding tool,
a malformed call or a model that never stops calling tools. `ScriptedToolEnvironment` is the calculator
environment (environments/calculator.py) with the python tool always offered, built by the calculator's own
factory from the run's `env` section: the real `ToolRunner`, the real sandbox, the run's tool timeout, memory and
output cap. What it replaces, and only that: for the problems given a script, the text of the assistant's turn
that `step` receives is replaced by the script's turn before the calculator environment answers it. The tokens
the model sampled, the loss mask, the budgets and the stop reasons stay the rollout loop's, and the `turns` table
keeps the model's own text on the assistant turn (the scripted call is in its tool columns).

Each problem draws one script of `options.scripts` by a hash of its problem id and `options.salt` (every episode of
a problem plays the same one, so the environment stays a pure function of the task and its turns, as the contract
asks). A script is the turns it writes, its last repeated:

- `faults`: turn 0 a malformed call (not JSON), turn 1 a python call that floods stdout far past the output cap,
  turn 2 a python call that never returns (`while True: pass`); each fault but the hang lets the episode go on.
- `hang`: the hanging call on turn 0.
- `never_stops`: a calculator call on every turn, whatever the answers (the episode can only end on a budget).
- `model`: nothing replaced; the model's own text is the turn (a final answer, scored by the verifier).

Run it with `env.type=tests.env_fixtures:ScriptedToolEnvironment`; tests/test_env_hostile.py does.

Below it, for the rollout loop's own limits (tests/test_multi_turn.py, tests/test_episode_limits.py): `HangingGym`, a
gym-style game whose step loops forever or sleeps (`env.step_timeout_s`, `env.isolation`), `ConcurrencyProbe`, an
environment that counts how many of its calls run at once (`env.parallel_steps`), and `eos_bias`, which makes the
tiny model end its turns soon or never.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.environments.base import EnvConfig, Environment, Opening, Reply, read_options
from rlvr.environments.calculator import CalculatorEnvironment

__all__ = [
    "FLOOD_BYTES",
    "SCRIPTS",
    "ConcurrencyProbe",
    "HangingGym",
    "Script",
    "ScriptedOptions",
    "ScriptedToolEnvironment",
    "script_of",
]

Script = Literal["faults", "hang", "never_stops", "model"]
FLOOD_BYTES = 10_000_000  # what the flooding program would print: far past any output cap of a test
MALFORMED = '<tool_call>{"name": "calculator", "arguments": {"expression": 12*34}</tool_call>'  # not JSON


def _call(name: str, argument: str, value: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': {argument: value}})}</tool_call>"


FLOOD = _call("python", "code", f"import sys\nsys.stdout.write('7' * {FLOOD_BYTES})")
HANG = _call("python", "code", "while True: pass")
SCRIPTS: dict[Script, tuple[str, ...]] = {  # turn t writes turns[min(t, last)]; none: the model's own text
    "faults": (MALFORMED, FLOOD, HANG),
    "hang": (HANG,),
    "never_stops": (_call("calculator", "expression", "123*45"),),
    "model": (),
}


def _default_scripts() -> list[Script]:
    return ["faults", "never_stops", "model"]


class ScriptedOptions(BaseModel):
    """The scripted environment's own settings (`env.options`)."""

    model_config = ConfigDict(extra="forbid")

    scripts: list[Script] = Field(default_factory=_default_scripts, min_length=1, description="drawn per problem")
    salt: str = Field("", description="mixed into the problem id's hash: another draw of scripts over the problems")


def script_of(problem_id: str, options: ScriptedOptions) -> Script:
    """The script a problem's episodes play: a stable hash of its id (never Python's salted `hash`)."""
    digest = hashlib.sha256(f"{options.salt}:{problem_id}".encode()).digest()
    return options.scripts[int.from_bytes(digest[:8], "big") % len(options.scripts)]


class ScriptedToolEnvironment(CalculatorEnvironment):
    """The calculator environment whose assistant turns are scripted for some problems (module docstring)."""

    name = "scripted_tools"
    version = "1"

    script: Script = "model"
    scripted: ScriptedOptions = ScriptedOptions()
    _turn: int = 0

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        scripted = read_options(ScriptedOptions, config)
        calculator = config.model_copy(update={"options": {"python": True}})
        make = super().factory(calculator)  # the calculator's runner and verifier, built as a scripted episode

        def episode() -> Environment:
            made = make()
            assert isinstance(made, ScriptedToolEnvironment)
            made.scripted = scripted
            return made

        return episode

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self.script = script_of(str(task["problem_id"]), self.scripted)
        self._turn = 0
        opened = super().reset(task, seed)
        # The tiny model reads digits and + - * = only, and its calls here are scripted (or its own text): it is shown
        # the problem alone, without the calculator's English tool prompt, so that the run passes the check that a
        # policy can read its environment's text (trainer/prompts.py `check_readable`).
        problem = [m for m in opened.messages if m["role"] != "system"]
        return Opening(messages=problem, tools=opened.tools, tools_described=True)

    def step(self, response: str) -> Reply:
        turn, self._turn = self._turn, self._turn + 1
        scripted = SCRIPTS[self.script]
        return super().step(scripted[min(turn, len(scripted) - 1)] if scripted else response)


# ---------------------------------------------------------------------------------------------
# Environments that hang or count, for the rollout loop's limits (tests/test_multi_turn.py)


class HangingGym:
    """A gym-style game (`env.type=gym`, `make: tests.env_fixtures:HangingGym`) whose step hangs as asked: `hang`
    "loop" (Python bytecode, `while True: pass`), "sleep" (blocked outside the interpreter, in `time.sleep`), or
    "none" (the game is won at once: reward 1, done). `pid_dir`: each reset leaves a file there named by the id of
    the process it runs in."""

    def __init__(self, hang: str = "none", pid_dir: str | None = None, sleep_s: float = 30.0) -> None:
        self.hang, self.pid_dir, self.sleep_s = hang, pid_dir, sleep_s

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if self.pid_dir is not None:
            (Path(self.pid_dir) / str(os.getpid())).touch()
        return "1+1=", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.hang == "loop":
            while True:
                pass
        if self.hang == "sleep":
            time.sleep(self.sleep_s)
        return "", 1.0, True, False, {}


class ConcurrencyProbe(Environment):
    """An environment (`env.type=tests.env_fixtures:ConcurrencyProbe`) whose reset and step each take 0.3 s and
    record how many of its calls ran at once (`most`, over the process): what caps environment calls."""

    name, version = "concurrency_probe", "1"
    lock = threading.Lock()
    running = 0
    most = 0

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self._call()
        return Opening(messages=[{"role": "user", "content": str(task["prompt"])}])

    def step(self, response: str) -> Reply:
        self._call()
        return Reply(reward=1.0, done=True, stop_reason="done")

    @classmethod
    def _call(cls) -> None:
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        time.sleep(0.3)
        with cls.lock:
            cls.running -= 1


def eos_bias(policy: Any, bias: float) -> None:
    """Add `bias` to the tiny model's eos logit (a hook on its LM head): turns end soon (> 0) or never (< 0).
    torch is imported here, not with this module: the serial part's workers collect test_episode_limits.py, which
    imports this module, without torch."""
    import torch

    from rlvr.trainer.tiny_model import EOS, VOCAB

    shift = torch.zeros(len(VOCAB))
    shift[VOCAB.index(EOS)] = bias
    policy.model.lm_head.register_forward_hook(lambda module, inputs, output: output + shift)
