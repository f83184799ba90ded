"""Messages to token ids: how one tokenizer renders an episode's opening, an environment's reply and an assistant
turn as the ids the model reads and samples (`ChatRendering`). The rollout loop (trainer/episodes.py) appends these
ids turn by turn and never decodes and re-tokenizes a turn; the warm start (trainer/sft.py) builds its transcripts'
sequences here too, so what it trains on is, token for token, what the loop would append.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlvr.environments.base import Message, Opening
from rlvr.environments.tools import tool_prompt
from rlvr.trainer.prompts import has_chat_template
from rlvr.verifiers.base import one_line

__all__ = ["ChatRendering"]

# The fixed conversation that environment messages are appended to when they are rendered, and whose user turn an
# assistant turn is rendered after (`ChatRendering.assistant_turn`).
_BASE: list[Message] = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]


def _with_tools(messages: list[Message], tools: Sequence[Mapping[str, Any]]) -> list[Message]:
    """`messages` with `tool_prompt` added to the first system message, or as a new first one."""
    text = tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


class ChatRendering:
    """How one tokenizer turns an episode's messages into the token ids the model reads.

    - With a chat template: the opening goes through `apply_chat_template(messages, tools=..., add_generation_
      prompt=True)`, tokenized without extra special tokens (as trainer/prompts.py renders a chat prompt: with
      no tools the ids equal `prompt_ids` of the messages' JSON). Each reply's messages are the ids the template
      adds to a fixed two-message conversation (`_BASE`) when they follow it and the assistant's turn is opened
      again, together with what the template writes after the assistant's end-of-turn token (ChatML's "\\n"
      after <|im_end|>): the sampled turn ends at that token, so the rest of the turn's closing is the
      environment's. A template for which the fixed conversation's ids are not a prefix of the longer one's
      cannot be appended to token-wise, and is refused.
    - With no template (a base model, the tiny built-in one): the opening is its messages' contents joined by
      newlines, tokenized with the tokenizer's usual special tokens (as prompts.py reads a chat), and each
      environment message is its content on a line of its own, after the turn.
    - Tools: when the template does not render the tools offered (the opening rendered with them equals the
      opening rendered without them, as with SmolLM2's plain ChatML, or there is no template) and the environment
      does not teach them itself (`Opening.tools_described`), they are given in a system message
      (environments/tools.py `tool_prompt`, the text the calculator environment teaches with). A prompt that
      merely names a tool changes nothing.
    - An assistant turn (`assistant_turn`, for a transcript the model did not sample): the ids the model would
      sample for it, through its end-of-turn token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.templated = has_chat_template(tokenizer)
        self.model = str(getattr(tokenizer, "name_or_path", "") or "this model")
        self._eos_ids = eos_ids
        self._base: tuple[list[int], list[int]] | None = None  # the fixed conversation's ids, what follows its turn
        self._openings: dict[str, list[int]] = {}  # a GRPO group's episodes open alike: each rendered once

    def opening(self, opening: Opening) -> list[int]:
        """The prompt's ids: the opening with the assistant's first turn opened."""
        (ids,) = self.openings([opening])
        if isinstance(ids, Exception):
            raise ids
        return ids

    def openings(self, openings: Sequence[Opening]) -> list[list[int] | Exception]:
        """Each opening's ids (`opening`), or the exception its rendering raised. Openings alike (a GRPO group's)
        are rendered once, and the new ones tokenized in one call, as trainer/prompts.py tokenizes a batch."""
        keys = [repr((o.messages, o.tools, o.tools_described)) for o in openings]
        texts: dict[str, str] = {}
        refused: dict[str, Exception] = {}
        for key, opening in zip(keys, openings):
            if key not in self._openings and key not in texts and key not in refused:
                try:
                    texts[key] = self._prompt_text(opening)
                except Exception as exc:  # the chat template refused it
                    refused[key] = exc
        if texts:
            encoded = self.tokenizer(list(texts.values()), add_special_tokens=not self.templated)
            self._openings.update((key, list(ids)) for key, ids in zip(texts, encoded["input_ids"]))
        return [list(self._openings[key]) if key in self._openings else refused[key] for key in keys]

    def _prompt_text(self, opening: Opening) -> str:
        messages = list(opening.messages)
        text = self._opening_text(messages, opening.tools)
        if opening.tools and not opening.tools_described and text == self._opening_text(messages, []):
            text = self._opening_text(_with_tools(messages, opening.tools), [])
        return text

    def reply(self, messages: Sequence[Message]) -> list[int]:
        """The ids appended after an assistant turn that ended with eos: `messages`, then the assistant's next
        turn opened."""
        if not self.templated:
            return self._ids("".join(f"\n{m['content']}" for m in messages), special=False)
        base, after_turn = self._base_ids()
        longer = self._ids(self._render([*_BASE, *messages], None, generation_prompt=True), special=False)
        if longer[: len(base)] != base:
            raise ValueError(
                f"the chat template of {self.model} renders a conversation that gains messages differently from "
                "the same conversation without them (not a token prefix); its turns cannot be appended as token ids"
            )
        return after_turn + longer[len(base) :]

    def assistant_turn(self, text: str) -> list[int]:
        """The ids of an assistant turn saying `text`, through its end-of-turn token: what the model samples for it.

        With a chat template: the ids the template adds when `text` follows the fixed conversation's user turn as the
        assistant's message (that conversation rendered with the assistant turn, less it rendered with the
        assistant's turn opened), up to and including its last eos token; what the template writes after that token
        (ChatML's "\\n") belongs to the next reply, as `reply` renders it. Without one: `text`'s tokens and the
        tokenizer's eos, as a base model ends a turn."""
        if not self.templated:
            eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id in self._eos_ids else min(self._eos_ids)
            return [*self._ids(text, special=False), eos]
        asked = _BASE[:1]
        opened = self._ids(self._render(asked, None, generation_prompt=True), special=False)
        said = self._ids(
            self._render([*asked, {"role": "assistant", "content": text}], None, generation_prompt=False),
            special=False,
        )
        if said[: len(opened)] != opened:
            raise ValueError(
                f"the chat template of {self.model} renders an assistant turn that does not extend the opened turn"
            )
        turn = said[len(opened) :]
        ends = [i for i, token in enumerate(turn) if token in self._eos_ids]
        if not ends:
            raise ValueError(
                f"the chat template of {self.model} ends an assistant turn with no eos token: it cannot be sampled to "
                "its end"
            )
        return turn[: ends[-1] + 1]

    def _base_ids(self) -> tuple[list[int], list[int]]:
        """The fixed conversation's ids and what the template writes after its assistant turn ends, rendered on the
        first reply (a one-turn episode never needs them)."""
        if self._base is None:
            base = self._ids(self._render(_BASE, None, generation_prompt=False), special=False)
            self._base = base, self._after_end_of_turn(base, self._eos_ids)
        return self._base

    def cut(self, content: str, limit: int) -> str:
        """`content` cut to its first `limit` tokens, with a marker saying how many were left out."""
        ids = self._ids(content, special=False)
        if len(ids) <= limit:
            return content
        kept = self.tokenizer.decode(ids[:limit])
        return f"{kept}\n[... {len(ids) - limit} more tokens cut]"

    def _opening_text(self, messages: list[Message], tools: Sequence[Mapping[str, Any]]) -> str:
        if not self.templated:
            return "\n".join(m["content"] for m in messages)
        return self._render(messages, list(tools) or None, generation_prompt=True)

    def _render(self, messages: list[Message], tools: list[Any] | None, *, generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as exc:  # jinja's TemplateError, or a template's own raise_exception
            roles = ", ".join(m["role"] for m in messages)
            reason = one_line(str(exc))
            raise ValueError(f"the chat template of {self.model} cannot render roles [{roles}]: {reason}") from exc
        return str(text)

    def _ids(self, text: str, *, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _after_end_of_turn(self, base: list[int], eos_ids: set[int]) -> list[int]:
        """What the template writes after the fixed conversation's assistant turn ends (its last eos), or none
        when the template closes that turn with no eos token."""
        ends = [i for i, token in enumerate(base) if token in eos_ids]
        if not ends or _BASE[-1]["content"] not in self.tokenizer.decode(base[: ends[-1]]):
            return []
        return base[ends[-1] + 1 :]
