"""Which task and recipe should the demo run? A plain loop over the skills generator, per seed and split.

The loop is the pipeline's, without Prefect or the store: synthesize (verifiers/skills.py, split as the
synthesize stage splits), supervised warm start on the warmup split, a difficulty estimate (k samples per
pool problem at temperature 1), then RL steps of select (curricula strategy, arms = categories) ->
allocate (curricula allocator; Knapsack's p-hat is a problem's last 16 outcomes once it has 8, else the
difficulty estimate) -> sample -> reward (the arithmetic verifier's number comparison) -> grpo_step, with
greedy accuracy on the held-out test split. Prints one table per method (a row per run: accuracy after
warm start, final accuracy, effective ratio, seconds), a summary per method, and a last line with the
worst seed.

    .venv/bin/python benchmarks/demo_study.py                               # the recipe, 10 seeds x 2 splits
    .venv/bin/python benchmarks/demo_study.py --methods uniform,sec,knapsack --seeds 0-2 --splits 0 --eval-every 25

Defaults = the recipe this study recommends for the demo: the 8 default skills categories (767 problems;
test 0.2 = 153 held out, warmup 0.2), warm start 80 steps x 64 at lr 3e-3 on the warmup split, then 600
GRPO steps of 64 prompts x 8 rollouts at temperature 1.0, lr 1e-3, 2 updates, 3 new tokens.

Measured 2026-11-23 on the shared 2-core machine (one torch thread, one run at a time), uniform selection:
held-out accuracy after warm start -> after RL, split 0 seeds 0-9: 0.31->0.78, 0.24->0.84, 0.22->0.65,
0.22->0.80, 0.26->0.80, 0.24->0.80, 0.22->0.85, 0.31->0.80, 0.34->0.80, 0.24->0.77; split 1 seeds 0-4:
0.25->0.66, 0.34->0.82, 0.28->0.79, 0.28->0.76, 0.34->0.80. RL CPU 78-97 s (about 150 ms a step);
estimated `rlvr run` 183-202 s. What did not work: temperature 2.5 (3-token answers are almost never
sampled whole, copy stayed at 0), 32 prompts x 16 rollouts (the slow seeds memorise their training
problems: training reward 0.72, effective ratio 0.05, held-out 0.59), lr 1.5e-3 and 2e-3 (slower, or
collapse to answering "0" everywhere).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict, deque
from fractions import Fraction

import torch

from rlvr.curricula.base import Estimate, PoolProblem, ProblemOutcome, StepFeedback
from rlvr.curricula.knapsack import KnapsackAllocator, KnapsackConfig
from rlvr.curricula.sec import SecConfig, SecStrategy
from rlvr.curricula.uniform import UniformConfig, UniformStrategy
from rlvr.curricula.uniform_budget import UniformBudget, UniformBudgetConfig
from rlvr.tasks.synthesize import assign_splits
from rlvr.trainer.generation import greedy, sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, group_advantages, grpo_step
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.sft import sft_warmstart
from rlvr.verifiers.arithmetic import parse_number
from rlvr.verifiers.skills import DEFAULT_CATEGORIES, SkillsSpec, generate

# Pipeline cost beyond the plain loop's model work (benchmarks/step_overhead.py, README): about 40 s of
# start-up on the old default (Prefect server, stages before RL), plus about 5 s here for labelling the
# difficulty stage's k x ~610 samples through the verifier pool, and about 0.1 s of bookkeeping per RL step.
PIPELINE_STARTUP_S = 45.0
PIPELINE_STEP_OVERHEAD_S = 0.10


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--categories", default=",".join(DEFAULT_CATEGORIES), help="skills categories (verifiers/skills.py)"
    )
    parser.add_argument("--per-category", type=int, default=100, help="problems per category before the split")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--test-fraction", type=float, default=0.2, help="held out from all training")
    parser.add_argument("--warmup-fraction", type=float, default=0.2, help="the warm start's own split")
    parser.add_argument(
        "--warmup-categories", default="", help="comma list; empty = every category of the warmup split"
    )
    parser.add_argument("--seeds", default="0-9", help="model/RL seeds, e.g. 0-9 or 0,3,5")
    parser.add_argument("--splits", default="0,1", help="data seeds (generator draw and split)")
    parser.add_argument("--methods", default="uniform", help="comma list of uniform, sec, knapsack, sec+knapsack")
    parser.add_argument("--warmup-steps", type=int, default=80)
    parser.add_argument("--warmup-batch", type=int, default=64)
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument(
        "--difficulty-k", type=int, default=8, help="samples per pool problem at temperature 1 (p-hat before history)"
    )
    parser.add_argument("--rl-steps", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per RL step")
    parser.add_argument("--samples", type=int, default=8, help="rollouts per prompt (total budget = prompts x samples)")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--minibatches", type=int, default=2, help="updates per RL step")
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=3, help="rollouts, difficulty and evaluation")
    parser.add_argument("--sec-tau", type=float, default=0.4)
    parser.add_argument("--sec-alpha", type=float, default=0.5)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.7, help="held-out accuracy whose first step is compared")
    parser.add_argument("--verbose", action="store_true", help="per-category accuracy at every evaluation")
    return parser.parse_args()


def correct(text: str, answer: str) -> bool:
    """The arithmetic verifier's verdict: the whole completion is a plain number equal to the answer."""
    got = parse_number(text)
    return got is not None and got == Fraction(answer)


def evaluate(policy, problems: list[dict], max_new_tokens: int) -> tuple[float, dict[str, float]]:
    texts = greedy(policy, [p["prompt"] for p in problems], max_new_tokens=max_new_tokens)
    by_category: dict[str, list[bool]] = defaultdict(list)
    for text, p in zip(texts, problems):
        by_category[p["category"]].append(correct(text, p["answer"]))
    total = sum(sum(v) for v in by_category.values()) / len(problems)
    return total, {c: sum(v) / len(v) for c, v in sorted(by_category.items())}


def make_problems(args: argparse.Namespace, split_seed: int) -> list[dict]:
    spec = SkillsSpec(categories=args.categories.split(","), per_category=args.per_category, digits=args.digits)
    rows = generate(spec, split_seed)
    labels = assign_splits(len(rows), args.test_fraction, args.warmup_fraction, split_seed)
    return [{**row, "split": label, "problem_id": f"p{row['source_index']:05d}"} for row, label in zip(rows, labels)]


def run(args: argparse.Namespace, method: str, seed: int, split_seed: int) -> dict:
    problems = make_problems(args, split_seed)
    test = [p for p in problems if p["split"] == "test"]
    warm_categories = set(args.warmup_categories.split(",")) if args.warmup_categories else None
    warmup = [
        p for p in problems if p["split"] == "warmup" and (warm_categories is None or p["category"] in warm_categories)
    ]
    pool_problems = [p for p in problems if p["split"] in ("train", "warmup")]
    by_id = {p["problem_id"]: p for p in pool_problems}

    started = time.perf_counter()
    policy = init_policy(PolicyConfig(threads=1), seed=seed)
    acc_init, _ = evaluate(policy, test, args.max_new_tokens)
    if args.warmup_steps:
        sft_warmstart(
            policy,
            make_optimizer(policy, lr=args.warmup_lr, weight_decay=0.0),
            [(p["prompt"], p["answer"]) for p in warmup],
            steps=args.warmup_steps,
            batch_size=args.warmup_batch,
            seed=seed,
        )
    acc_warm, cat_warm = evaluate(policy, test, args.max_new_tokens)

    # Difficulty: k samples per pool problem at temperature 1 (the difficulty stage's defaults).
    pool_sorted = sorted(pool_problems, key=lambda p: p["problem_id"])
    difficulty_samples = sample(
        policy,
        [p["prompt"] for p in pool_sorted],
        [args.difficulty_k] * len(pool_sorted),
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=seed * 7919 + 1,
    )
    passes = defaultdict(int)
    for s in difficulty_samples:
        passes[pool_sorted[s.prompt_index]["problem_id"]] += correct(s.text, pool_sorted[s.prompt_index]["answer"])
    p_difficulty = {p["problem_id"]: passes[p["problem_id"]] / args.difficulty_k for p in pool_sorted}
    setup_seconds = time.perf_counter() - started

    pool = [
        PoolProblem(
            p["problem_id"],
            arm=p["category"],
            domain="arithmetic",
            category=p["category"],
            p_hat=p_difficulty[p["problem_id"]],
        )
        for p in pool_sorted
    ]
    selector_name, _, allocator_name = method.partition("+")
    if selector_name == "knapsack":
        selector_name, allocator_name = "uniform", "knapsack"
    strategy = (
        SecStrategy(SecConfig(batch_size=args.prompts, tau=args.sec_tau, alpha=args.sec_alpha))
        if selector_name == "sec"
        else UniformStrategy(UniformConfig(batch_size=args.prompts))
    )
    allocator = (
        KnapsackAllocator(KnapsackConfig(n=args.samples))
        if allocator_name == "knapsack"
        else UniformBudget(UniformBudgetConfig(n=args.samples))
    )
    history: dict[str, deque] = defaultdict(lambda: deque(maxlen=16))

    cfg = GRPOConfig(lr=args.lr, clip_low=args.clip, clip_high=args.clip, minibatches=args.minibatches)
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(seed * 1_000_003 + split_seed)
    curve = []
    rewards_window, ratios_window, ratios_all = [], [], []
    arm_pulls: dict[str, int] = defaultdict(int)
    rl_seconds = rl_cpu_seconds = 0.0
    for step in range(1, args.rl_steps + 1):
        tick, cpu_tick = time.perf_counter(), time.process_time()
        picks = strategy.select(pool, args.prompts, rng)
        estimates = []
        for pick in picks:
            outcomes = history[pick.problem_id]
            if len(outcomes) >= 8:
                estimates.append(Estimate(sum(outcomes) / len(outcomes), count=len(outcomes), source="buffer"))
            else:
                estimates.append(Estimate(p_difficulty[pick.problem_id], count=args.difficulty_k, source="difficulty"))
        allocations = allocator.allocate(picks, estimates, total_budget=args.prompts * args.samples)
        chosen = [by_id[pick.problem_id] for pick in picks]
        prompts = [p["prompt"] for p in chosen]
        samples = sample(
            policy,
            prompts,
            [a.n for a in allocations],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            seed=seed * 1_000_000 + step,
        )
        rewards = [1.0 if correct(s.text, chosen[s.prompt_index]["answer"]) else 0.0 for s in samples]
        stats = grpo_step(policy, optimizer, RolloutBatch(prompts=prompts, samples=samples, rewards=rewards), cfg)
        group_index = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
        advantages = group_advantages(torch.tensor(rewards), group_index).tolist()
        outcomes = []
        for slot, pick in enumerate(picks):
            rows = [k for k, s in enumerate(samples) if s.prompt_index == slot]
            slot_rewards = tuple(rewards[k] for k in rows)
            history[pick.problem_id].extend(slot_rewards)
            arm_pulls[pick.arm] += 1
            outcomes.append(
                ProblemOutcome(slot, pick.problem_id, pick.arm, slot_rewards, tuple(advantages[k] for k in rows))
            )
        strategy.observe(StepFeedback(step, pool, outcomes))
        rl_seconds += time.perf_counter() - tick
        rl_cpu_seconds += time.process_time() - cpu_tick
        rewards_window.append(stats["mean_reward"])
        ratios_window.append(stats["effective_ratio"])
        ratios_all.append(stats["effective_ratio"])
        if step % args.eval_every == 0 or step == args.rl_steps:
            acc, cats = evaluate(policy, test, args.max_new_tokens)
            curve.append(acc)
            if args.verbose:
                print(
                    f"    step {step:4d} acc {acc:.2f} reward {statistics.mean(rewards_window):.2f} "
                    f"eff {statistics.mean(ratios_window):.2f} " + " ".join(f"{c}={v:.2f}" for c, v in cats.items()),
                    flush=True,
                )
            rewards_window, ratios_window = [], []
    acc_final, cat_final = evaluate(policy, test, args.max_new_tokens)
    if args.verbose:
        total_pulls = sum(arm_pulls.values())
        print(
            "    share of picks per category: "
            + " ".join(f"{arm}={n / total_pulls:.2f}" for arm, n in sorted(arm_pulls.items())),
            flush=True,
        )
    return {
        "method": method,
        "seed": seed,
        "split": split_seed,
        "init": acc_init,
        "warm": acc_warm,
        "final": acc_final,
        "cat_warm": cat_warm,
        "cat_final": cat_final,
        "curve": curve,
        "ratio": statistics.mean(ratios_all),
        "setup_s": setup_seconds,
        "rl_s": rl_seconds,
        "rl_cpu_s": rl_cpu_seconds,
        "n_test": len(test),
        "pulls": dict(arm_pulls),
        "pipeline_s": PIPELINE_STARTUP_S + rl_cpu_seconds + args.rl_steps * PIPELINE_STEP_OVERHEAD_S,
    }


def passes_requirement(result: dict) -> bool:
    """The demo's bar (issue 7): held-out accuracy ends at least 0.6 and at least double the warm start's."""
    return result["final"] >= 0.6 and result["final"] >= 2 * result["warm"]


def steps_to(result: dict, target: float, every: int) -> int | None:
    """First evaluated RL step whose held-out accuracy reaches `target` (None if none did)."""
    return next(((i + 1) * every for i, acc in enumerate(result["curve"]) if acc >= target), None)


def main() -> None:
    args = parse_args()
    seeds, splits = parse_seeds(args.seeds), parse_seeds(args.splits)
    print(
        f"categories={args.categories} per_category={args.per_category} digits={args.digits} "
        f"test={args.test_fraction} warmup={args.warmup_fraction} "
        f"warm start={args.warmup_steps}x{args.warmup_batch}@{args.warmup_lr} on {args.warmup_categories or 'all'} "
        f"rl={args.rl_steps}x{args.prompts}x{args.samples} T={args.temperature} lr={args.lr} "
        f"updates={args.minibatches} tokens={args.max_new_tokens}",
        flush=True,
    )
    torch.set_num_threads(1)
    by_method: dict[str, list[dict]] = {}
    for method in args.methods.split(","):
        results = by_method[method] = []
        print(
            f"\n{method}: held-out greedy accuracy (test split) after warm start and after RL; ratio = mean share "
            f"of groups with reward variance; rl_s / rl_cpu = plain-loop RL wall / CPU seconds (one thread: CPU seconds are what an idle core takes); pipe_s = estimated `rlvr run` seconds on an idle machine (45 s start-up + RL CPU + 0.1 s a step)"
        )
        print(
            f"{'split':>5} {'seed':>4} {'warm':>5} {'final':>5} {'ratio':>5} {'rl_s':>6} {'rl_cpu':>6} {'pipe_s':>6}  "
            f"curve every {args.eval_every} steps / per category final (after warm start)",
            flush=True,
        )
        for split_seed in splits:
            for seed in seeds:
                r = run(args, method, seed, split_seed)
                results.append(r)
                cats = " ".join(f"{c}={r['cat_final'][c]:.2f}({r['cat_warm'][c]:.2f})" for c in r["cat_final"])
                mark = "" if passes_requirement(r) else "  FAIL"
                print(
                    f"{split_seed:>5} {seed:>4} {r['warm']:5.2f} {r['final']:5.2f} {r['ratio']:5.2f} {r['rl_s']:6.1f} {r['rl_cpu_s']:6.1f} "
                    f"{r['pipeline_s']:6.0f}  [{' '.join(f'{a:.2f}' for a in r['curve'])}] {cats}{mark}",
                    flush=True,
                )

    print(
        f"\nsummary over {len(seeds)} seeds x {len(splits)} splits ({args.prompts * args.samples} rollouts a step for "
        f"every method); steps to {args.target:.2f} = first evaluation at or above it, mean over the runs that got there"
    )
    print(
        f"{'method':>14} {'mean final':>10} {'min final':>9} {'pass':>5} {'ratio':>6} {'vs uniform':>10} "
        f"{'steps to target':>15} {'reached':>7}"
    )
    baseline = by_method.get("uniform")
    for method, results in by_method.items():
        ratio = statistics.mean(r["ratio"] for r in results)
        reached = [s for s in (steps_to(r, args.target, args.eval_every) for r in results) if s is not None]
        relative = f"{ratio / statistics.mean(r['ratio'] for r in baseline):10.2f}" if baseline else f"{'':>10}"
        print(
            f"{method:>14} {statistics.mean(r['final'] for r in results):10.3f} {min(r['final'] for r in results):9.2f} "
            f"{sum(map(passes_requirement, results)):>2}/{len(results):<2} {ratio:6.3f} {relative} "
            f"{statistics.mean(reached) if reached else float('nan'):15.0f} {len(reached):>3}/{len(results):<3}"
        )
    everything = [r for results in by_method.values() for r in results]
    worst = min(everything, key=lambda r: (passes_requirement(r), r["final"] - max(0.6, 2 * r["warm"])))
    print(
        f"worst seed: {worst['method']} split {worst['split']} seed {worst['seed']}: {worst['warm']:.2f} -> "
        f"{worst['final']:.2f} ({'passes' if passes_requirement(worst) else 'FAILS'} final >= 0.6 and >= 2x warm start; "
        f"{sum(map(passes_requirement, everything))}/{len(everything)} runs pass)",
        flush=True,
    )


if __name__ == "__main__":
    main()
