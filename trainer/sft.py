"""Supervised warm start: teacher forcing on (prompt, answer) pairs before RL.

A policy that never produces a well-formed answer gets no reward and so no GRPO signal; a short warm
start on a few examples teaches the answer format (answer then eos) so that RL has something to sharpen.
"""

import torch

from rlvr.trainer import prompts
from rlvr.trainer.devices import model_device
from rlvr.trainer.grpo import completion_logprobs
from rlvr.trainer.policy import Policy


def sft_warmstart(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    examples: list[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    seed: int,
) -> list[float]:
    """`steps` updates of mean token cross-entropy on answer tokens + eos (prompt tokens are context
    only). Each batch is `batch_size` examples drawn with replacement by a generator seeded with `seed`,
    so the run is reproducible and independent of the global RNG. Returns the loss of each step.
    """
    if not examples:
        raise ValueError("sft_warmstart needs at least one (prompt, answer) example")
    tokenizer, model = policy.tokenizer, policy.model
    pad_id = tokenizer.pad_token_id
    prompt_tokens = prompts.prompt_ids(tokenizer, [prompt for prompt, _ in examples])
    answer_tokens = [
        ids + [tokenizer.eos_token_id]
        for ids in tokenizer([answer for _, answer in examples], add_special_tokens=False)["input_ids"]
    ]
    generator = torch.Generator().manual_seed(seed)  # on the CPU, so the batches are the same on every device
    device = model_device(model)
    losses = []
    for _ in range(steps):
        picks = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        prompt_width = max(len(prompt_tokens[i]) for i in picks)
        answer_width = max(len(answer_tokens[i]) for i in picks)
        rows = [[pad_id] * (prompt_width - len(prompt_tokens[i])) + prompt_tokens[i] for i in picks]
        prompt_ids = torch.tensor(rows, device=device)
        answer_rows = [answer_tokens[i] + [pad_id] * (answer_width - len(answer_tokens[i])) for i in picks]
        answer_ids = torch.tensor(answer_rows, device=device)
        mask = torch.tensor(
            [[1] * len(answer_tokens[i]) + [0] * (answer_width - len(answer_tokens[i])) for i in picks],
            dtype=torch.bool,
            device=device,
        )
        logp, token_mask = completion_logprobs(model, prompt_ids, answer_ids, pad_id, mask)
        loss = -(logp * token_mask).sum() / token_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    optimizer.zero_grad(set_to_none=True)
    return losses
