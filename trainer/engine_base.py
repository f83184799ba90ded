"""What every rollout engine shares: the sampling settings, the engine interface, and the helpers for seeds
and end-of-sequence ids. The engines themselves and their registry are in trainer/engines.py.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError
from rlvr.trainer.generation import Sample
from rlvr.trainer.policy import Policy

__all__ = [
    "Continuation",
    "EngineConfig",
    "RolloutEngine",
    "SamplingParams",
    "check_rows",
    "eos_ids",
    "request_seed",
    "with_eos",
]


# One token-id row continued (`RolloutEngine.continue_rows`): its sampled ids, ending with the eos when it stopped,
# and why it ended ("stop": eos; "length": its budget).
Continuation = tuple[list[int], Literal["stop", "length"]]


@dataclass(frozen=True)
class SamplingParams:
    """`logprob_temperature`: ask for each sample's token log-probs under the raw logits at that temperature
    (`Sample.logprobs`); an engine that cannot give them leaves them None and the caller computes them."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    logprob_temperature: float | None = None


def request_seed(seed: int, prompt_index: int) -> int:
    """The seed of one prompt's request in engines that send a request per prompt (vLLM, a server):
    distinct per prompt and the same in every process, so the same seed gives the same samples however
    the requests are batched or ordered."""
    return random.Random(f"{seed}:{prompt_index}").getrandbits(31)


def gives_raw_logprobs(sampling: SamplingParams) -> bool:
    """Whether an engine whose log-probs are of the raw logits (vLLM's default `raw_logprobs`, a vLLM server's) has
    what `sampling.logprob_temperature` asks: only at temperature 1; at another the rollout stage computes them."""
    return sampling.logprob_temperature == 1.0


def matching_logprobs(values: Sequence[float] | None, ids: Sequence[int]) -> list[float] | None:
    """An engine's log-probs of a completion when there is one for each of its `ids` (an eos the engine did not
    count, appended by `with_eos`, leaves them unusable: None)."""
    if values is None or len(values) != len(ids) or any(not isinstance(v, (int, float)) for v in values):
        return None
    return [float(v) for v in values]


def check_rows(rows: Sequence[Sequence[int]], budgets: Sequence[int], seeds: Sequence[int]) -> None:
    """`continue_rows`' arguments: one budget (>= 1) and one seed a non-empty row."""
    if not len(rows) == len(budgets) == len(seeds):
        raise ValueError(f"one budget and seed a row: {len(rows)} rows, {len(budgets)} budgets, {len(seeds)} seeds")
    if any(budget < 1 for budget in budgets) or any(not row for row in rows):
        raise ValueError(f"every row needs a token and a budget >= 1, got budgets {list(budgets)}")


def eos_ids(policy: Policy) -> set[int]:
    """Every token id the policy treats as end-of-sequence (its generation config may list several)."""
    eos = policy.model.generation_config.eos_token_id
    if eos is None:
        eos = policy.tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(token) for token in eos} if isinstance(eos, list) else {int(eos)}


def with_eos(ids: Sequence[int], stopped: bool, policy: Policy) -> list[int]:
    """`ids` ending with the eos when the completion stopped, as the transformers engine gives them: the
    loss must train the stop. Engines that send no stop strings read "stop" as end-of-sequence; a backend
    that leaves that token out of its ids (or a re-tokenized text) gets the tokenizer's eos appended."""
    ids = [int(token) for token in ids]
    eos = policy.tokenizer.eos_token_id
    if stopped and eos is not None and (not ids or ids[-1] not in eos_ids(policy)):
        ids.append(int(eos))
    return ids


class EngineConfig(BaseModel):
    """Sampling settings every engine shares; each engine's config subclasses it and adds `type`."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(3, ge=1)
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature (hotter sampling rarely produces a whole multi-digit answer)"
    )
    top_p: float = Field(1.0, gt=0, le=1)

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, seed)


class RolloutEngine(ABC):
    type: ClassVar[str]

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def update_weights(self, policy: Policy, policy_ref: str) -> None:
        """Sample from `policy` (named by `policy_ref`) from now on."""

    @abstractmethod
    def generate(self, prompts: Sequence[str], counts: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """`counts[i]` samples of `prompts[i]`, grouped by prompt in order; the same for the same seed."""

    def continue_rows(
        self,
        rows: Sequence[Sequence[int]],
        budgets: Sequence[int],
        temperature: float,
        top_p: float,
        seeds: Sequence[int],
    ) -> list[Continuation]:
        """One completion of each token-id row, at most `budgets[i]` tokens drawn with `seeds[i]` (temperature 0:
        greedy), all rows in one batch: a turn of the multi-turn loop (trainer/episodes.py), whose rows are whole
        conversations kept as ids, so nothing before the new turn is decoded and tokenized again."""
        raise UserError(
            f"rollout.type={self.type} cannot continue token-id rows (continue_rows), so it cannot play env "
            "episodes; the built-in engines (transformers, vllm, openai) can"
        )

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        """The greedy completion of each prompt (evaluation, the CLPO policy rewriter): one sample at
        temperature 0, which vLLM and OpenAI-compatible servers decode greedily."""
        samples = self.generate(prompts, [1] * len(prompts), SamplingParams(max_new_tokens, 0.0, 1.0, 0))
        return [s.text for s in samples]

    def close(self) -> None:
        """Release processes, memory or connections the engine holds."""
