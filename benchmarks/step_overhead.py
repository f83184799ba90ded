"""Where the time of one RL step goes, and what orchestration and storage cost on top of the model work.

Ours: the real pipeline (Prefect flow, a task run per step, Parquet artifacts and manifests, the reward
cache and the verifier pool) for N RL steps of the default config; the stage_runs view splits each
step into read / build / commit per stage, and what is left of the step's wall time is orchestration.
Peer: the same model work (uniform pick of the same number of prompts and rollouts, sample, verify, GRPO
update) in a plain Python loop with no Prefect and no store.

    python benchmarks/step_overhead.py [--steps 60] [--set key=value ...]

Overhead share = (pipeline step - plain step) / pipeline step. Orchestration + storage share = (commit +
read + what no stage accounts for) / pipeline step, measured inside the same run. The end-of-step group
commit (fsyncs, manifests) runs on a committer thread while the next step computes; it is printed, and
whatever of it delays the step shows up in "orchestration".
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

_tmp = tempfile.mkdtemp(prefix="rlvr-bench-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_tmp, "prefect"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
os.environ.setdefault("HF_HOME", os.path.join(_tmp, "hf"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

WARMUP_STEPS = 5  # the first steps start the subflow, the verifier pool and the caches
PER_STEP_STAGES = ("select", "allocate", "rollout", "label", "train", "update")


def pipeline_run(steps: int, overrides: list[str]) -> tuple[float, list[dict], float]:
    """Seconds per RL step in steady state, the stage_runs rows of the timed steps, and the seconds the
    end-of-step group commits took (`Store.batch`: syncs, manifests, deferred deletes) over those steps."""
    from rlvr import progress
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    first, last = WARMUP_STEPS, steps - 1  # the last step also evaluates and checkpoints
    stamps: dict[int, float] = {}
    flushes: list[float] = []
    progress.listen(
        lambda event, fields: stamps.__setitem__(fields["step"], time.perf_counter()) if event == "step" else None
    )
    flush = Store._flush

    def timed_flush(self: Store, batch: object) -> None:
        started = time.perf_counter()
        flush(self, batch)
        if first in stamps and last not in stamps:
            flushes.append(time.perf_counter() - started)

    Store._flush = timed_flush  # type: ignore[method-assign]
    root = os.path.join(_tmp, "store")
    cfg = load_config(
        None,
        [
            "run_id=bench",
            f"train.steps={steps}",
            f"evaluate.every={steps}",
            f"checkpoint.every={steps}",
            f"flow.steps_per_subflow={steps}",
            *overrides,
        ],
    )
    execute(root, cfg)
    per_step = (stamps[last] - stamps[first]) / (last - first)
    rows = query(
        Store.open(root),
        f"SELECT stage, read_seconds, build_seconds, commit_seconds FROM stage_runs "
        f"WHERE step > {first} AND step <= {last}",
    ).to_pylist()
    return per_step, [r for r in rows if r["stage"] in PER_STEP_STAGES], sum(flushes)


def plain_step_seconds(steps: int, overrides: list[str]) -> float:
    """Seconds per RL step of the same work in a plain loop (no Prefect, no store)."""
    import random

    from rlvr.curricula.base import PoolProblem
    from rlvr.curricula.uniform import UniformConfig, UniformStrategy
    from rlvr.data.sources import SOURCES
    from rlvr.flows.config import load_config
    from rlvr.trainer.generation import sample
    from rlvr.trainer.grpo import RolloutBatch, grpo_step
    from rlvr.trainer.policy import init_policy, make_optimizer
    from rlvr.trainer.sft import sft_warmstart
    from rlvr.verifiers.registry import get_verifier

    cfg = load_config(None, overrides)
    problems = list(SOURCES.make(cfg.synthesize.sources[0]).rows(0))
    answer = {p["prompt"]: p["answer"] for p in problems}
    pool = [PoolProblem(prompt, "all") for prompt in sorted(answer)]
    policy = init_policy(cfg.policy, seed=0)
    warm = make_optimizer(policy, lr=cfg.warmstart.lr, weight_decay=0.0)
    sft_warmstart(
        policy,
        warm,
        [(p["prompt"], p["answer"]) for p in problems[: len(problems) // 5]],
        steps=cfg.warmstart.steps,
        batch_size=cfg.warmstart.batch_size,
        seed=0,
    )
    optimizer = make_optimizer(policy, lr=cfg.train.grpo.lr, weight_decay=0.0)
    verifier, strategy = (
        get_verifier(cfg.label.verifier or SOURCES.make(cfg.synthesize.sources[0]).verifier),
        UniformStrategy(UniformConfig()),
    )
    started = time.perf_counter()
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        picks = [p.problem_id for p in strategy.select(pool, cfg.select.batch_size, random.Random(step))]
        samples = sample(
            policy,
            picks,
            [cfg.allocate.n] * len(picks),
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=step,
        )
        rewards = [verifier.score(s.text, answer[picks[s.prompt_index]]).value for s in samples]
        grpo_step(policy, optimizer, RolloutBatch(prompts=picks, samples=samples, rewards=rewards), cfg.train.grpo)
    return (time.perf_counter() - started) / (steps - WARMUP_STEPS)


def breakdown(per_step: float, rows: list[dict], steps: int) -> dict[str, float]:
    """Milliseconds per step by where they went."""
    ms = {
        "model (rollout + train builds)": 0.0,
        "verification (label build)": 0.0,
        "curriculum (select, allocate, update builds)": 0.0,
        "storage: reading inputs": 0.0,
        "storage: committing outputs": 0.0,
    }
    for r in rows:
        build = r["build_seconds"] * 1000 / steps
        if r["stage"] in ("rollout", "train"):
            ms["model (rollout + train builds)"] += build
        elif r["stage"] == "label":
            ms["verification (label build)"] += build
        else:
            ms["curriculum (select, allocate, update builds)"] += build
        ms["storage: reading inputs"] += r["read_seconds"] * 1000 / steps
        ms["storage: committing outputs"] += r["commit_seconds"] * 1000 / steps
    ms["orchestration (Prefect task, flow, the rest)"] = per_step * 1000 - sum(ms.values())
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    plain = plain_step_seconds(args.steps, args.overrides)
    ours, rows, flush_seconds = pipeline_run(args.steps, args.overrides)
    timed = args.steps - 1 - WARMUP_STEPS
    parts = breakdown(ours, rows, timed)
    print(f"{'one RL step of the default config':48}{'ms/step':>10}{'share':>8}")
    for name, value in parts.items():
        print(f"  {name:46}{value:>10.1f}{value / (ours * 1000):>8.1%}")
    print(f"  {'(group commit: syncs and manifests, on the':46}{flush_seconds * 1000 / timed:>10.1f}")
    print("   committer thread while the next step runs)")
    if any(o.startswith("flow.async_level=") and o != "flow.async_level=0" for o in args.overrides):
        print("   (flow.async_level > 0: the sampling stages run beside the trainer, so the parts overlap: their")
        print("    sum can pass the step, and what no stage accounts for, 'orchestration', can be negative)")
    print(f"{'pipeline step (ours)':48}{ours * 1000:>10.1f}")
    print(f"{'plain loop step (peer)':48}{plain * 1000:>10.1f}")
    overhead = sum(value for name, value in parts.items() if name.startswith(("storage", "orchestration")))
    print(
        f"orchestration + storage: {overhead / (ours * 1000):.1%} of a pipeline step; "
        f"pipeline vs plain loop: {(ours - plain) / ours:.1%} overhead (pipeline/plain = {ours / plain:.2f}x)"
    )


if __name__ == "__main__":
    main()
