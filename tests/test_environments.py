"""Environments (docs/environments.md): the registry and its entry-point plugins, the `<tool_call>` parser, the
built-in tools under their limits (a hanging tool, a flooding tool, calls at once), the calculator environment
played with scripted turns, and the adapters on real GEM and TextArena games and on gym-style classes defined here."""

from __future__ import annotations

import random
import re
import textwrap
import threading
import time

import pytest

from rlvr.environments.base import OneTurn, Reply, episode_reward, reward_verdict
from rlvr.environments.calculator import CalculatorEnvironment
from rlvr.environments.gym_adapter import GlobalRandom
from rlvr.environments.registry import (
    BUILTIN,
    EnvConfig,
    check_environment,
    environment_class,
    environment_factory,
    plugin_errors,
    registered,
)
from rlvr.environments.tools import (
    CALCULATOR,
    PYTHON,
    CalculatorError,
    ParsedCall,
    ToolLimits,
    ToolRunner,
    evaluate_arithmetic,
    parse_tool_calls,
)
from rlvr.errors import UserError
from rlvr.verifiers.arithmetic import FinalNumberVerifier

SLACK_S = 2.0  # a sandboxed program's start (bubblewrap, the interpreter) and a busy neighbour on 2 cores
TASK = {"prompt": "What is 123*45?", "reference": "5535"}


def call(name: str, argument: str, value: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"{argument}": "{value}"}}}}</tool_call>'


# ----------------------------------------------------------------------------------------------
# The registry


def test_builtins_are_registered_and_an_unknown_type_names_them():
    names = registered()
    assert list(names) == ["calculator", "gym", "one_turn", "retry", "textarena"]
    assert names["calculator"] is CalculatorEnvironment and names["one_turn"] is OneTurn
    with pytest.raises(UserError) as raised:
        environment_factory({"type": "calculater"})
    assert (
        str(raised.value) == "unknown environment 'calculater'; registered: calculator, gym, one_turn, retry, textarena"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"type": "calculator", "max_turns": 0}, "env.max_turns: Input should be greater than or equal to 1"),
        ({"type": "calculator", "tool_timeout_s": 0}, "env.tool_timeout_s: Input should be greater than 0"),
        ({"type": "calculator", "turns": 3}, "env.turns: Extra inputs are not permitted"),
        ({"type": "calculator", "options": {"pyton": True}}, "env.options.pyton for 'calculator': Extra inputs"),
        ({"type": "calculator", "options": {"tool_format": "xml"}}, "env.options.tool_format for 'calculator': "),
        ({"type": "calculator", "verifier": "maths"}, "unknown verifier 'maths'; registered: "),
        ({"type": "one_turn", "options": {"x": 1}}, "env.type=one_turn takes no options; got x"),
        ({"type": "gym", "options": {}}, "env.options for 'gym': make=gem needs an id"),
        ({"type": "gym", "options": {"make": "nowhere.at_all:make"}}, "cannot import env.options.make 'nowhere"),
        ({"type": "gym", "options": {"make": "random"}}, "env.options.make 'random' must be an import path"),
        (
            {"type": "textarena", "options": {"id": "T-v0", "num_players": 2}},
            "env.options for 'textarena': a game of several players needs an opponent to play the others",
        ),
        ({"type": "nowhere.at_all:Env"}, "cannot import environment 'nowhere.at_all:Env': ModuleNotFoundError"),
        ({"type": "rlvr.verifiers.base:Score"}, "environment 'rlvr.verifiers.base:Score': <class "),
    ],
)
def test_bad_configs_are_one_line_user_errors(config, message):
    with pytest.raises(UserError) as raised:
        environment_factory(config)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_one_turn_scores_with_its_verifier_or_leaves_the_reward_to_the_label_stage():
    scored = environment_factory({"verifier": "final_number"})()
    opening = scored.reset(TASK, seed=0)
    assert opening.messages == [{"role": "user", "content": "What is 123*45?"}] and opening.tools == []
    reply = scored.step("It is 5535.")
    assert (reply.reward, reply.done, reply.stop_reason, reply.verdict.status) == (1.0, True, "done", "ok")
    unscored = environment_factory(EnvConfig())()
    unscored.reset(TASK, seed=0)
    assert unscored.step("It is 5535.") == Reply(done=True, stop_reason="done")
    assert not EnvConfig().multi_turn and EnvConfig(type="calculator").multi_turn


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A distribution on sys.path declaring rlvr.environments entry points: one good, four bad."""
    (tmp_path / "echo_env_plugin.py").write_text(
        textwrap.dedent(
            """
            from rlvr.environments.base import Environment, Opening, Reply

            class EchoEnvironment(Environment):
                name = "echo"
                version = "2"

                def __init__(self, rounds=1):
                    self.rounds = rounds
                    self.turns = 0

                def reset(self, task, seed):
                    return Opening([{"role": "user", "content": f"say {task['reference']}"}])

                def step(self, response):
                    self.turns += 1
                    if self.turns < self.rounds:
                        return Reply([{"role": "user", "content": "again"}], reward=0.5)
                    return Reply(reward=1.0, done=True, stop_reason="done")

            class Misnamed(EchoEnvironment):
                name = "something_else"

            class NotAnEnvironment:
                pass
            """
        )
    )
    dist_info = tmp_path / "echo_env_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-env-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[rlvr.environments]\n"
        "echo = echo_env_plugin:EchoEnvironment\n"
        "broken = module_that_does_not_exist:Environment\n"
        "notenv = echo_env_plugin:NotAnEnvironment\n"
        "misnamed = echo_env_plugin:Misnamed\n"
        "calculator = echo_env_plugin:EchoEnvironment\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_plugin_is_registered_and_bad_ones_are_reported(plugin_dir):
    names = registered()
    assert list(names) == sorted([*BUILTIN, "echo"])
    assert names["calculator"] is CalculatorEnvironment  # a plugin cannot shadow a built-in
    errors = plugin_errors()
    assert len(errors) == 4
    assert errors[0].startswith(
        "plugin 'broken' (module_that_does_not_exist:Environment) failed to load: ModuleNotFound"
    )
    assert errors[1].startswith("plugin 'notenv' (echo_env_plugin:NotAnEnvironment) rejected: ")
    assert errors[2] == (
        "plugin 'misnamed' (echo_env_plugin:Misnamed) rejected: class name attribute 'something_else' differs from "
        "the entry-point name 'misnamed'"
    )
    assert (
        errors[3]
        == "plugin 'calculator' (echo_env_plugin:EchoEnvironment) ignored: 'calculator' is a built-in environment"
    )
    with pytest.raises(UserError, match="^plugin 'broken' .* failed to load"):
        environment_factory({"type": "broken"})

    make = environment_factory({"type": "echo", "max_turns": 3, "options": {"rounds": 2}})
    episodes = [make(), make()]
    assert episodes[0] is not episodes[1]  # one instance per episode
    env = episodes[0]
    assert env.reset({"reference": "7"}, seed=1).messages == [{"role": "user", "content": "say 7"}]
    replies = [env.step("7"), env.step("7")]
    assert [r.done for r in replies] == [False, True] and episode_reward(replies) == 1.5
    with pytest.raises(UserError, match=r"^env.options for 'echo': got an unexpected keyword argument 'round'"):
        environment_factory({"type": "echo", "options": {"round": 2}})
    assert environment_class("echo_env_plugin:EchoEnvironment").version == "2"


# ----------------------------------------------------------------------------------------------
# Parsing tool calls


def test_one_and_several_well_formed_calls_parse_in_order():
    assert parse_tool_calls("The answer is 12.") == []
    text = (
        "Let me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ParsedCall(
            '{"name": "calculator", "arguments": {"expression": "123*45"}}', "calculator", {"expression": "123*45"}
        ),
        ParsedCall('{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}', "python", {"code": "print(1)"}),
    ]
    # a block left open at the end of the turn (the model stopped after its JSON) is read to the end
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}') == [
        ParsedCall('{"name": "calculator", "arguments": {"expression": "1+1"}}', "calculator", {"expression": "1+1"})
    ]


@pytest.mark.parametrize(
    ("block", "name", "error"),
    [
        (
            '{"name": "calculator", "arguments": {"expression": "1+1"}',
            None,
            "the tool call is not valid JSON (Expecting ',' delimiter)",
        ),
        ('{"arguments": {"expression": "1+1"}}', None, "the tool call names no tool"),
        ('["calculator"]', None, "the tool call must be one JSON object"),
        (
            '{"name": "calculator", "arguments": [1]}',
            "calculator",
            "the arguments of 'calculator' must be a JSON object",
        ),
    ],
)
def test_malformed_calls_come_back_with_an_error_and_never_raise(block, name, error):
    [parsed] = parse_tool_calls(f"<tool_call>{block}</tool_call>")
    assert (parsed.name, parsed.arguments, parsed.text) == (name, None, block)
    assert parsed.error.startswith(error)


def test_the_runner_refuses_unknown_tools_and_wrong_arguments_as_malformed():
    runner = ToolRunner({"calculator": CALCULATOR}, ToolLimits(), parallel=2)
    uses = runner.run(
        parse_tool_calls(
            call("search", "query", "x")
            + call("calculator", "expr", "1+1")
            + "<tool_call>{oops</tool_call>"
            + call("calculator", "expression", "6*7")
        )
    )
    assert [(u.name, u.status) for u in uses] == [
        ("search", "malformed"),
        ("calculator", "malformed"),
        (None, "malformed"),
        ("calculator", "ok"),
    ]
    assert uses[0].output == "error: unknown tool 'search'; the tools are calculator"
    assert uses[1].output == "error: calculator takes only 'expression', not 'expr'"
    assert uses[2].arguments == "{oops" and uses[2].output.startswith("error: the tool call is not valid JSON")
    assert (uses[3].arguments, uses[3].output) == ('{"expression": "6*7"}', "42")


# ----------------------------------------------------------------------------------------------
# The tools


def test_the_calculator_is_exact_and_refuses_everything_else():
    assert evaluate_arithmetic("123*45") == 5535
    assert evaluate_arithmetic("-(2+3)**2 // 4 % 7") == 0  # Python's precedence: (-(5**2) // 4) % 7 = -7 % 7
    assert evaluate_arithmetic("17 // 5 - 17 % 5") == 1
    assert evaluate_arithmetic("7/2") == 3.5 and evaluate_arithmetic("2**0.5") == 2**0.5
    assert evaluate_arithmetic("987654321987654321*123456789123456789") == 987654321987654321 * 123456789123456789
    for expression, reason in [
        ("1/0", "division by zero"),
        ("10**100000", "the exponent is too large"),
        ("9**2000", "the result would have more than 1000 digits"),
        ("(-8)**0.5", "the result is not a real number"),
        ("__import__('os').system('true')", "only numbers, + - * / // % **, and parentheses are allowed"),
        ("2 ++", "not an arithmetic expression"),
        ("1.5e308*10", "the result is too large"),
        ("1" * 201, "the expression is longer than 200 characters"),
    ]:
        with pytest.raises(CalculatorError, match=re.escape(reason)):
            evaluate_arithmetic(expression)


@pytest.mark.serial  # held to a wall-clock limit
def test_a_hanging_tool_times_out_within_its_limit():
    runner = ToolRunner({"python": PYTHON}, ToolLimits(timeout_s=1.0), parallel=2)
    started = time.monotonic()
    [use] = runner.run(parse_tool_calls(call("python", "code", "print('started', flush=True)\\nwhile True: pass")))
    assert use.status == "timeout" and use.output == "started\n\n[error: the program ran past the 1 s limit]"
    assert time.monotonic() - started < 1.0 + SLACK_S


def test_a_flooding_tool_is_cut_at_its_byte_cap():
    runner = ToolRunner({"python": PYTHON}, ToolLimits(timeout_s=10.0, max_output_bytes=2000), parallel=2)
    [use] = runner.run(parse_tool_calls(call("python", "code", "while True: print('x' * 1000)")))
    assert use.status == "error"
    assert use.output.endswith("\n[output cut at 2000 bytes]")
    assert len(use.output.encode()) <= 2000 + len("\n[output cut at 2000 bytes]")
    assert set(use.output.removesuffix("\n[output cut at 2000 bytes]")) == {"x", "\n"}


def test_a_failing_program_is_an_error_with_its_traceback():
    runner = ToolRunner({"python": PYTHON}, ToolLimits(), parallel=2)
    [use] = runner.run(parse_tool_calls(call("python", "code", "print(1); 1/0")))
    assert use.status == "error" and use.output.startswith("1\nTraceback") and "ZeroDivisionError" in use.output


@pytest.mark.serial  # held to a wall-clock limit
def test_calls_of_one_turn_run_at_once_up_to_the_shared_bound():
    calls = parse_tool_calls(call("python", "code", "import time; time.sleep(1.5)") * 2)
    timings = {}
    for parallel in (2, 1):
        runner = ToolRunner({"python": PYTHON}, ToolLimits(timeout_s=10.0), parallel=parallel)
        started = time.monotonic()
        assert [u.status for u in runner.run(calls)] == ["ok", "ok"]
        timings[parallel] = time.monotonic() - started
    assert timings[2] < 3.0 <= timings[1]


# ----------------------------------------------------------------------------------------------
# The calculator environment


def test_calculator_episode_tool_call_then_final_answer():
    env = environment_factory({"type": "calculator", "max_turns": 4})()
    opening = env.reset(TASK, seed=11)
    assert [m["role"] for m in opening.messages] == ["system", "user"]
    assert "<tool_call>" in opening.messages[0]["content"] and "<tool_response>" in opening.messages[0]["content"]
    assert [t["function"]["name"] for t in opening.tools] == ["calculator"]

    first = env.step("I need the product. " + call("calculator", "expression", "123*45"))
    assert first.messages == [{"role": "tool", "content": "<tool_response>\n5535\n</tool_response>"}]
    assert (first.done, first.reward, first.stop_reason) == (False, None, None)
    assert [(u.name, u.arguments, u.output, u.status) for u in first.tool_uses] == [
        ("calculator", '{"expression": "123*45"}', "5535", "ok")
    ]
    last = env.step("So 123*45 = 5535.")
    assert (last.done, last.reward, last.stop_reason, last.messages) == (True, 1.0, "done", [])
    assert (last.verdict.status, last.verdict.extracted) == ("ok", "5535")
    assert episode_reward([first, last]) == 1.0


def test_calculator_episode_wrong_answer_and_malformed_call():
    env = environment_factory({"type": "calculator", "max_turns": 4})()
    env.reset(TASK, seed=11)
    malformed = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": 123*45}}</tool_call>')
    assert not malformed.done and malformed.tool_uses[0].status == "malformed"
    assert malformed.messages[0]["content"].startswith("<tool_response>\nerror: the tool call is not valid JSON")
    wrong = env.step("The answer is 5525.")
    assert (wrong.done, wrong.reward, wrong.verdict.status) == (True, 0.0, "wrong")


@pytest.mark.serial  # held to a wall-clock limit
def test_calculator_episode_ends_on_a_tool_timeout():
    env = environment_factory(
        {"type": "calculator", "max_turns": 4, "tool_timeout_s": 1.0, "options": {"python": True}}
    )()
    opening = env.reset(TASK, seed=11)
    assert [t["function"]["name"] for t in opening.tools] == ["calculator", "python"]
    reply = env.step(call("python", "code", "while True: pass") + call("calculator", "expression", "1+1"))
    assert (reply.done, reply.stop_reason, reply.reward, reply.messages) == (True, "tool_timeout", 0.0, [])
    assert [u.status for u in reply.tool_uses] == ["timeout", "ok"]
    assert (reply.verdict.status, reply.verdict.reason) == ("timeout", "tool 'python' ran past the 1 s limit")


def test_calculator_template_format_and_the_problems_own_system_message():
    env = environment_factory({"type": "calculator", "options": {"tool_format": "template", "system": "Be brief."}})()
    prompt = '[{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 12*34?"}]'
    opening = env.reset({"prompt": prompt, "reference": "408"}, seed=0)
    assert opening.messages == [
        {"role": "system", "content": "Be brief.\n\nAnswer with a number."},
        {"role": "user", "content": "What is 12*34?"},
    ]
    assert env.step(call("calculator", "expression", "12*34")).messages == [{"role": "tool", "content": "408"}]
    verifier = environment_factory({"type": "calculator", "verifier": "arithmetic"})().verifier
    assert verifier.name == "arithmetic" and isinstance(env.verifier, FinalNumberVerifier)


# ----------------------------------------------------------------------------------------------
# The gym adapter on classes defined here


class CountdownGym:
    """Gym-style: the model must say the numbers down from the start; draws from the global `random` in step
    (without seeding it), as many text environments do."""

    def reset(self, seed=None):
        self.left = 3
        return f"Count down from {self.left}.", {"suffix": "Your turn."}

    def step(self, action):
        if action.strip() != str(self.left):
            return "wrong", -1.0, True, False, {}
        self.left -= 1
        noise = random.randint(0, 10**9)
        return f"ok {noise}", 1.0, self.left == 0, False, {}


class OldGym(CountdownGym):
    def step(self, action):
        observation, reward, terminated, _, info = super().step(action)
        return observation, reward, terminated, info


class SkyrlStyle:
    def init(self, prompt):
        return prompt + [{"role": "user", "content": "go"}], {}

    def step(self, action):
        return {"observations": [{"role": "user", "content": f"heard {action}"}], "reward": 0.25, "done": False}


class StepResult:
    def __init__(self, observation, reward, done):
        self.observation, self.reward, self.done = observation, reward, done


class EchoAction:
    def __init__(self, message):
        self.message = message


class OpenEnvStyle:
    def reset(self):
        return StepResult({"echoed": "ready"}, None, False)

    def step(self, action):
        return StepResult({"echoed": action.message.upper()}, 2.0, action.message == "stop")


class Exploding(CountdownGym):
    def step(self, action):
        raise KeyError("boom")


def gym(make, **options):
    return environment_factory(
        {"type": "gym", "max_turns": 5, "solved_at": 1.0, "options": {"make": make, **options}}
    )()


def test_gym_adapter_plays_a_gym_style_class():
    env = gym("tests.test_environments:CountdownGym", system="Count.")
    opening = env.reset({"prompt": "ignored"}, seed=5)
    assert opening.messages == [
        {"role": "system", "content": "Count."},
        {"role": "user", "content": "Count down from 3.\nYour turn."},
    ]
    replies = [env.step("3"), env.step("2"), env.step("1")]
    assert [(r.reward, r.done, r.stop_reason) for r in replies] == [
        (1.0, False, None),
        (1.0, False, None),
        (1.0, True, "done"),
    ]
    assert replies[0].messages[0]["content"].startswith("ok ")
    wrong = gym("tests.test_environments:CountdownGym")
    wrong.reset({}, seed=5)
    assert wrong.step("7") == Reply(reward=-1.0, done=True, stop_reason="done")
    old = gym("tests.test_environments:OldGym", affixes=False)
    assert old.reset({}, seed=5).messages == [{"role": "user", "content": "Count down from 3."}]
    assert (old.step("3").done, old.step("2").done, old.step("1").done) == (False, False, True)


def test_gym_adapter_reads_skyrl_and_openenv_shapes_and_ends_on_a_raising_step():
    skyrl = gym("tests.test_environments:SkyrlStyle")
    assert skyrl.reset({"prompt": "hi"}, seed=0).messages == [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]
    assert skyrl.step("yes") == Reply([{"role": "user", "content": "heard yes"}], reward=0.25)
    openenv = gym(
        "tests.test_environments:OpenEnvStyle",
        reset_seed=False,
        observation_key="echoed",
        action_type="tests.test_environments:EchoAction",
    )
    assert openenv.reset({}, seed=0).messages == [{"role": "user", "content": "ready"}]
    assert openenv.step("hello") == Reply([{"role": "user", "content": "HELLO"}], reward=2.0)
    assert openenv.step("stop") == Reply(reward=2.0, done=True, stop_reason="done")
    exploding = gym("tests.test_environments:Exploding")
    exploding.reset({}, seed=0)
    reply = exploding.step("3")
    assert (reply.done, reply.stop_reason, reply.reward) == (True, "error", None)
    assert reply.verdict.reason == "the environment's step raised KeyError: 'boom'"


def play(env, seed, actions, between=None):
    trace = [env.reset({}, seed=seed).messages]
    for action in actions:
        trace.append(env.step(action).messages)
        if between:
            between()
    return trace


def test_each_episode_keeps_its_own_global_random_state():
    """The same seed replays the same draws from the global generator, whatever other episodes (threads) and
    other code draw meanwhile; another seed draws others."""
    alone = play(gym("tests.test_environments:CountdownGym"), 5, ["3", "2"])
    assert alone == play(gym("tests.test_environments:CountdownGym"), 5, ["3", "2"])
    assert alone != play(gym("tests.test_environments:CountdownGym"), 6, ["3", "2"])
    traces = {}

    def episode(seed):
        traces[seed] = play(gym("tests.test_environments:CountdownGym"), seed, ["3", "2"], lambda: random.seed(99))

    threads = [threading.Thread(target=episode, args=(seed,)) for seed in (5, 6, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert traces[5] == alone
    state = random.getstate()
    with GlobalRandom(5):
        random.random()
    assert random.getstate() == state  # the caller's global state is left as it was


# ----------------------------------------------------------------------------------------------
# Real environments from registry packages (the `gem` and `textarena` extras: `make envs`)


def test_gem_guess_the_number_played_with_scripted_guesses():
    pytest.importorskip("gem", reason="the gem extra is not installed (make envs)")
    make = environment_factory({"type": "gym", "max_turns": 4, "options": {"id": "game:GuessTheNumber-v0-easy"}})
    env = make()
    opening = env.reset({"prompt": "unused"}, seed=3)
    [first] = opening.messages
    assert first["role"] == "user" and first["content"].startswith("You are playing Guess The Number.")
    higher = env.step("My guess: \\boxed{3}")
    assert higher.messages == [
        {
            "role": "user",
            "content": "At turn 1, you guessed 3, and the target number is higher than 3.\nEnter your next guess.",
        }
    ]
    assert (higher.reward, higher.done) == (0.0, False)
    won = env.step("\\boxed{4}")
    assert (won.reward, won.done, won.stop_reason, won.messages) == (1.0, True, "done", [])
    malformed = make()
    malformed.reset({}, seed=3)
    assert malformed.step("no idea") == Reply(reward=-0.1, done=True, stop_reason="done")
    with pytest.raises(UserError, match="^unknown GEM environment 'game:Nope'; GEM registers e.g. game:"):
        environment_factory({"type": "gym", "options": {"id": "game:Nope"}})


def test_gem_2048_replays_its_random_tiles_beside_other_episodes():
    """2048 draws each new tile from Python's global generator in `step`: interleaved with another episode and
    with other code reseeding the generator, an episode still replays its own tiles."""
    pytest.importorskip("gem", reason="the gem extra is not installed (make envs)")
    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}"]
    make = environment_factory({"type": "gym", "options": {"id": "game:Game2048-v0-easy"}})
    alone = play(make(), 7, moves)
    first, second = make(), make()
    interleaved = [first.reset({}, seed=7).messages]
    second.reset({}, seed=8)
    for move in moves:
        random.seed(0)
        second.step(move)
        interleaved.append(first.step(move).messages)
    assert interleaved == alone

    import gem  # the same game without the adapter's own random state: the interleaving changes its tiles

    raw_first, raw_second = gem.make("game:Game2048-v0-easy"), gem.make("game:Game2048-v0-easy")
    raw = [raw_first.reset(seed=7)[0]]
    raw_second.reset(seed=8)
    for move in moves:
        random.seed(0)
        raw_second.step(move)
        raw.append(raw_first.step(move)[0])
    assert [r.split("board:")[-1] for r in raw[1:]] != [m[0]["content"].split("board:")[-1] for m in alone[1:]]


def first_free_cell(observation: str) -> str:
    """A TicTacToe opponent: the first of the available moves."""
    return observation.rsplit("Available Moves: ", 1)[1].split(",")[0].strip("'")


def test_textarena_guess_the_number_and_tictactoe_against_a_scripted_opponent():
    pytest.importorskip("textarena", reason="the textarena extra is not installed (make envs)")
    env = environment_factory({"type": "textarena", "max_turns": 10, "options": {"id": "GuessTheNumber-v0-raw"}})()
    [opening] = env.reset({}, seed=3).messages
    assert opening["content"].startswith("[GAME] You are Player 0. You are playing Guess The Number.")
    assert env.step("[10]") == Reply([{"role": "user", "content": "[GAME] The target number is lower."}])
    assert env.step("[5]") == Reply([{"role": "user", "content": "[GAME] The target number is higher."}])
    assert env.step("[8]") == Reply(reward=1.0, done=True, stop_reason="done")

    game = environment_factory(
        {
            "type": "textarena",
            "max_turns": 5,
            "options": {
                "id": "TicTacToe-v0-raw",
                "num_players": 2,
                "opponent": "tests.test_environments:first_free_cell",
            },
        }
    )()
    game.reset({}, seed=1)
    after_first = game.step("[4]").messages[0]["content"]
    assert "[GAME] Player 1 placed their symbol (X) in cell 0." in after_first
    assert "[Player 1] [0]" in after_first and "[Player 0]" not in after_first  # the model's own move not echoed
    assert not game.step("[3]").done  # the opponent takes cell 1
    assert game.step("[5]") == Reply(reward=1.0, done=True, stop_reason="done")  # O on 3, 4, 5
    with pytest.raises(UserError, match="^unknown TextArena game 'Nope-v0'; e.g. "):
        environment_factory({"type": "textarena", "options": {"id": "Nope-v0"}})


# ----------------------------------------------------------------------------------------------
# The retry environment (self-correction with feedback)


def test_retry_answers_a_miss_with_feedback_and_ends_on_a_right_answer_with_its_discounted_reward():
    make = environment_factory({"type": "retry", "max_turns": 3, "options": {"turn_discount": 0.5}})
    env = make()
    opening = env.reset({"prompt": "What is 12 * 3?", "reference": "36", "verifier": "final_number"}, seed=0)
    assert opening.messages == [{"role": "user", "content": "What is 12 * 3?"}] and opening.tools == []
    miss = env.step("It is 35.")
    assert miss.messages == [{"role": "user", "content": "That is not right. Try again."}]
    assert (miss.done, miss.reward) == (False, None)
    second_miss = env.step("Then 37.")
    assert second_miss.messages == miss.messages and not second_miss.done
    hit = env.step("36")
    assert (hit.done, hit.reward, hit.messages) == (True, 0.25, [])  # right on assistant turn 2: 0.5 ** 2
    assert hit.verdict is not None and hit.verdict.status == "ok"


def test_retry_scores_with_the_configured_verifier_over_the_problems_own():
    env = environment_factory({"type": "retry", "max_turns": 2, "verifier": "final_number"})()
    env.reset({"prompt": "2+2=", "reference": "4", "verifier": "no_such_verifier"}, seed=0)
    assert env.step("the answer is 4").reward == 1.0
    with pytest.raises(UserError):
        environment_factory({"type": "retry", "options": {"turn_discount": 0}})


def test_retry_ends_on_a_verifier_error_with_that_verdict_and_never_says_wrong():
    """The problem's verifier is the judge, asked in this process (no endpoint): its `error` verdict ends the
    episode; the model is not told that an answer no one scored is wrong."""
    env = environment_factory({"type": "retry", "max_turns": 3})()
    env.reset({"prompt": "2+2=", "reference": "4", "verifier": "judge"}, seed=0)
    reply = env.step("4")
    assert (reply.done, reply.stop_reason, reply.messages, reply.reward) == (True, "error", [], None)
    assert reply.verdict.status == "error" and reply.verdict.reason.startswith("the judge scores in a run")


# ----------------------------------------------------------------------------------------------
# Keys that do nothing, verifiers that ask a model, and which reward counts as solved (issue 51)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"verifier": "final_number"},
            "env.verifier does nothing with env.type=one_turn (the default): the label stage scores one-turn "
            "rollouts, so set label.verifier, or an env.type that plays episodes (calculator, retry)",
        ),
        (
            {"type": "one_turn", "max_turns": 3},
            "env.max_turns does nothing with env.type=one_turn (the default: one completion a prompt, scored by the "
            "label stage); leave it out, or set an env.type that plays episodes (calculator, retry, gym, textarena)",
        ),
        ({"max_tokens": 64}, "env.max_tokens does nothing with env.type=one_turn (the default: "),
        (
            {"type": "retry", "tool_timeout_s": 3},
            "env.tool_timeout_s does nothing with env.type=retry: it runs no tools; leave it out",
        ),
        (
            {"type": "retry", "parallel_tools": 4},
            "env.parallel_tools does nothing with env.type=retry: it runs no tools",
        ),
        ({"type": "retry", "max_tool_calls": 4}, "env.max_tool_calls does nothing with env.type=retry: it runs no "),
        (
            {"type": "gym", "tool_memory_mb": 64, "options": {"id": "game:GuessTheNumber-v0-easy"}},
            "env.tool_memory_mb does nothing with env.type=gym: it runs no tools; leave it out",
        ),
        (
            {"type": "textarena", "verifier": "final_number", "options": {"id": "GuessTheNumber-v0-raw"}},
            "env.verifier does nothing with env.type=textarena: it scores its own episodes; leave it out",
        ),
        (
            {"type": "calculator", "step_timeout_s": 5},
            "env.step_timeout_s does nothing with env.type=calculator: only wrapped environments (gym, textarena) "
            "run their steps under a limit; leave it out",
        ),
        ({"type": "retry", "isolation": "process"}, "env.isolation does nothing with env.type=retry: only wrapped "),
        (
            {"type": "calculator", "solved_at": 1},
            "env.solved_at does nothing with env.type=calculator: every reward it gives comes with its verifier's "
            "verdict; leave it out",
        ),
        (
            {"type": "calculator", "verifier": "judge"},
            "env.verifier=judge asks a model, which an environment cannot (it scores in its own process); the label "
            "stage asks models for one-turn rollouts: env.type=one_turn with label.verifier=judge",
        ),
        (
            {"type": "retry", "verifier": "reward_model"},
            "env.verifier=reward_model asks a model, which an environment ",
        ),
        (
            {"type": "gym", "options": {"make": "tests.test_environments:CountdownGym"}},
            "env.type=gym with env.options.make=tests.test_environments:CountdownGym gives rewards and no verdict, so "
            "env.solved_at must say which episode reward counts as solved (status ok), e.g. --set env.solved_at=1",
        ),
    ],
)
def test_keys_an_environment_would_ignore_are_refused_in_one_line_naming_the_key(config, message):
    with pytest.raises(UserError) as raised:
        check_environment(EnvConfig.model_validate(config))
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_keys_an_environment_takes_pass_the_check():
    for config in [
        {},
        {"type": "one_turn"},
        {"type": "calculator", "max_turns": 4, "verifier": "arithmetic", "max_tool_calls": 2, "parallel_steps": 2},
        {"type": "retry", "max_turns": 3, "verifier": "final_number", "max_tool_output_tokens": 32},
        {"type": "gym", "solved_at": 0.5, "step_timeout_s": 5, "isolation": "process",
         "options": {"make": "tests.test_environments:CountdownGym"}},
    ]:  # fmt: skip
        check_environment(EnvConfig.model_validate(config))
    # a stored run's dump sets every key, at its default where the user set none: that passes (a resume)
    dumped = EnvConfig(type="gym", solved_at=1.0, options={"make": "tests.test_environments:CountdownGym"})
    check_environment(EnvConfig.model_validate(dumped.model_dump(mode="json")))


def test_the_success_reward_of_gem_and_textarena_is_their_own_and_a_sum_of_fractions_reaches_it():
    pytest.importorskip("gem", reason="the gem extra is not installed (make envs)")
    from gem.utils.constants import LanguageGameReward

    from rlvr.environments.gym_adapter import GEM_SOLVED_AT

    assert GEM_SOLVED_AT == LanguageGameReward.success_reward == 1.0
    assert environment_factory({"type": "gym", "options": {"id": "game:GuessTheNumber-v0-easy"}})().solved_at == 1.0
    assert environment_factory({"type": "textarena", "options": {"id": "GuessTheNumber-v0-raw"}})().solved_at == 1.0
    # ten progress rewards of a tenth: a plain sum stops one ulp short of 1.0 (0.9999999999999999)
    replies = [Reply(reward=0.1)] * 9 + [Reply(reward=0.1, done=True)]
    assert sum(r.reward for r in replies) < 1.0 and episode_reward(replies) == 1.0
    assert reward_verdict(episode_reward(replies), GEM_SOLVED_AT).status == "ok"
    assert reward_verdict(-0.1, GEM_SOLVED_AT).status == "wrong"  # GEM's unreadable guess


@pytest.mark.serial  # held to a wall-clock limit
def test_calls_past_env_max_tool_calls_are_not_run_and_get_an_error_saying_the_cap():
    env = environment_factory(
        {"type": "calculator", "max_tool_calls": 3, "parallel_tools": 4, "options": {"python": True}}
    )()
    env.reset(TASK, seed=0)
    started = time.monotonic()
    reply = env.step(call("python", "code", "import time; time.sleep(0.5); print(7)") * 40)
    took = time.monotonic() - started
    assert [(u.status, u.output) for u in reply.tool_uses[:3]] == [("ok", "7\n")] * 3  # three programs ran
    assert [(u.name, u.status, u.output, u.seconds) for u in reply.tool_uses[3:]] == [
        ("python", "error", "error: not run: at most 3 tool calls are run a turn (env.max_tool_calls)", 0.0)
    ] * 37
    assert len(reply.messages) == 40 and not reply.done  # every call is answered; the episode goes on
    assert took < 0.5 * 40 / 4, took  # forty half-second programs four at a time would take 5 s
