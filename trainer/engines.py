"""Rollout engines: what turns prompts into sampled completions, chosen by `rollout.type`.

An engine receives the policy to sample from (`update_weights`, called with the policy's reference
each time it may have changed), generates `counts[i]` completions of `prompts[i]` (`generate`) and
releases what it holds (`close`). transformers `generate` on the training model is the built-in
engine; an engine that keeps its own copy of the weights (vLLM, a remote server) syncs them in
`update_weights`. Engines are long-lived: one per config and process (`engine_for`).

The interface and shared helpers are in trainer/engine_base.py; this module holds the built-in
transformers engine and the registry, where every built-in engine (transformers, openai in
trainer/remote.py, vllm in trainer/vllm_engine.py, which never imports vllm until it starts) is registered.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from rlvr.plugins import TypedRegistry
from rlvr.trainer.engine_base import (
    Continuation,
    EngineConfig,
    RolloutEngine,
    SamplingParams,
    check_rows,
    eos_ids,
)
from rlvr.trainer.generation import Cache, Precision, Sample, greedy, sample
from rlvr.trainer.policy import Policy
from rlvr.trainer.remote import OpenAIEngine, OpenAIEngineConfig
from rlvr.trainer.vllm_engine import VLLMEngine, VLLMEngineConfig

__all__ = ["ENGINES", "EngineConfig", "RolloutEngine", "SamplingParams", "TransformersEngine", "engine_for"]


class TransformersEngineConfig(EngineConfig):
    type: Literal["transformers"] = "transformers"
    cache: Cache = Field(
        "shared_prompt",
        exclude_if=lambda value: value == "shared_prompt",  # left out of dumps, so ids from before it stay
        description=(
            "shared_prompt: each distinct prompt's key/value cache computed once for its group; static: "
            "transformers' static cache, compiled on a GPU (a slow first call, then faster decoding); graph: our "
            "own loop over a static cache, each token step replayed as a CUDA graph on a GPU (see "
            "docs/training.md, Rollout engines)"
        ),
    )
    precision: Precision = Field(
        "auto",
        exclude_if=lambda value: value == "auto",
        description=(
            "auto: bf16 autocast when float32 weights are on a GPU, else the weights' dtype; weights: always the "
            "weights' dtype; bf16: always bf16 autocast"
        ),
    )
    seeding: Literal["batch", "row"] = Field(
        "batch",
        exclude_if=lambda value: value == "batch",
        description=(
            "batch: every row of a call draws from one torch RNG stream seeded with the step's seed; row: each "
            "sample draws from its own hashed stream of (seed, its prompt's place in the call, its sample index), "
            "so a batch split across data-parallel ranks samples the same tokens (see docs/training.md, Rollout "
            "engines)"
        ),
    )


class TransformersEngine(RolloutEngine):
    """transformers `generate` on the training model itself: nothing to sync, nothing to start."""

    type = "transformers"

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        self.policy: Policy | None = None

    def update_weights(self, policy: Policy, policy_ref: str) -> None:
        self.policy = policy

    def settings(self) -> TransformersEngineConfig:
        return self.cfg if isinstance(self.cfg, TransformersEngineConfig) else TransformersEngineConfig()

    def generate(self, prompts: Sequence[str], counts: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        if self.policy is None:
            raise RuntimeError("call update_weights before generate")
        own = self.settings()
        return sample(
            self.policy,
            list(prompts),
            list(counts),
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            cache=own.cache,
            precision=own.precision,
            logprob_temperature=sampling.logprob_temperature,
            row_keys=range(len(prompts)) if own.seeding == "row" else None,
        )

    def continue_rows(
        self,
        rows: Sequence[Sequence[int]],
        budgets: Sequence[int],
        temperature: float,
        top_p: float,
        seeds: Sequence[int],
    ) -> list[Continuation]:
        """Row-seeded (each seed is its row's key, trainer/row_sampling.py), so a row draws the same tokens in any
        batch: the rollout loop's own decoding on the policy (`turn_decoding.continue_rows`, the one implementation),
        which the rollout stage calls directly (it also records log-probs and splits over data-parallel ranks)."""
        from rlvr.trainer.turn_decoding import continue_rows  # the loop's decoding: imported when an episode needs it

        if self.policy is None:
            raise RuntimeError("call update_weights before continue_rows")
        check_rows(rows, budgets, seeds)
        own = self.settings()
        ids, _ = continue_rows(
            self.policy, rows, budgets, temperature=temperature, top_p=top_p, keys=seeds, cache=own.cache,
            precision=own.precision,
        )  # fmt: skip
        eos = eos_ids(self.policy)
        return [(row, "stop" if row and row[-1] in eos else "length") for row in ids]

    def greedy(self, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
        if self.policy is None:
            raise RuntimeError("call update_weights before greedy")
        own = self.settings()
        return greedy(self.policy, list(prompts), max_new_tokens=max_new_tokens, cache=own.cache)

    def close(self) -> None:
        self.policy = None


ENGINES: TypedRegistry[RolloutEngine] = TypedRegistry(
    "rollout engine", EngineConfig, RolloutEngine, group="rlvr.engines"
)
_live: dict[str, RolloutEngine] = {}


def engine_for(cfg: EngineConfig) -> RolloutEngine:
    """The process's engine for this config (started on first use, closed at exit)."""
    key = cfg.model_dump_json()
    if key not in _live:
        engine = ENGINES.make(cfg)
        if not _live:
            atexit.register(close_engines)
        _live[key] = engine
    return _live[key]


def close_engines() -> None:
    for engine in _live.values():
        engine.close()
    _live.clear()


ENGINES.register(TransformersEngineConfig, TransformersEngine)
ENGINES.register(OpenAIEngineConfig, OpenAIEngine)
ENGINES.register(VLLMEngineConfig, VLLMEngine)
