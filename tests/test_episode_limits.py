"""Multi-turn episodes held to wall-clock limits (trainer/episodes.py; serial, since a busy neighbour would break
them): a gym step that loops or sleeps ends its episode on `env_timeout` within `step_timeout_s` + 2 s in thread and
process isolation, saying whether it was interrupted, could not be, or its process was killed, while the others
complete; `env.parallel_steps`, not `parallel_tools`, caps environment calls; the episode processes die with their
run, even mid-step. The model's modules are imported inside the tests: every worker of the serial part collects
this file, and only the one that runs it needs torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from rlvr.environments.registry import environment_factory
from tests.env_fixtures import eos_bias


@pytest.fixture
def policy() -> Any:
    from rlvr.trainer.policy import PolicyConfig, init_policy
    from rlvr.trainer.tiny_model import TinyModelConfig

    return init_policy(PolicyConfig(tiny=TinyModelConfig(max_positions=256)), seed=0)


def loose() -> Any:
    from rlvr.trainer.episodes import Budgets

    return Budgets(max_turns=6, max_tokens=200, max_new_tokens=12, max_tool_output_tokens=50)


def hanging(hang: str, isolation: str, pid_dir: Any) -> Any:
    options = {"make": "tests.env_fixtures:HangingGym", "kwargs": {"hang": hang, "pid_dir": str(pid_dir)}}
    config = {"type": "gym", "solved_at": 1.0, "step_timeout_s": TIMEOUT_S, "isolation": isolation, "options": options}
    return environment_factory(config)


TIMEOUT_S = 1.0
SLACK_S = 2.0


@pytest.mark.serial  # held to a wall-clock limit
@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("hang", ["loop", "sleep"])
def test_a_step_that_hangs_ends_its_episode_on_env_timeout_and_the_others_complete(policy, tmp_path, hang, isolation):
    from rlvr.trainer.episodes import run_episodes

    eos_bias(policy, 3.0)
    factories = [hanging(hang, isolation, tmp_path), hanging("none", isolation, tmp_path)]
    tasks = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    started = time.monotonic()
    stuck, *others = run_episodes(
        policy, factories, tasks, [1, 2], budgets=loose(), temperature=1.0, top_p=1.0, seed=7, row_keys=[0, 1],
        solved_at=1.0,
    )  # fmt: skip
    took = time.monotonic() - started
    assert [(t.stop_reason, t.verdict.status) for t in others] == [("done", "ok")] * 2
    assert (stuck.stop_reason, stuck.verdict.status, stuck.verdict.value) == ("env_timeout", "error", 0.0)
    fault = stuck.turns[-1]
    assert (fault.role, fault.text) == ("tool", stuck.verdict.reason)
    assert TIMEOUT_S <= fault.seconds < TIMEOUT_S + SLACK_S and took < 15, (fault.seconds, took)
    past = f"the environment's step ran past env.step_timeout_s={TIMEOUT_S:g} s"
    if isolation == "process":
        assert fault.text == f"{past}; its process was killed"
        pids = [int(p.name) for p in tmp_path.iterdir()]
        assert len(pids) == 3 and os.getpid() not in pids  # one process an episode, none of them the run's
        assert not [pid for pid in pids if alive(pid)]  # all gone: the hung one killed, the others closed
    elif hang == "loop":
        assert fault.text == f"{past} and was interrupted"
    else:
        assert fault.text.startswith(f"{past} and could not be interrupted (it is blocked outside Python bytecode")


@pytest.mark.serial  # held to a wall-clock limit
def test_env_parallel_steps_caps_environment_calls_and_parallel_tools_does_not(policy):
    from rlvr.environments.registry import EnvConfig
    from rlvr.trainer.episodes import play_episodes
    from tests.env_fixtures import ConcurrencyProbe

    eos_bias(policy, 3.0)
    env = EnvConfig(type="tests.env_fixtures:ConcurrencyProbe", max_turns=2, parallel_steps=3, parallel_tools=1)
    settings = dict(temperature=1.0, top_p=1.0, seed=0)
    ConcurrencyProbe.most = 0
    played = play_episodes(policy, env, [{"prompt": "1="}], [6], budgets=loose(), settings=settings, row_keys=[0])
    assert {t.stop_reason for t in played} == {"done"} and ConcurrencyProbe.most == 3


DIES_WITH_THE_RUN = """
import sys
from rlvr.environments import isolation
from rlvr.environments.registry import environment_factory
from tests.env_fixtures import eos_bias
options = {"make": "tests.env_fixtures:HangingGym", "kwargs": {"hang": "sleep", "sleep_s": 600}}
config = {"type": "gym", "solved_at": 1, "isolation": "process", "step_timeout_s": 600, "options": options}
episode = environment_factory(config)()
episode.reset({}, 0)
[host] = isolation._hosts.values()
print(host.process.pid, episode.pid, flush=True)
episode.step("1")  # sleeps for ten minutes in the episode's process
"""


@pytest.mark.serial  # held to a wall-clock limit
def test_the_episode_processes_die_with_the_run_even_mid_step():
    """SIGKILL of the run's process: its environment host exits within a second (it polls the run) and takes the
    episode's process, hung in a step, with it."""
    run = subprocess.Popen([sys.executable, "-c", DIES_WITH_THE_RUN], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    host, episode = (int(pid) for pid in run.stdout.readline().split())
    time.sleep(0.5)  # the step is under way
    assert os.path.exists(f"/proc/{host}") and os.path.exists(f"/proc/{episode}")
    run.send_signal(signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and (alive(host) or alive(episode)):
        time.sleep(0.1)
    assert not alive(host) and not alive(episode)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper counts as gone)."""
    from rlvr.child_guard import start_time

    return start_time(pid) is not None
