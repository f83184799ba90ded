"""RLPR's reward without the model (Yu et al. 2025, "RLPR: Extrapolating RLVR to General Domains without
Verifiers"; OpenBMB/RLPR): its knobs (`label.rlpr`), where a response states its answer, the texts the policy
is asked to read, and the reward made from the two probabilities. The probabilities need the policy, so they
are computed on the trainer side (trainer/rlpr.py) by the `rlpr` stage (tasks/rlpr.py); docs/rewards.md#rlpr.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RLPR_VERSION = "2"  # the rewards rows' verifier_version; a change to how a reward is made changes it


class RLPRConfig(BaseModel):
    """`label.rlpr`: how RLPR's reward is made (with `label.reward=rlpr`). Defaults are RLPR's code's."""

    model_config = ConfigDict(extra="forbid")

    format_weight: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="w in (1 - w) * clip(r - r_noreason, 0, 1) + w * format (RLPR's format_coefficient)",
    )
    debias_with: Literal["start", "sampler"] = Field(
        "start",
        description=(
            "the policy r_noreason is computed with: the one RL started from, once per problem (RLPR's code), or "
            "each step's sampling policy, once per problem and policy"
        ),
    )
    debias_prefix: str = Field(" ", description="what stands between the prompt and the reference in r_noreason")
    temperature: float = Field(1.0, gt=0, description="the policy's logits are divided by it")
    score_cut_off: bool = Field(
        False,
        description=(
            "read an answer in a response cut off by max_new_tokens too (its last number is then a step of unfinished "
            "working); false: it states none and gets 0, as under RLPR's own format, whose closing </answer> a cut-off "
            "response lacks"
        ),
    )
    end_token: bool = Field(
        False,
        description=(
            "average in the token after the reference too: the first token of what followed the answer, or the eos "
            "where the response ended right after it (RLPR's gt_tokens_one_more); an answer that only begins with "
            "the reference ('70' for 7) then pays for the reference ending where the policy would go on"
        ),
    )
    end_token_cap: float = Field(
        1.0, gt=0.0, le=1.0, description="that token's probability counts at most this (RLPR's adjusted variant: 0.5)"
    )
    micro_batch_tokens: int = Field(16384, ge=1, description="padded tokens per no-grad forward pass")

    def end_cap(self) -> float | None:
        """The end token's cap when it is scored (`end_token`), None when it is not."""
        return self.end_token_cap if self.end_token else None


@dataclass(frozen=True)
class AnswerSpan:
    """Where a response states its answer: characters [start, end), and how it was found."""

    start: int
    end: int
    how: Literal["answer_tag", "boxed", "last_number"]


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number as `final_number` reads one (verifiers/arithmetic.py): thousands separators inside it, a sign only
# when it is the number's own.
_NUMBER = re.compile(r"(?<![\d.])[+-]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?![\d.]*\d)")


def unread_cut_off(finish_reason: str, cfg: RLPRConfig) -> bool:
    """True for a response cut off by the token limit that is not read for an answer (`cfg.score_cut_off` false).
    Partial credit for the last number of a cut-off response taught the policy to loop in its working until the
    limit (docs/rewards.md#rlpr)."""
    return finish_reason == "length" and not cfg.score_cut_off


def stated_answer(response: str, finish_reason: str, cfg: RLPRConfig) -> AnswerSpan | None:
    """`answer_span` of the response, None for a cut-off one that is not read (`unread_cut_off`)."""
    return None if unread_cut_off(finish_reason, cfg) else answer_span(response)


def answer_span(response: str) -> AnswerSpan | None:
    """The span of `response` that states its answer: the last non-blank `<answer>...</answer>` (RLPR's own
    format), else the last non-empty `\\boxed{...}`, else the last number, which is what `final_number` scores
    (without its separators' removal: the span is the text as written). None when there is none."""
    tags = [m for m in _ANSWER_TAG.finditer(response) if m.group(1).strip()]
    if tags:
        inner = tags[-1].group(1)
        start = tags[-1].start(1) + len(inner) - len(inner.lstrip())
        return AnswerSpan(start, tags[-1].end(1) - (len(inner) - len(inner.rstrip())), "answer_tag")
    boxed = _last_boxed(response)
    if boxed is not None:
        return AnswerSpan(*boxed, "boxed")
    numbers = list(_NUMBER.finditer(response))
    if not numbers:
        return None
    last = numbers[-1]
    start = last.start()
    if response[start] in "+-" and (response[start] == "+" or (start > 0 and response[start - 1].isdigit())):
        start += 1  # "+5" is 5, and in "91-39" the minus is the operation's
    return AnswerSpan(start, last.end(), "last_number")


def _last_boxed(text: str) -> tuple[int, int] | None:
    """The content span of the last `\\boxed{...}` whose braces close and whose content is not blank."""
    for opening in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(opening.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                if text[opening.end() : i].strip():
                    return opening.end(), i
                break
    return None


@dataclass(frozen=True)
class ReferenceText:
    """What the policy reads after the prompt: `before` (the sampled reasoning, or `debias_prefix`) and then the
    reference, whose tokens' probabilities are averaged; then `after` and, when `stopped`, the end of the response.
    `after` and `stopped` are read only for the end token (`RLPRConfig.end_token`)."""

    prompt: str
    before: str
    reference: str
    after: str = ""
    stopped: bool = False


def with_reference(prompt: str, response: str, span: AnswerSpan, reference: str, stopped: bool) -> ReferenceText:
    """The response with its answer replaced by the reference; `stopped`: the response ended (with the eos) rather
    than being cut off by the token limit."""
    return ReferenceText(prompt, response[: span.start], reference, response[span.end :], stopped)


def without_reasoning(prompt: str, reference: str, cfg: RLPRConfig) -> ReferenceText:
    """The prompt, then directly the reference (after `debias_prefix`, RLPR's single space), then the end."""
    return ReferenceText(prompt, cfg.debias_prefix, reference, "", True)


def rlpr_reward(probability: float, debias: float, formatted: bool, cfg: RLPRConfig) -> float:
    """(1 - w) * clip(r - r_noreason, 0, 1) + w * format: RLPR's debiased probability reward with its format term
    (1 when the response states an answer where `answer_span` finds one)."""
    gain = min(max(probability - debias, 0.0), 1.0)
    return (1.0 - cfg.format_weight) * gain + cfg.format_weight * float(formatted)
