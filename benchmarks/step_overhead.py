"""Orchestration and storage overhead of one RL step on the default config.

Ours: the real pipeline (Prefect tasks, Parquet artifacts, manifests, DuckDB-free) for N RL steps.
Peer: the same model work (uniform pick, sample, verify, GRPO update) in a plain Python loop with
no Prefect and no store. Overhead share = (pipeline step - plain step) / pipeline step.

    python benchmarks/step_overhead.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_tmp = tempfile.mkdtemp(prefix="rlvr-bench-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_tmp, "prefect"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HOME", os.path.join(_tmp, "hf"))


def pipeline_step_seconds(steps: int) -> tuple[float, float]:
    """Seconds per RL step through the pipeline, and the model-compute seconds it recorded per step."""
    from rlvr.flows import progress
    from rlvr.flows.config import load_config
    from rlvr.flows.runner import execute
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    stamps: list[float] = []
    progress.listen(lambda event, fields: stamps.append(time.perf_counter()) if event == "step" else None)
    root = os.path.join(_tmp, "store")
    cfg = load_config(None, ["run_id=bench", f"train.steps={steps}", f"evaluate.every={steps}",
                             f"checkpoint.every={steps}", f"flow.steps_per_subflow={steps}"])
    execute(root, cfg)
    store = Store.open(root)
    compute = query(store, "SELECT avg(compute_seconds) AS c FROM train_steps").to_pylist()[0]["c"]
    # skip the first steps (warm-up of the subflow) and take the steady-state rate
    steady = stamps[5:]
    return (steady[-1] - steady[0]) / (len(steady) - 1), compute


def plain_step_seconds(steps: int) -> float:
    """Seconds per RL step of the same work in a plain loop (no Prefect, no store)."""
    from rlvr.curricula.uniform import select_uniform
    from rlvr.flows.config import load_config
    from rlvr.trainer.generation import sample
    from rlvr.trainer.grpo import RolloutBatch, grpo_step
    from rlvr.trainer.policy import init_policy, make_optimizer
    from rlvr.trainer.sft import sft_warmstart
    from rlvr.verifiers.arithmetic import ArithmeticSpec, ArithmeticVerifier, generate

    cfg = load_config()
    problems = generate(ArithmeticSpec(), seed=0)
    answer = {p["prompt"]: p["answer"] for p in problems}
    policy = init_policy(cfg.policy, seed=0)
    # the same warm start as the pipeline's, so both loops update a policy that gets some answers right
    warm = make_optimizer(policy, lr=cfg.warmstart.lr, weight_decay=0.0)
    sft_warmstart(policy, warm, [(p["prompt"], p["answer"]) for p in problems[:30]], steps=cfg.warmstart.steps,
                  batch_size=cfg.warmstart.batch_size, seed=0)
    optimizer = make_optimizer(policy, lr=cfg.train.grpo.lr, weight_decay=0.0)
    verifier = ArithmeticVerifier()
    started = None
    for step in range(steps):
        if step == 5:
            started = time.perf_counter()
        picks = [p for p, _ in select_uniform(list(answer), cfg.select.batch_size, seed=step)]
        samples = sample(policy, picks, [cfg.allocate.n] * len(picks), max_new_tokens=cfg.rollout.max_new_tokens,
                         temperature=cfg.rollout.temperature, top_p=1.0, seed=step)
        rewards = [verifier.score(s.text, answer[picks[s.prompt_index]]).value for s in samples]
        grpo_step(policy, optimizer, RolloutBatch(prompts=picks, samples=samples, rewards=rewards), cfg.train.grpo)
    return (time.perf_counter() - started) / (steps - 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    plain = plain_step_seconds(args.steps)
    ours, compute = pipeline_step_seconds(args.steps)
    print(f"{'':28}{'ms/step':>10}")
    print(f"{'plain loop (peer)':28}{plain * 1000:>10.1f}")
    print(f"{'pipeline (ours)':28}{ours * 1000:>10.1f}")
    print(f"{'  of which GRPO update':28}{compute * 1000:>10.1f}")
    print(f"overhead share of a pipeline step: {(ours - plain) / ours:.1%} (pipeline/plain = {ours / plain:.2f}x)")


if __name__ == "__main__":
    main()
