"""The `calculator` environment: arithmetic a model cannot do in its head (3-digit by 2-digit products), with tools.

The opening is a system message that teaches the tool-call format (environments/tools.py) and the problem's
prompt. Each assistant turn that writes tool calls is answered with one `tool` message per call; the first turn
that writes none is the final answer, scored by the configured verifier (default `final_number`) against the
task's reference. A call past the tool timeout ends the episode (`tool_timeout`, a `timeout` verdict, reward 0);
a sandbox that cannot start a program ends it with `error` and no reward.

Deterministic given the task, so the seed is unused: the calculator is a pure function of its expression, and the
python tool (offered with `options.python`) returns what the program prints, which only a program that reads the
clock, the process or its hash seed can vary. The rollout loop stores every output in the `turns` table anyway.

Options (`env.options`): `python` (offer the python tool too), `tool_format` ("prompt": the system message lists
the tools (`Opening.tools_described`) and results are wrapped in `<tool_response>` tags, for chat templates without
tools such as SmolLM2's;
"template": neither, for templates that render `Opening.tools` and tool messages themselves, such as Qwen2.5's),
`system` (text put before the tool instructions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.chat import as_messages
from rlvr.environments.base import (
    TOOL_KEYS,
    EnvConfig,
    Environment,
    Message,
    Opening,
    Reply,
    ToolUse,
    read_options,
    refuse_model_verifier,
)
from rlvr.environments.tools import (
    CALCULATOR,
    PYTHON,
    ParsedCall,
    ToolLimits,
    ToolRunner,
    parse_tool_calls,
    tool_prompt,
    tool_schema,
)
from rlvr.verifiers.base import Score, Verifier, one_line
from rlvr.verifiers.sandbox import SandboxError

__all__ = ["CalculatorEnvironment", "CalculatorOptions"]

DEFAULT_VERIFIER = "final_number"


class CalculatorOptions(BaseModel):
    """The calculator environment's own settings (`env.options`)."""

    model_config = ConfigDict(extra="forbid")

    python: bool = Field(False, description="offer the python tool beside the calculator")
    tool_format: Literal["prompt", "template"] = Field(
        "prompt", description="prompt: tools taught in the system message (ChatML); template: the chat template's"
    )
    system: str | None = Field(None, description="text before the tool instructions in the system message")


class CalculatorEnvironment(Environment):
    """Tool calls are run and answered; the first turn without one is the final answer."""

    name = "calculator"
    version = "1"
    env_keys = frozenset({"verifier", *TOOL_KEYS})  # every reward comes with the verifier's verdict: no solved_at
    scores_unrewarded = True  # no final answer (tool calls to the end): the label stage scores the last turn

    def __init__(self, verifier: Verifier, runner: ToolRunner, options: CalculatorOptions | None = None) -> None:
        self.verifier = verifier
        self.runner = runner
        self.options = options or CalculatorOptions()
        self._reference: Any = None

    @classmethod
    def factory(cls, config: EnvConfig) -> Callable[[], Environment]:
        from rlvr.verifiers.registry import get_verifier

        options = read_options(CalculatorOptions, config)
        verifier = refuse_model_verifier(get_verifier(config.verifier or DEFAULT_VERIFIER))
        tools = [CALCULATOR, PYTHON] if options.python else [CALCULATOR]
        limits = ToolLimits(config.tool_timeout_s, config.tool_memory_mb, config.max_tool_output_bytes)
        runner = ToolRunner({tool.name: tool for tool in tools}, limits, config.parallel_tools, config.max_tool_calls)
        return lambda: cls(verifier, runner, options)

    def reset(self, task: Mapping[str, Any], seed: int) -> Opening:
        self._reference = task.get("reference")
        messages = as_messages(str(task["prompt"]))
        tools = list(self.runner.tools.values())
        parts = [self.options.system] if self.options.system else []
        schemas = [tool_schema(tool) for tool in tools]
        if self.options.tool_format == "prompt":
            parts.append(tool_prompt(schemas, tagged_results=True))
        if messages[0]["role"] == "system":  # the problem's own system message goes after ours
            parts.append(messages.pop(0)["content"])
        system = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
        described = self.options.tool_format == "prompt"  # our system message teaches them
        return Opening(messages=system + messages, tools=schemas, tools_described=described)

    def step(self, response: str) -> Reply:
        calls = parse_tool_calls(response)
        if not calls:
            score = self.verifier.score(response, self._reference)
            return Reply(reward=score.value, done=True, stop_reason="done", verdict=score)
        return self._answer_calls(calls)

    def _answer_calls(self, calls: list[ParsedCall]) -> Reply:
        try:
            uses = tuple(self.runner.run(calls))
        except SandboxError as exc:
            reason = one_line(f"the sandbox could not run a tool: {exc}")
            return Reply(done=True, stop_reason="error", verdict=Score(0.0, "error", reason=reason))
        timed_out = [use for use in uses if use.status == "timeout"]
        if timed_out:
            reason = f"tool {timed_out[0].name!r} ran past the {self.runner.limits.timeout_s:g} s limit"
            verdict = Score(0.0, "timeout", reason=reason)
            return Reply(reward=0.0, done=True, stop_reason="tool_timeout", tool_uses=uses, verdict=verdict)
        return Reply(messages=[self._tool_message(use) for use in uses], tool_uses=uses)

    def _tool_message(self, use: ToolUse) -> Message:
        if self.options.tool_format == "prompt":
            return {"role": "tool", "content": f"<tool_response>\n{use.output.removesuffix(chr(10))}\n</tool_response>"}
        return {"role": "tool", "content": use.output}
