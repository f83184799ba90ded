"""Supervised warm start: teacher forcing before RL, on (prompt, answer) pairs or on tool-use transcripts.

A policy that never produces a well-formed answer gets no reward and so no GRPO signal; a short warm
start on a few examples teaches the answer format (answer then eos) so that RL has something to sharpen.
For a multi-turn environment the format is the episode itself: `transcript_sequence` turns a synthesized
conversation (data/tool_transcripts.py makes them; tasks/warmstart.py hands them here) into the token ids the rollout
loop would produce for it, every id built by `ChatRendering` as the loop builds it, with the loss on the assistant's
tokens only, so the warm start trains on the very sequences GRPO later samples and scores.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlvr.environments.base import Message, Opening
from rlvr.trainer import prompts
from rlvr.trainer.chat_tokens import ChatRendering
from rlvr.trainer.devices import model_device
from rlvr.trainer.generation import _eos_ids
from rlvr.trainer.grpo import completion_logprobs
from rlvr.trainer.policy import Policy

__all__ = [
    "SftBatch",
    "SftSequence",
    "Transcript",
    "sft_batches",
    "sft_steps",
    "sft_warmstart",
    "transcript_sequence",
    "transcript_sequences",
]


class Transcript(Protocol):
    """A conversation to teach (data/tool_transcripts.py `ToolTranscript` is one): the opening, each assistant turn's
    text, and the environment's messages after each turn but the last. Read through this shape so the trainer needs
    nothing of the data sources that make them."""

    @property
    def opening(self) -> Opening: ...

    @property
    def assistant(self) -> Sequence[str]: ...

    @property
    def replies(self) -> Sequence[Sequence[Message]]: ...


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
    and independent of the global RNG. Returns the loss of each step.

    A policy sharded over data-parallel ranks (`policy.ranks`) trains on all of them, each a share of every batch
    (trainer/ranks/sft.py), so no process holds the whole model; `optimizer` must then be a fresh AdamW over rank
    0's shards (`make_optimizer`), which the other ranks make alike."""
    if not sequences:
        raise ValueError("sft_steps needs at least one sequence")
    if any(not any(s.loss_mask) or len(s.loss_mask) != len(s.completion_ids) for s in sequences):
        raise ValueError("every sequence needs a loss mask as long as its completion, with a token to train")
    if policy.ranks is not None and not policy.ranks.in_op:
        settings = {"steps": steps, "batch_size": batch_size, "seed": seed}
        return list(policy.ranks.sft_steps(optimizer, list(sequences), settings))
    losses = []
    for batch in sft_batches(
        sequences, steps=steps, batch_size=batch_size, seed=seed, pad_id=policy.tokenizer.pad_token_id
    ):
        loss = summed_nll(policy, batch) / float(batch.mask.sum())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    optimizer.zero_grad(set_to_none=True)
    return losses


@dataclass(frozen=True)
class SftBatch:
    """One step's sequences as tensors on the CPU: prompts left-padded [B, P], completions right-padded [B, T], and
    the loss mask [B, T] (bool)."""

    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor


def summed_nll(policy: Policy, batch: SftBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The negative log-likelihood of the masked completion tokens of `batch` (of its `rows` only, when given),
    summed: a step divides it by the whole batch's token count, on one process or summed over the ranks."""
    picked = slice(None) if rows is None else rows
    device = model_device(policy.model)
    prompt_ids, completion_ids = batch.prompt_ids[picked].to(device), batch.completion_ids[picked].to(device)
    mask = batch.mask[picked].to(device)
    logp, token_mask = completion_logprobs(
        policy.model, prompt_ids, completion_ids, policy.tokenizer.pad_token_id, mask
    )
    return -(logp * token_mask).sum()


def sft_batches(
    sequences: Sequence[SftSequence], *, steps: int, batch_size: int, seed: int, pad_id: int
) -> Iterator[SftBatch]:
    """The batch of each of `steps` steps: `batch_size` sequences drawn with replacement by a generator seeded with
    `seed` on the CPU, so every device and every data-parallel rank draws the same ones."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picks = [sequences[i] for i in torch.randint(len(sequences), (batch_size,), generator=generator).tolist()]
        prompt_width = max(len(s.prompt_ids) for s in picks)
        width = max(len(s.completion_ids) for s in picks)
        yield SftBatch(
            torch.tensor([[pad_id] * (prompt_width - len(s.prompt_ids)) + s.prompt_ids for s in picks]),
            torch.tensor([s.completion_ids + [pad_id] * (width - len(s.completion_ids)) for s in picks]),
            torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for s in picks], dtype=torch.bool),
        )


def transcript_sequence(
    rendering: ChatRendering, transcript: Transcript, max_tool_output_tokens: int = 256
) -> SftSequence:
    """The token ids the rollout loop (trainer/episodes.py) would produce for `transcript` had the model sampled
    its assistant turns: the opening as `rendering.opening` renders it (the prompt), then each assistant turn as
    `rendering.assistant_turn` renders it (loss mask 1) and each reply's messages, cut to `max_tool_output_tokens` as
    the loop cuts them, as `rendering.reply` renders them (loss mask 0)."""
    completion: list[int] = []
    mask: list[int] = []
    for i, text in enumerate(transcript.assistant):
        turn = rendering.assistant_turn(text)
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
    policy: Policy, transcripts: Sequence[Transcript], max_tool_output_tokens: int = 256
) -> list[SftSequence]:
    """`transcript_sequence` of each transcript, with the policy's tokenizer and end-of-turn ids."""
    rendering = ChatRendering(policy.tokenizer, _eos_ids(policy))
    return [transcript_sequence(rendering, t, max_tool_output_tokens) for t in transcripts]
