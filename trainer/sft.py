"""Supervised warm start: teacher forcing before RL, on (prompt, answer) pairs or on tool-use transcripts.

A policy that never produces a well-formed answer gets no reward and so no GRPO signal; a short warm
start on a few examples teaches the answer format (answer then eos) so that RL has something to sharpen.
For a multi-turn environment the format is the episode itself: `transcript_sequence` turns a synthesized
conversation (data/tool_transcripts.py) into the token ids the rollout loop would produce for it, with the loss on
the assistant's tokens only, so the warm start trains on the very sequences GRPO later samples and scores.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlvr.data.tool_transcripts import ToolTranscript
from rlvr.trainer import prompts
from rlvr.trainer.devices import model_device
from rlvr.trainer.generation import _eos_ids
from rlvr.trainer.grpo import completion_logprobs
from rlvr.trainer.multi_turn import ChatRendering
from rlvr.trainer.policy import Policy

__all__ = [
    "SftSequence",
    "assistant_turn_ids",
    "sft_steps",
    "sft_warmstart",
    "transcript_sequence",
    "transcript_sequences",
]

_ASKED: list[dict[str, str]] = [{"role": "user", "content": "1"}]  # the fixed turn an assistant turn is rendered after


@dataclass(frozen=True)
class SftSequence:
    """One teacher-forced example: the prompt (context only) and the completion, trained where `loss_mask` is 1."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]


def sft_warmstart(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    examples: list[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    seed: int,
) -> list[float]:
    """`sft_steps` on (prompt, answer) pairs: the prompt as trainer/prompts.py renders it, the answer's tokens
    then eos, all trained."""
    if not examples:
        raise ValueError("sft_warmstart needs at least one (prompt, answer) example")
    tokenizer = policy.tokenizer
    prompt_tokens = prompts.prompt_ids(tokenizer, [prompt for prompt, _ in examples])
    answers = tokenizer([answer for _, answer in examples], add_special_tokens=False)["input_ids"]
    sequences = [
        SftSequence(prompt, [*answer, tokenizer.eos_token_id], [1] * (len(answer) + 1))
        for prompt, answer in zip(prompt_tokens, answers)
    ]
    return sft_steps(policy, optimizer, sequences, steps=steps, batch_size=batch_size, seed=seed)


def sft_steps(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[SftSequence],
    *,
    steps: int,
    batch_size: int,
    seed: int,
) -> list[float]:
    """`steps` updates of mean token cross-entropy on the completions' masked tokens (prompt tokens are context
    only; prompts left-padded, completions right-padded, as the train stage scores rollouts). Each batch is
    `batch_size` sequences drawn with replacement by a generator seeded with `seed`, so the run is reproducible
    and independent of the global RNG. Returns the loss of each step."""
    if not sequences:
        raise ValueError("sft_steps needs at least one sequence")
    if any(not any(s.loss_mask) or len(s.loss_mask) != len(s.completion_ids) for s in sequences):
        raise ValueError("every sequence needs a loss mask as long as its completion, with a token to train")
    model, pad_id = policy.model, policy.tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)  # on the CPU, so the batches are the same on every device
    device = model_device(model)
    losses = []
    for _ in range(steps):
        picks = [sequences[i] for i in torch.randint(len(sequences), (batch_size,), generator=generator).tolist()]
        prompt_width = max(len(s.prompt_ids) for s in picks)
        width = max(len(s.completion_ids) for s in picks)
        prompt_ids = torch.tensor([[pad_id] * (prompt_width - len(s.prompt_ids)) + s.prompt_ids for s in picks])
        completion_ids = torch.tensor([s.completion_ids + [pad_id] * (width - len(s.completion_ids)) for s in picks])
        mask = torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for s in picks], dtype=torch.bool)
        logp, token_mask = completion_logprobs(
            model, prompt_ids.to(device), completion_ids.to(device), pad_id, mask.to(device)
        )
        loss = -(logp * token_mask).sum() / token_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    optimizer.zero_grad(set_to_none=True)
    return losses


def assistant_turn_ids(tokenizer: PreTrainedTokenizerBase, text: str, eos_ids: Collection[int]) -> list[int]:
    """The ids of an assistant turn saying `text`, through its end-of-turn token: what the model samples for it.

    With a chat template: the ids the template adds when `text` follows a fixed user turn as the assistant's
    message (the fixed conversation rendered with the assistant turn, tokenized, less the same conversation
    rendered with the assistant's turn opened), up to and including its last eos token; what the template writes
    after that token (ChatML's "\\n") belongs to the next reply, as `ChatRendering.reply` renders it. Without one:
    `text`'s tokens and the tokenizer's eos, as a base model ends a turn."""
    if not prompts.has_chat_template(tokenizer):
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_ids else min(eos_ids)
        return [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]
    opened = _template_ids(tokenizer, _ASKED, generation_prompt=True)
    said = _template_ids(tokenizer, [*_ASKED, {"role": "assistant", "content": text}], generation_prompt=False)
    if said[: len(opened)] != opened:
        raise ValueError("the chat template renders an assistant turn that does not extend the opened turn")
    turn = said[len(opened) :]
    ends = [i for i, token in enumerate(turn) if token in eos_ids]
    if not ends:
        raise ValueError("the chat template ends an assistant turn with no eos token: it cannot be sampled to its end")
    return turn[: ends[-1] + 1]


def _template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, generation_prompt: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def transcript_sequence(
    rendering: ChatRendering, transcript: ToolTranscript, eos_ids: Collection[int], max_tool_output_tokens: int = 256
) -> SftSequence:
    """The token ids the rollout loop (trainer/multi_turn.py) would produce for `transcript` had the model sampled
    its assistant turns: the opening as `rendering.opening` renders it (the prompt), then each assistant turn's
    `assistant_turn_ids` (loss mask 1) and each reply's messages, cut to `max_tool_output_tokens` as the loop cuts
    them, as `rendering.reply` renders them (loss mask 0)."""
    completion: list[int] = []
    mask: list[int] = []
    for i, text in enumerate(transcript.assistant):
        turn = assistant_turn_ids(rendering.tokenizer, text, eos_ids)
        completion += turn
        mask += [1] * len(turn)
        if i < len(transcript.replies):
            messages = [
                {**m, "content": rendering.cut(m["content"], max_tool_output_tokens)} for m in transcript.replies[i]
            ]
            reply = rendering.reply(messages)
            completion += reply
            mask += [0] * len(reply)
    return SftSequence(rendering.opening(transcript.opening), completion, mask)


def transcript_sequences(
    policy: Policy, transcripts: Sequence[ToolTranscript], max_tool_output_tokens: int = 256
) -> list[SftSequence]:
    """`transcript_sequence` of each transcript, with the policy's tokenizer and end-of-turn ids."""
    eos_ids = _eos_ids(policy)
    rendering = ChatRendering(policy.tokenizer, eos_ids)
    return [transcript_sequence(rendering, t, eos_ids, max_tool_output_tokens) for t in transcripts]
