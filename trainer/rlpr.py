"""RLPR's probabilities under the policy: the mean per-token probability of a reference answer after a prompt and
a text (the sampled reasoning, or nothing), in batched no-grad forward passes on the policy's device.

The prompt is tokenized as the policy reads it everywhere (trainer/prompts.py); the text and the reference after
it are tokenized together, as RLPR's code tokenizes its whole rewritten sequence, so a token that spans the last
character of the reasoning and the first of the reference (" 40" in most BPE vocabularies) is read as the model
would write it and counts as the reference's. The reference's tokens are those whose characters overlap it
(RLPR's `locate_substring_tokens`). With the end token (`label.rlpr.end_token`) what followed the answer is read
too, and the token after the reference's last one (or the eos, where the response ended there) joins the mean, its
probability capped (RLPR's `gt_tokens_one_more`). Rows go through the model in consecutive micro-batches of at most
`micro_batch_tokens` padded tokens, so the same rows always meet the same batches: the result is a function of
the inputs alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.errors import UserError
from rlvr.trainer import prompts
from rlvr.trainer.engine_base import eos_ids
from rlvr.trainer.logprobs import completion_logprobs
from rlvr.trainer.policy import Policy
from rlvr.verifiers.cache import VerifierConfig
from rlvr.verifiers.rlpr import RLPR_VERSION, ReferenceText, RLPRConfig, without_reasoning


@dataclass(frozen=True)
class ReferenceProbability:
    """The mean of π(token | everything before it) over the reference's tokens (and the end token, capped, when it
    is scored), how many reference tokens there were, the smallest of their probabilities (1.0 without tokens),
    and the end token's probability before the cap (None when it was not scored); a reference with no tokens has
    mean 0, as in RLPR's code."""

    mean: float
    tokens: int
    lowest: float
    end: float | None = None


@dataclass(frozen=True)
class _Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    reference_positions: list[int]  # indices into completion_ids
    end_position: int | None  # the end token's index into completion_ids, when it is scored


def reference_probabilities(
    policy: Policy,
    texts: Sequence[ReferenceText],
    temperature: float = 1.0,
    micro_batch_tokens: int = 16384,
    end_cap: float | None = None,
) -> list[ReferenceProbability]:
    """The reference's mean per-token probability for each of `texts`, in order (logits / `temperature`); with
    `end_cap`, the token after the reference joins the mean, counting at most `end_cap`. A policy sharded over
    data-parallel ranks scores through its group, each rank whole micro-batches of the one-process split."""
    if policy.ranks is not None and not policy.ranks.in_op:
        return list(policy.ranks.reference_probabilities(list(texts), temperature, micro_batch_tokens, end_cap))
    found = reference_probabilities_share(policy, texts, temperature, micro_batch_tokens, end_cap, 0, 1)
    return [found[i] for i in range(len(texts))]


def reference_probabilities_share(
    policy: Policy,
    texts: Sequence[ReferenceText],
    temperature: float,
    micro_batch_tokens: int,
    end_cap: float | None,
    rank: int,
    world_size: int,
    idle: Callable[[], object] | None = None,
) -> dict[int, ReferenceProbability]:
    """`reference_probabilities` of the micro-batches numbered `rank` modulo `world_size` (and of the texts
    without reference tokens, on rank 0), by text index. The micro-batches are those one process makes, so every
    text is scored with the same neighbours, the same padding and so the same bits at any rank count. `idle`: a
    pass run in place of each batch this rank lacks, so that every rank of a sharded model (whose every forward
    is a collective) runs as many forwards."""
    rows = _rows(policy, texts, end_cap is not None)
    empty = [i for i, row in enumerate(rows) if not row.reference_positions]
    found = {i: ReferenceProbability(0.0, 0, 1.0) for i in empty} if rank == 0 else {}
    todo = [i for i in range(len(rows)) if i not in set(empty)]
    batches = _micro_batches([rows[i] for i in todo], micro_batch_tokens)
    mine = batches[rank::world_size]
    for chunk in mine:
        chosen = [todo[k] for k in chunk]
        for i, probabilities in zip(chosen, _forward(policy, [rows[i] for i in chosen], temperature), strict=True):
            found[i] = _term(rows[i], probabilities, end_cap)
    for _ in range(-(-len(batches) // world_size) - len(mine)):
        if idle is not None:
            idle()
    return found


def _term(row: _Row, probabilities: torch.Tensor, end_cap: float | None) -> ReferenceProbability:
    """A row's term from the probabilities of its completion's tokens."""
    reference = probabilities[row.reference_positions].double()
    if row.end_position is None or end_cap is None:
        return ReferenceProbability(float(reference.mean()), reference.numel(), float(reference.min()))
    end = float(probabilities[row.end_position])
    mean = (float(reference.sum()) + min(end, end_cap)) / (reference.numel() + 1)
    return ReferenceProbability(mean, reference.numel(), float(reference.min()), end)


def _rows(policy: Policy, texts: Sequence[ReferenceText], end_token: bool) -> list[_Row]:
    """Each text's ids, cut after the last token scored. With `end_token`, what followed the answer is tokenized
    with the rest and the token after the reference's last is scored; where the text ends there, the eos if the
    response stopped, and no end token if it was cut off."""
    tokenizer = policy.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("label.reward=rlpr needs a fast tokenizer (one that gives character offsets)")
    eos = _end_id(policy) if end_token else None
    prompt_ids = prompts.prompt_ids(tokenizer, [t.prompt for t in texts])
    written = [t.before + t.reference + (t.after if end_token else "") for t in texts]
    encoded = tokenizer(written, add_special_tokens=False, return_offsets_mapping=True)
    rows = []
    for text, prompt, offsets, completion in zip(
        texts, prompt_ids, encoded["offset_mapping"], encoded["input_ids"], strict=True
    ):
        start, end = len(text.before), len(text.before) + len(text.reference)
        positions = [k for k, (first, last) in enumerate(offsets) if first < end and last > start]
        ids, end_position = list(completion), None
        if positions and eos is not None and (positions[-1] + 1 < len(ids) or text.stopped):
            end_position = positions[-1] + 1  # a response cut off right after its answer has none
            ids = [*ids, eos] if end_position == len(ids) else ids
        scored = [*positions, end_position] if end_position is not None else positions
        rows.append(_Row(list(prompt), ids[: max(scored, default=len(ids) - 1) + 1], positions, end_position))
    return rows


def _end_id(policy: Policy) -> int:
    """The token that ends a response: the tokenizer's eos when the policy stops on it, else the smallest stop id."""
    stops = eos_ids(policy)
    if not stops:
        raise UserError("label.rlpr.end_token needs a policy with an end-of-sequence token")
    eos = policy.tokenizer.eos_token_id
    return int(eos) if eos in stops else min(stops)


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
    """One no-grad forward over `rows`: the probabilities of each row's completion tokens (float32, on the CPU)."""
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
    return [logp[i, : len(r.completion_ids)].exp() for i, r in enumerate(rows)]


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
    found = reference_probabilities(policy, texts, cfg.temperature, cfg.micro_batch_tokens, cfg.end_cap())
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
    settings = cfg.rlpr.model_dump(mode="json")
    for key in ("end_token", "end_token_cap"):  # added later: at their defaults earlier runs keep their ids
        if settings[key] == RLPRConfig.model_fields[key].default:
            del settings[key]
    return {"rlpr": settings, "version": RLPR_VERSION, **dict(params)}
