"""Tool calls inside an assistant turn: parsing them, and running the built-in tools under limits.

The format is Hermes-style, what Qwen2.5's chat template renders and what we teach models whose template has no
tools (SmolLM2's plain ChatML): each call is a JSON object between tags, one or several per turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>

and each result comes back as a `tool` message. `parse_tool_calls` never raises: a call that is not JSON, names no
tool or gives arguments that are not an object comes back with an `error`, which the environment shows the model.

Two tools are built in. `python` runs a program in the code verifier's sandbox (verifiers/sandbox.py: bubblewrap
when available, rlimits, a wall-clock timeout, an output cap) and returns its stdout and stderr. `calculator`
evaluates an arithmetic expression in this process with a small evaluator over Python's AST (numbers, + - * / // %
**, unary signs, parentheses) whose sizes are bounded, so it needs no sandbox: it runs no code, takes microseconds
rather than a process start, and is deterministic.

A `ToolRunner` runs one turn's calls at once, each in a thread, while a semaphore shared by every runner with the
same `parallel` bounds how many run at once across the episodes of the process; the calls of a turn past its
`max_calls` (`env.max_tool_calls`) are not run and are answered with an error that says the cap.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlvr.environments.base import ToolStatus, ToolUse
from rlvr.verifiers.sandbox import SandboxError, run_program

__all__ = [
    "CALCULATOR",
    "PYTHON",
    "TOOLS",
    "CalculatorError",
    "ParsedCall",
    "Tool",
    "ToolLimits",
    "ToolOutcome",
    "ToolRunner",
    "evaluate_arithmetic",
    "parse_tool_calls",
    "tool_prompt",
    "tool_schema",
]

NOTE_BYTES = 64  # room above the output cap for a tool's note on how its run ended
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
CALL_EXAMPLE = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'

# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class ParsedCall:
    """One `<tool_call>` block: its text as written, and either a name and arguments or why it is malformed."""

    text: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(response: str) -> list[ParsedCall]:
    """Every `<tool_call>` block of `response`, in order; [] when it has none (the turn is a final answer). A block
    left open at the end of the turn is read to the end (a model stopped right after its JSON)."""
    return [_parse_call(match.group(1).strip()) for match in _CALL.finditer(response)]


def _parse_call(text: str) -> ParsedCall:
    try:
        call = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return ParsedCall(text, error=f"the tool call is not valid JSON ({_json_error(exc)}); write {CALL_EXAMPLE}")
    if not isinstance(call, dict):
        return ParsedCall(text, error=f"the tool call must be one JSON object; write {CALL_EXAMPLE}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(text, error=f"the tool call names no tool; write {CALL_EXAMPLE}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        return ParsedCall(text, name=name, error=f"the arguments of {name!r} must be a JSON object")
    return ParsedCall(text, name=name, arguments=arguments)


def _json_error(exc: BaseException) -> str:
    return exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Tools


@dataclass(frozen=True)
class ToolLimits:
    """What one call may use: wall-clock seconds, memory (the python tool's address space), output bytes."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 4096


@dataclass(frozen=True)
class ToolOutcome:
    """What running a tool gave: the text the model is shown and how the call went."""

    output: str
    status: ToolStatus


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its schema's parts, its one string argument, and how to run it."""

    name: str
    description: str
    argument: str
    argument_description: str
    run: Callable[[str, ToolLimits], ToolOutcome]

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        """Why `arguments` cannot be passed to this tool, or None."""
        extra = sorted(set(arguments) - {self.argument})
        if extra:
            return f"{self.name} takes only {self.argument!r}, not {', '.join(map(repr, extra))}"
        if not isinstance(arguments.get(self.argument), str):
            return f"{self.name} needs {self.argument!r}, a string"
        return None


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The tool as an OpenAI-style function schema (what `Opening.tools` holds and chat templates render)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": {
                "type": "object",
                "properties": {tool.argument: {"type": "string", "description": tool.argument_description}},
                "required": [tool.argument],
            },
        },
    }


def tool_prompt(tools: Sequence[Mapping[str, Any]], *, tagged_results: bool = False) -> str:
    """A system message teaching the call format, for chat templates that render no tools (ChatML, or none): the
    one text both the calculator environment (`tool_format: prompt`) and the rollout loop (trainer/chat_tokens.py,
    for an environment that offers tools without teaching them) show, so a model warm-started on one reads the
    other. `tools`: OpenAI-style schemas (`tool_schema`, `Opening.tools`); `tagged_results`: the environment wraps
    each result in <tool_response> tags (the calculator does), which the text then says."""
    if not tools:
        raise ValueError("tool_prompt needs at least one tool")
    functions = [tool["function"] if tool.get("type") == "function" else tool for tool in tools]
    parameters = functions[0].get("parameters") or {}
    shown = list(parameters.get("required") or parameters.get("properties") or [])[:1]  # one argument, as an example
    example = {"name": functions[0].get("name", "..."), "arguments": {name: "..." for name in shown}}
    results = ", between <tool_response> and </tool_response>" if tagged_results else ""
    return (
        "You may call tools. The tools:\n"
        "<tools>\n" + "\n".join(json.dumps(function) for function in functions) + "\n</tools>\n"
        "To call one, write a JSON object with its name and arguments between tags, for example:\n"
        f"<tool_call>{json.dumps(example)}</tool_call>\n"
        f"You may write several calls in one turn. Each result comes back in a tool message{results}. When you know "
        "the answer, reply without a tool call."
    )


# ---------------------------------------------------------------------------------------------
# The calculator

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 1000  # an integer result (or operand) may have at most this many digits
_MAX_RESULT_BITS = math.ceil(MAX_RESULT_DIGITS * math.log2(10))

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression cannot be evaluated (the message is shown to the model)."""


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression` under Python's arithmetic: integers stay exact, `/` divides to a float."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError("not an arithmetic expression") from exc
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("the result is too large") from exc
        if not isinstance(value, (int, float)):  # a negative number to a fractional power
            raise CalculatorError("the result is not a real number")
        return _bounded(value)
    raise CalculatorError("only numbers, + - * / // % **, and parentheses are allowed")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would exceed the size limit before computing it."""
    if abs(exponent) > 10 * MAX_RESULT_DIGITS:
        raise CalculatorError("the exponent is too large")
    exact = isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0
    if exact and exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"the result would have more than {MAX_RESULT_DIGITS} digits")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > _MAX_RESULT_BITS:
        raise CalculatorError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large")
    return value


def _run_calculator(expression: str, limits: ToolLimits) -> ToolOutcome:
    try:
        return ToolOutcome(str(evaluate_arithmetic(expression)), "ok")
    except CalculatorError as exc:
        return ToolOutcome(f"error: {exc}", "error")


# ---------------------------------------------------------------------------------------------
# Python, in the sandbox


def _run_python(code: str, limits: ToolLimits) -> ToolOutcome:
    result = run_program(
        code, "", timeout_s=limits.timeout_s, memory_mb=limits.memory_mb, max_output_bytes=limits.max_output_bytes
    )
    output = _cut(result.stdout + result.stderr, limits.max_output_bytes)
    if result.timed_out:
        return ToolOutcome(output + f"\n[error: the program ran past the {limits.timeout_s:g} s limit]", "timeout")
    if result.output_truncated:
        note = _cut_note(limits.max_output_bytes)
        return ToolOutcome(output if output.endswith(note) else output + note, "error")
    return ToolOutcome(output, "ok" if result.returncode == 0 else "error")


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
    "expression",
    'the expression, e.g. "123*45"',
    _run_calculator,
)
PYTHON = Tool(
    "python",
    "Run a Python program and return what it prints (stdout, then stderr).",
    "code",
    "the program's source",
    _run_python,
)
TOOLS: dict[str, Tool] = {tool.name: tool for tool in (CALCULATOR, PYTHON)}


# ---------------------------------------------------------------------------------------------
# Running one turn's calls


@functools.cache
def _slots(parallel: int) -> threading.BoundedSemaphore:
    """One semaphore per process and `parallel`: the runners of every episode (and every factory) share it."""
    return threading.BoundedSemaphore(parallel)


class ToolRunner:
    """Runs the calls of one assistant turn with `tools` under `limits`, several at once; at most `max_calls` of a
    turn (None: all), so that a turn of 40 hanging calls cannot hold the shared slots for 40 timeouts."""

    def __init__(
        self, tools: Mapping[str, Tool], limits: ToolLimits, parallel: int, max_calls: int | None = None
    ) -> None:
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        if max_calls is not None and max_calls < 1:
            raise ValueError("max_calls must be at least 1")
        self.tools = dict(tools)
        self.limits = limits
        self.max_calls = max_calls
        self._slots = _slots(parallel)

    def run(self, calls: Sequence[ParsedCall]) -> list[ToolUse]:
        """One ToolUse per call, in the calls' order: those past `max_calls` are not run, and get an error saying
        the cap. Raises SandboxError only when the sandbox itself fails."""
        capped = [] if self.max_calls is None else [self._not_run(call) for call in calls[self.max_calls :]]
        calls = calls if self.max_calls is None else calls[: self.max_calls]
        uses: list[ToolUse | None] = [None] * len(calls)
        failures: list[SandboxError] = []

        def run_one(position: int) -> None:
            try:
                uses[position] = self._run_call(calls[position])
            except SandboxError as exc:
                failures.append(exc)

        threads = [threading.Thread(target=run_one, args=(i,), daemon=True) for i in range(1, len(calls))]
        for thread in threads:
            thread.start()
        if calls:
            run_one(0)
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return [use for use in uses if use is not None] + capped

    def _not_run(self, call: ParsedCall) -> ToolUse:
        arguments = call.text if call.arguments is None else json.dumps(call.arguments, ensure_ascii=False)
        cap = f"error: not run: at most {self.max_calls} tool calls are run a turn (env.max_tool_calls)"
        return ToolUse(call.name, arguments, cap, "error", 0.0)

    def _run_call(self, call: ParsedCall) -> ToolUse:
        refusal = self._refusal(call)
        if refusal is not None:
            return ToolUse(call.name, call.text, f"error: {refusal}", "malformed", 0.0)
        assert call.name is not None and call.arguments is not None  # no refusal: both parsed
        tool = self.tools[call.name]
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        with self._slots:
            started = time.monotonic()
            outcome = tool.run(call.arguments[tool.argument], self.limits)
            seconds = time.monotonic() - started
        output = _cut(outcome.output, self.limits.max_output_bytes + NOTE_BYTES)
        return ToolUse(tool.name, arguments, output, outcome.status, seconds)

    def _refusal(self, call: ParsedCall) -> str | None:
        """Why `call` is not run (malformed, unknown tool, wrong arguments), or None."""
        if call.error is not None:
            return call.error
        if call.name not in self.tools:
            return f"unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}"
        assert call.arguments is not None
        return self.tools[call.name].check(call.arguments)


def _cut(text: str, max_bytes: int) -> str:
    """`text` cut to `max_bytes` of UTF-8, and a marker saying so."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", errors="ignore") + _cut_note(max_bytes)


def _cut_note(max_bytes: int) -> str:
    return f"\n[output cut at {max_bytes} bytes]"
