"""RLPR's probabilities under the policy: the mean per-token probability of a reference answer after a prompt and
a text (the sampled reasoning, or nothing), in batched no-grad forward passes on the policy's device.

The prompt is tokenized as the policy reads it everywhere (trainer/prompts.py); the text and the reference after
it are tokenized together, as RLPR's code tokenizes its whole rewritten sequence, so a token that spans the last
character of the reasoning and the first of the reference (" 40" in most BPE vocabularies) is read as the model
would write it and counts as the reference's. The reference's tokens are those whose characters overlap it
(RLPR's `locate_substring_tokens`). Rows go through the model in consecutive micro-batches of at most
`micro_batch_tokens` padded tokens, so the same rows always meet the same batches: the result is a function of
the inputs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.errors import UserError
from rlvr.trainer import prompts
from rlvr.trainer.logprobs import completion_logprobs
from rlvr.trainer.policy import Policy
from rlvr.verifiers.cache import VerifierConfig
from rlvr.verifiers.rlpr import RLPR_VERSION, ReferenceText, RLPRConfig, without_reasoning


@dataclass(frozen=True)
class ReferenceProbability:
    """The mean of π(token | everything before it) over the reference's tokens, how many there were, and the
    smallest of them (1.0 without tokens); a reference with no tokens has mean 0, as in RLPR's code."""

    mean: float
    tokens: int
    lowest: float


@dataclass(frozen=True)
class _Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    reference_positions: list[int]  # indices into completion_ids


def reference_probabilities(
    policy: Policy, texts: Sequence[ReferenceText], temperature: float = 1.0, micro_batch_tokens: int = 16384
) -> list[ReferenceProbability]:
    """The reference's mean per-token probability for each of `texts`, in order (logits / `temperature`)."""
    rows = _rows(policy, texts)
    found: dict[int, ReferenceProbability] = {
        i: ReferenceProbability(0.0, 0, 1.0) for i, row in enumerate(rows) if not row.reference_positions
    }
    todo = [i for i in range(len(rows)) if i not in found]
    for chunk in _micro_batches([rows[i] for i in todo], micro_batch_tokens):
        chosen = [todo[k] for k in chunk]
        for i, probabilities in zip(chosen, _forward(policy, [rows[i] for i in chosen], temperature), strict=True):
            found[i] = ReferenceProbability(
                float(probabilities.double().mean()), probabilities.numel(), float(probabilities.min())
            )
    return [found[i] for i in range(len(rows))]


def _rows(policy: Policy, texts: Sequence[ReferenceText]) -> list[_Row]:
    tokenizer = policy.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("label.reward=rlpr needs a fast tokenizer (one that gives character offsets)")
    prompt_ids = prompts.prompt_ids(tokenizer, [t.prompt for t in texts])
    encoded = tokenizer([t.before + t.reference for t in texts], add_special_tokens=False, return_offsets_mapping=True)
    rows = []
    for text, prompt, offsets, completion in zip(
        texts, prompt_ids, encoded["offset_mapping"], encoded["input_ids"], strict=True
    ):
        start, end = len(text.before), len(text.before) + len(text.reference)
        positions = [k for k, (first, last) in enumerate(offsets) if first < end and last > start]
        rows.append(_Row(list(prompt), list(completion), positions))
    return rows


def _micro_batches(rows: Sequence[_Row], budget: int) -> list[list[int]]:
    """Consecutive rows whose padded size (rows x (widest prompt + widest completion)) stays within `budget`; a
    row wider than it goes alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    prompt_width = completion_width = 0
    for k, row in enumerate(rows):
        wider_prompt = max(prompt_width, len(row.prompt_ids))
        wider_completion = max(completion_width, len(row.completion_ids))
        if current and (len(current) + 1) * (wider_prompt + wider_completion) > budget:
            batches.append(current)
            current, wider_prompt, wider_completion = [], len(row.prompt_ids), len(row.completion_ids)
        current.append(k)
        prompt_width, completion_width = wider_prompt, wider_completion
    if current:
        batches.append(current)
    return batches


def _forward(policy: Policy, rows: Sequence[_Row], temperature: float) -> list[torch.Tensor]:
    """One no-grad forward over `rows`: each row's reference-token probabilities (float32, on the CPU)."""
    pad_id = policy.tokenizer.pad_token_id
    device = next(policy.model.parameters()).device
    prompt_width = max(len(r.prompt_ids) for r in rows)
    completion_width = max(len(r.completion_ids) for r in rows)
    prompt_ids = torch.tensor([[pad_id] * (prompt_width - len(r.prompt_ids)) + r.prompt_ids for r in rows])
    completion_ids = torch.tensor(
        [r.completion_ids + [pad_id] * (completion_width - len(r.completion_ids)) for r in rows]
    )
    mask = torch.tensor([[k < len(r.completion_ids) for k in range(completion_width)] for r in rows])
    with torch.no_grad():
        logp, _ = completion_logprobs(
            policy.model, prompt_ids.to(device), completion_ids.to(device), pad_id, mask.to(device), temperature
        )
    logp = logp.float().cpu()
    return [logp[i, r.reference_positions].exp() for i, r in enumerate(rows)]


def debias_rows(
    policy: Policy,
    policy_id: str,
    problems: Sequence[Mapping[str, Any]],
    cfg: RLPRConfig,
    run_id: str,
    step: int | None,
) -> list[dict[str, Any]]:
    """The `rlpr_debias` rows of `problems` (problem_id, prompt, reference) under `policy`: r_noreason, the
    reference's mean per-token probability right after the prompt (RLPR's scoreA)."""
    texts = [without_reasoning(str(p["prompt"]), str(p["reference"]), cfg) for p in problems]
    found = reference_probabilities(policy, texts, cfg.temperature, cfg.micro_batch_tokens)
    return [
        {
            "run_id": run_id,
            "step": step,
            "problem_id": p["problem_id"],
            "policy_id": policy_id,
            "probability": term.mean,
            "n_tokens": term.tokens,
        }
        for p, term in zip(problems, found, strict=True)
    ]


def rlpr_identity(cfg: VerifierConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """What decides the RLPR stages' outputs (their ids): RLPR's settings and version and the stage's params; not
    the verifiers' versions nor the pool settings of the label section, which RLPR does not use."""
    return {"rlpr": cfg.rlpr.model_dump(mode="json"), "version": RLPR_VERSION, **dict(params)}
