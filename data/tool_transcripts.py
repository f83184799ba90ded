"""Synthesized tool-use conversations for the `calculator` environment: what the warm start teaches a model whose
chat template has no tools (SmolLM2's plain ChatML) before multi-turn GRPO (docs/real-model.md).

A transcript is one problem played by the real environment with a scripted assistant: the opening exactly as the
calculator environment opens it (its system message teaching the tool format, then the problem's prompt), an
assistant turn with one `<tool_call>` for the problem's expression, the tool message the environment answers with
(the real calculator's result), and a final assistant turn that states the number. The environment then scores
that final turn, and a transcript it does not score `ok` (a reference the calculator disagrees with) is refused, so
the warm start never teaches a wrong answer. Token ids are trainer/sft.py's business (`transcript_sequence`).

Deterministic: the calculator is a pure function of its expression and the scripted turns are fixed, so the same
problems and options give the same transcripts; `seed` is what the environment resets with, as in a rollout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlvr.data.sources import expression_of, parse_expression, render_expression
from rlvr.environments.base import Message, Opening
from rlvr.environments.registry import environment_factory
from rlvr.verifiers.base import Score

__all__ = ["ToolTranscript", "calculator_call", "problem_expression", "synthesize_transcripts"]

VERIFIER = "final_number"  # the calculator environment's default: the final answer's last number, exactly


@dataclass(frozen=True)
class ToolTranscript:
    """One synthesized episode. `assistant[i]` is assistant turn i's text; `replies[i]` the environment's messages
    after it (one fewer than the assistant turns: the last turn is the final answer); `verdict` the environment's
    score of that final answer."""

    opening: Opening
    assistant: tuple[str, ...]
    replies: tuple[tuple[Message, ...], ...]
    verdict: Score

    def messages(self) -> list[Message]:
        """The whole conversation, in order, as a chat template takes it."""
        out = list(self.opening.messages)
        for i, text in enumerate(self.assistant):
            out.append({"role": "assistant", "content": text})
            out.extend(self.replies[i] if i < len(self.replies) else ())
        return out


def problem_expression(prompt: str) -> str | None:
    """The arithmetic expression a problem asks for (`"What is 123 times 45? ..."` or `"123*45="` -> `"123*45"`),
    or None when the prompt is not one of the arithmetic sources' problems."""
    text = prompt.strip()
    parsed = parse_expression(expression_of(text) if text.startswith("What is ") else text)
    return None if parsed is None else render_expression(*parsed).removesuffix("=")


def calculator_call(expression: str) -> str:
    """The assistant turn that calls the calculator, in the documented Hermes format (environments/tools.py)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def synthesize_transcripts(
    problems: Sequence[Mapping[str, Any]], options: Mapping[str, Any] | None = None, *, seed: int = 0
) -> list[ToolTranscript]:
    """One transcript per problem (rows with `prompt` and `reference`), in order, played by the calculator
    environment with `options` (the run's `env.options`: the openings must be the ones its rollouts get).
    Raises ValueError, naming the problem, for a prompt that holds no arithmetic expression, or whose reference the
    calculator's result does not match."""
    factory = environment_factory({"type": "calculator", "verifier": VERIFIER, "options": dict(options or {})})
    transcripts = []
    for row in problems:
        expression = problem_expression(str(row["prompt"]))
        if expression is None:
            raise ValueError(f"tool transcripts need arithmetic problems; {row['prompt']!r} holds no expression")
        environment = factory()
        try:
            opening = environment.reset(row, seed)
            call = calculator_call(expression)
            reply = environment.step(call)
            if reply.done or len(reply.tool_uses) != 1 or reply.tool_uses[0].status != "ok":
                raise ValueError(f"the calculator did not answer {call!r} for {row['prompt']!r}")
            answer = reply.tool_uses[0].output
            final = environment.step(answer)
        finally:
            environment.close()
        if final.verdict is None or final.verdict.status != "ok":
            raise ValueError(
                f"the calculator gives {answer} for {row['prompt']!r} but the reference is {row.get('reference')!r}"
            )
        transcripts.append(ToolTranscript(opening, (call, answer), (tuple(reply.messages),), final.verdict))
    return transcripts
