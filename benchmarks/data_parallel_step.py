"""The cost of one data-parallel GRPO update with 2 gloo ranks on the CPU: torchrun launched for every step
(the model and optimizer serialised through files both ways: `run_torchrun`, how `train.data_parallel` worked
before) against ranks that live for the whole run (`trainer/rank_pool.py`, how it works now), on the same
batches from the same starting policy, beside the one-process update.

Prints seconds per step for each (the mean over the steps after the first, which for the pool includes
starting the ranks and sending the state), and the ratio torchrun / pool.

    python benchmarks/data_parallel_step.py [--model tiny|smollm2-135m-instruct] [--steps 4] [--prompts 8] [--n 4]
        [--tokens 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rlvr.trainer.distributed import run_torchrun
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import (
    Policy,
    PolicyConfig,
    init_policy,
    load_optimizer_state,
    make_optimizer,
    policy_files,
    policy_from_files,
)
from rlvr.trainer.rank_pool import close_pool, pooled_update


def batch_of(policy: Policy, seed: int, prompts: int, n: int, tokens: int) -> RolloutBatch:
    """Random completions over the first 1,000 token ids with 0/1 rewards (every group mixed, so all train)."""
    rng = random.Random(seed)
    vocab = min(1000, policy.model.config.vocab_size)
    samples, rewards = [], []
    for group in range(prompts):
        for index in range(n):
            ids = [rng.randrange(3, vocab) for _ in range(tokens)]
            samples.append(Sample(group, index, ids, "", tokens, "length"))
            rewards.append(float(index % 2))
    return RolloutBatch(prompts=[f"{g}+{g}=" for g in range(prompts)], samples=samples, rewards=rewards)


def timed(update, batches: list[RolloutBatch]) -> list[float]:
    seconds = []
    for batch in batches:
        started = time.perf_counter()
        update(batch)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    cfg = GRPOConfig(lr=1e-5, minibatches=1)
    base = init_policy(PolicyConfig(model=args.model), seed=0)
    batches = [batch_of(base, seed, args.prompts, args.n, args.tokens) for seed in range(args.steps)]
    start = policy_files(base)

    def fresh() -> tuple[Policy, torch.optim.Optimizer]:
        policy = policy_from_files(start)
        return policy, make_optimizer(policy, cfg.lr, cfg.weight_decay)

    policy, optimizer = fresh()
    single = timed(lambda b: grpo_step(policy, optimizer, b, cfg), batches)

    holder = dict(zip(("policy", "optimizer"), fresh()))

    def torchrun_step(batch: RolloutBatch) -> None:
        files, optimizer_bytes, _ = run_torchrun(holder["policy"], holder["optimizer"], batch, cfg, nproc=2)
        holder["policy"] = policy_from_files(files)
        holder["optimizer"] = make_optimizer(holder["policy"], cfg.lr, cfg.weight_decay)
        load_optimizer_state(holder["optimizer"], optimizer_bytes)

    launched = timed(torchrun_step, batches)
    policy, optimizer = fresh()
    pooled = timed(lambda b: pooled_update(policy, optimizer, b, cfg, None, 2), batches)
    close_pool()
    print(
        f"model {args.model} ({sum(p.numel() for p in base.model.parameters()):,} parameters), "
        f"{args.prompts} x {args.n} rows of {args.tokens} tokens, {args.steps} steps, 2 gloo ranks, "
        f"{torch.get_num_threads()} threads in this process"
    )
    for name, seconds in (("one process", single), ("torchrun every step", launched), ("ranks for the run", pooled)):
        steady = statistics.mean(seconds[1:]) if len(seconds) > 1 else seconds[0]
        print(f"{name:22} first step {seconds[0]:7.2f} s   later steps {steady:7.2f} s/step")
    ratio = statistics.mean(launched[1:]) / statistics.mean(pooled[1:])
    print(f"torchrun every step / ranks for the run (later steps): {ratio:.1f}x")


if __name__ == "__main__":
    main()
