"""What the model sees of a problem's prompt: a chat model's own chat template, or the text as it is.

A problem's prompt is plain text or a chat (the JSON text of a list of {role, content} messages, see
rlvr/chat.py). A tokenizer with a chat template (an instruct or chat model) gets the conversation through
that template with the assistant's turn opened (`add_generation_prompt`), a text prompt being one user
message, so rollouts, the loss, the warm start and evaluations all condition on the same tokens. A model
without a template (a base model, the tiny built-in one) reads the text as it is, a chat's messages joined
by newlines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from rlvr.chat import as_messages, chat_messages
from rlvr.errors import UserError

UNREADABLE_SHARE = 0.5  # an environment's openings with more unknown tokens than this are refused


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The prompt as the model reads it, as text (for engines that take text: a server's completions API)."""
    if has_chat_template(tokenizer):
        return str(tokenizer.apply_chat_template(as_messages(prompt), add_generation_prompt=True, tokenize=False))
    messages = chat_messages(prompt)
    return prompt if messages is None else "\n".join(m["content"] for m in messages)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    """The token ids of each prompt as the model reads it.

    A template's text already holds its special tokens, so it is tokenized without adding more (no second
    BOS); plain text gets the tokenizer's usual special tokens.
    """
    if not prompts:
        return []
    distinct = list(dict.fromkeys(prompts))  # a GRPO batch repeats each prompt once per sample
    texts = [prompt_text(tokenizer, prompt) for prompt in distinct]
    encoded = tokenizer(texts, add_special_tokens=not has_chat_template(tokenizer))
    ids = dict(zip(distinct, encoded["input_ids"]))
    return [list(ids[prompt]) for prompt in prompts]  # a list per row: callers pad rows in place


def distinct_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For padded prompt rows [B, P] (a GRPO batch repeats each prompt once per sample): the first row of each
    distinct prompt [D] and each row's distinct prompt [B]. Rows are one prompt when their ids and mask agree."""
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    distinct, row_to_distinct = torch.unique(rows, dim=0, return_inverse=True)
    indices = torch.arange(input_ids.shape[0], device=input_ids.device)
    first_row = torch.full((distinct.shape[0],), input_ids.shape[0], device=input_ids.device)
    return first_row.scatter_reduce(0, row_to_distinct, indices, reduce="amin"), row_to_distinct


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, P] of left-padded rows as `generate` numbers them: the real tokens from 0, padding 1."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def check_readable(tokenizer: PreTrainedTokenizerBase, openings: Sequence[Sequence[int]], what: str) -> None:
    """Refuse, in one line naming the share, episodes whose openings the policy cannot read: more than
    `UNREADABLE_SHARE` of their tokens are the tokenizer's unknown token (the tiny built-in model's word vocabulary
    turns a game's text into unknown tokens, and every episode then plays nothing). `what` names the environment."""
    unknown = tokenizer.unk_token_id
    total = sum(len(ids) for ids in openings)
    if unknown is None or not total:
        return
    share = sum(token == unknown for ids in openings for token in ids) / total
    if share > UNREADABLE_SHARE:
        raise UserError(
            f"{share:.0%} of the tokens of {what}'s openings are unknown to the policy's tokenizer: the model "
            "cannot read the environment's text; choose a policy.model whose vocabulary covers it "
            "(e.g. smollm2-135m-instruct)"
        )
