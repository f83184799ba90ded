"""Tool-call verifier: the decomposed ToolRL reward of docs/methods.md#toolrl on JSON function calls.

Response: the calls as JSON, one object `{"name": ..., "arguments": {...}}` ("parameters" is read the
same way; "arguments" may also be a JSON string, and an OpenAI-style `{"function": {...}}` wrapper is
unwrapped) or a list of them. Where they are looked for, first that finds any wins:
  1. every <tool_call>...</tool_call> block (each holds an object or a list), in order,
  2. the last ```json block,
  3. the whole response, if it starts with "{" or "[" (other text holds no call).
Reference: the gold calls in the same shape (a list, a single call, or their JSON string).

Matching: each gold call, in order, takes the first predicted call with the same name not yet taken.
  r_name    = multiset Jaccard of predicted and gold tool names (1 when both are empty)
  r_param   = Σ over matched calls of the Jaccard of their argument keys (1 when both have none)
  r_value   = Σ over matched calls of the gold keys whose predicted value is exactly equal
              (JSON equality, with booleans never equal to numbers)
  S_max     = 1 + |gold calls| + Σ over gold calls of |gold keys|
  r_correct = 6 · (r_name + r_param + r_value) / S_max − 3        in [−3, 3]
  r_format  = 1 if the calls parsed and every call is an object with a string name and an object of
              arguments, else 0 (malformed calls are left out of the matching)
  R_final   = r_format + r_correct                                 in [−3, 4]
Value: R_final normalised to [0, 1] as (R_final + 3) / 7. Components: r_format, r_name, r_param,
r_value, r_correct.

Statuses: ok iff every call matches exactly (same calls, names, keys and values; no extra call) and
r_format is 1; unparseable (value 0) when no JSON is found, except that when the gold list is empty a
response with no call at all is the right answer (ok); wrong otherwise; error for a bad reference.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, ClassVar

from rlvr.verifiers.base import (
    MISSING_REFERENCE,
    Score,
    Verifier,
    is_missing,
    non_text_error,
    one_line,
    self_check_error,
)

_TOOL_CALL_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_FENCE = re.compile(r"```[ \t]*json[^\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

Call = tuple[str, dict[str, Any]]


class MalformedCalls(ValueError):
    """The JSON is not a call or a list of calls."""


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedCalls(f"not JSON: {type(exc).__name__}") from exc


def _as_call(item: Any) -> Call | None:
    """(name, arguments) of one well-formed call, else None."""
    if isinstance(item, dict) and isinstance(item.get("function"), dict) and "name" not in item:
        item = item["function"]
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], arguments


def _as_items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def parse_calls(response: str) -> list[Any] | None:
    """The raw call items of a response (see the module docstring for where), or None if it holds no
    JSON call text. Raises MalformedCalls when the chosen text is not JSON."""
    blocks = _TOOL_CALL_TAG.findall(response)
    if blocks:
        items: list[Any] = []
        for block in blocks:
            items.extend(_as_items(_json(block.strip())))
        return items
    fences = _JSON_FENCE.findall(response)
    if fences:
        return _as_items(_json(fences[-1].strip()))
    text = response.strip()
    if not text.startswith(("{", "[")):
        return None  # prose, not an attempt at JSON
    return _as_items(_json(text))


def same_value(a: Any, b: Any) -> bool:
    """JSON equality where True is not 1 and "5" is not 5."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[key], b[key]) for key in a)
    return type(a) is type(b) and a == b


def _jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def _multiset_jaccard(a: Counter, b: Counter) -> float:
    union = sum((a | b).values())
    if union == 0:
        return 1.0
    return sum((a & b).values()) / union


def tool_call_reward(predicted: list[Call], gold: list[Call], r_format: float) -> tuple[dict[str, float], bool]:
    """The ToolRL components (docs/methods.md#toolrl) for parsed calls, and whether the prediction matches
    the gold exactly."""
    r_name = _multiset_jaccard(Counter(name for name, _ in predicted), Counter(name for name, _ in gold))
    taken: set[int] = set()
    r_param = 0.0
    r_value = 0.0
    exact = len(predicted) == len(gold)
    for gold_name, gold_args in gold:
        match = next((i for i, (name, _) in enumerate(predicted) if i not in taken and name == gold_name), None)
        if match is None:
            exact = False
            continue
        taken.add(match)
        predicted_args = predicted[match][1]
        r_param += _jaccard(set(predicted_args), set(gold_args))
        values_equal = sum(
            1 for key, value in gold_args.items() if key in predicted_args and same_value(predicted_args[key], value)
        )
        r_value += values_equal
        exact = exact and predicted_args.keys() == gold_args.keys() and values_equal == len(gold_args)
    s_max = 1 + len(gold) + sum(len(args) for _, args in gold)
    r_correct = 6 * (r_name + r_param + r_value) / s_max - 3
    components = {
        "r_format": r_format,
        "r_name": r_name,
        "r_param": r_param,
        "r_value": r_value,
        "r_correct": r_correct,
    }
    return components, exact


def render_calls(calls: list[Call]) -> str:
    """Calls as the JSON list a response holds them in."""
    return json.dumps([{"name": name, "arguments": args} for name, args in calls], ensure_ascii=False)


BAD_REFERENCE = 'tool_call reference must be a list of {"name": ..., "arguments": {...}} calls or its JSON string'


def _gold_calls(reference: Any) -> list[Call] | None:
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except (ValueError, RecursionError):
            return None
    calls = [_as_call(item) for item in _as_items(reference)]
    if any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallVerifier(Verifier):
    name = "tool_call"
    domain = "tool_call"
    version = "1"

    rewrite_templates: ClassVar[Mapping[str, str]] = {
        "simplify": (
            "Rewrite this request so the function call it needs is easier to see: short sentences, each argument "
            "value stated plainly, the same functions and signatures, nothing added. Do not write the call.\n"
            "Request: {question}\nExpected call: {answer}\nRewritten request:"
        ),
        "diversify": (
            "Reword this request with other words and sentence order; it must need exactly the same function "
            "calls with the same arguments. Do not write the call.\nRequest: {question}\nExpected call: {answer}"
            "\nReworded request:"
        ),
    }

    def reference_error(self, reference: Any) -> str | None:
        """The gold calls, rendered as a response's JSON list, must score ok against the reference."""
        if is_missing(reference):
            return MISSING_REFERENCE
        gold = _gold_calls(reference)
        if gold is None:
            return BAD_REFERENCE
        try:
            response = render_calls(gold)
        except (TypeError, ValueError, RecursionError) as exc:
            return one_line(f"reference arguments are not JSON-serialisable: {exc}")
        return self_check_error(self, response, reference)

    def score(self, response: str, reference: Any) -> Score:
        gold = _gold_calls(reference)
        if gold is None:
            return Score(0.0, "error", reason=BAD_REFERENCE)
        if (problem := non_text_error(response)) is not None:
            return problem
        unparseable = {"r_format": 0.0, "r_name": 0.0, "r_param": 0.0, "r_value": 0.0, "r_correct": -3.0}
        try:
            items = parse_calls(response)
        except MalformedCalls as exc:
            return Score(0.0, "unparseable", unparseable, response.strip()[:2000] or None, str(exc))
        if items is None:
            if not gold:
                components, _ = tool_call_reward([], gold, 1.0)
                return Score(1.0, "ok", components, None, "no call, and none expected")
            return Score(0.0, "unparseable", unparseable, None, "no tool call found")

        calls = [_as_call(item) for item in items]
        predicted = [call for call in calls if call is not None]
        malformed = len(calls) - len(predicted)
        r_format = 1.0 if malformed == 0 else 0.0
        components, exact = tool_call_reward(predicted, gold, r_format)
        value = (components["r_format"] + components["r_correct"] + 3) / 7
        extracted = render_calls(predicted)[:2000]
        if exact and r_format == 1.0:
            return Score(value, "ok", components, extracted, "every call matches")
        reason = f"{len(predicted)} calls vs {len(gold)} gold calls"
        if malformed:
            reason += f"; {malformed} malformed calls left out"
        return Score(value, "wrong", components, extracted, reason)
