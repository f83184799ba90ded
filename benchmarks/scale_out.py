"""What sharding buys per rank: SmolLM2-135M-Instruct trained with GRPO on the CPU by a rank group
(`train.data_parallel` = N, trainer/ranks/) at N = 1, 2 and 4, with `train.sharding` replicate (whole
copies, FSDP2 over a ranks x 1 mesh) and fsdp (parameters, gradients and AdamW state split over the ranks, each
decoder layer one unit). N = 1 is one process without a group (`grpo_step` and `generation.sample` directly),
the baseline of both.

Each configuration runs in a fresh process of this script (so that rank 0's peak RSS is its own), which starts
the group's N - 1 worker ranks (1 thread each, as rank 0), adopts the policy, and runs --steps real RL steps:
rollouts sampled by every rank from the current weights (`group.sample`, row-seeded), --prompts chat prompts
("What is 7 + 6? Answer with just the number.", two digits) x --samples of --tokens new tokens at temperature
1; rewards from an exact check (one of the completion's integers is the sum); one GRPO update (`group.update`,
AdamW, lr 1e-6, one minibatch) on the groups with signal. It prints, per rank:

- parameters, gradients, optimizer: bytes held on that rank, counted (`sharding.held_bytes`, a DTensor counted
  by its local shard). Gradients are freed at the end of every step (zero_grad(set_to_none)), so the figure is
  the gradients held *during* the step: the rank's trainable parameter shards (a gradient is the size of its
  parameter shard), checked on rank 0 against the gradients counted just before its optimizer step.
  state = the sum of the three.
- peak RSS: VmHWM of the rank's process (/proc/PID/status) over its whole life, the maximum of its phases'
  peaks (the high-water mark is reset between phases through /proc/PID/clear_refs); the phases' peaks are
  printed below the table (load: imports and the whole policy on rank 0; adopt: the group started and the policy
  sharded; rollout; update).
- step, rollout and update seconds on rank 0's clock: the mean over the steps after the first (the first,
  which warms up, is printed apart). A step is rollout + reward + update.

Then the two targets of issue 38: fsdp's counted state per rank at most 1/N of replicate's plus 5%, and fsdp's
peak RSS per rank at N = 2 at most 0.75x replicate's.

    python benchmarks/scale_out.py [--model smollm2-135m-instruct|tiny] [--ranks 1 2 4]
        [--shardings replicate fsdp] [--steps 3] [--prompts 8] [--samples 4] [--tokens 24] [--grpo KEY=VALUE ...]

`--grpo` sets a GRPOConfig key (lr 1e-6 and one minibatch otherwise, the rest its defaults: on the CPU no fused
LM head and the whole minibatch in one forward), e.g. `--grpo fused_head=true` as a GPU run has it.

`--model tiny` (the built-in tiny model, rewarded by the share of the answer's digits in the completion) runs in
seconds: a smoke run. With more ranks than cores (N = 4 on a 2-core machine) the ranks take turns on the cores:
those times are not speed figures.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from itertools import zip_longest
from pathlib import Path
from typing import Any

RESULT = "SCALE_OUT_RESULT "  # a configuration's process prints its figures on one line after this marker
MB = 1e6


# --- one configuration, in its own process -------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """The process's high-water mark of resident memory, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    """Set the process's high-water mark to its current RSS (Linux: 5 to /proc/PID/clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Peaks:
    """Each rank's peak RSS per phase: `close(phase)` records the high-water marks since the last one and resets
    them. The processes' whole-life peak is the largest of its phases'."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.by_phase: dict[str, list[int]] = {}

    def close(self, phase: str) -> None:
        found = [peak_rss(pid) for pid in self.pids]
        before = self.by_phase.get(phase, [0] * len(found))
        self.by_phase[phase] = [max(a, b) for a, b in zip(before, found)]
        for pid in self.pids:
            reset_peak(pid)

    def whole(self) -> list[int]:
        return [max(column) for column in zip_longest(*self.by_phase.values(), fillvalue=0)]


def questions(count: int, seed: int, chat: bool) -> tuple[list[str], list[int]]:
    """`count` prompts asking for a sum of two digits, and the sums: chat prompts for an instruct model, `a+b=` for
    the tiny model (whose character vocabulary has no letters). SmolLM2-135M answers about a quarter of these
    right at temperature 1, so most groups of 4 carry signal (two-digit sums: 6%, few groups to train)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(count)]
    if not chat:
        return [f"{a}+{b}=" for a, b in pairs], [a + b for a, b in pairs]
    prompts = [f"What is {a} + {b}? Answer with just the number." for a, b in pairs]
    prompts = [json.dumps([{"role": "user", "content": text}]) for text in prompts]
    return prompts, [a + b for a, b in pairs]


def exact(text: str, answer: int) -> float:
    """1.0 when one of the completion's integers is the answer (SmolLM2 often restates the question first)."""
    return float(answer in {int(found) for found in re.findall(r"-?\d+", text)})


def digits_shared(text: str, answer: int) -> float:
    """The share of the answer's digits found in the completion: the tiny model's reward (its random weights never
    answer exactly, and groups of equal rewards would leave nothing to update)."""
    digits = str(answer)
    return sum(digit in text for digit in digits) / len(digits)


def grpo_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--grpo key=value` pairs (values as YAML: true, 512, null) for GRPOConfig."""
    import yaml

    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--grpo takes key=value, got {pair!r}")
        found[key] = yaml.safe_load(value)
    return found


def one_configuration(args: argparse.Namespace, ranks: int, sharding: str) -> dict[str, Any]:
    import torch

    from rlvr.trainer.generation import sample
    from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
    from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer, set_threads
    from rlvr.trainer.sharding import held_bytes

    set_threads(1)
    cfg = GRPOConfig(lr=1e-6, minibatches=1, **grpo_overrides(args.grpo))
    whole = init_policy(PolicyConfig(model=args.model, threads=1, device="cpu"), seed=0)
    peaks = Peaks([os.getpid()])
    peaks.close("load")

    group = None
    if ranks > 1:
        from rlvr.trainer.ranks import launch

        group = launch.rank_group(ranks, sharding, torch.device("cpu"), threads=1)  # type: ignore[arg-type]
        policy, optimizer = group.adopt(whole, None, cfg.lr, cfg.weight_decay)
        del whole  # the run keeps only the group's copy (flows/rl_run.py: share_policy)
        gc.collect()
        peaks.pids += [worker.pid for worker in group.workers]
    else:
        policy, optimizer = whole, make_optimizer(whole, cfg.lr, cfg.weight_decay)
    peaks.close("adopt")

    counted_grads: list[int] = []  # rank 0's gradients, counted just before each optimizer step

    def count_grads(opt: torch.optim.Optimizer, *_: Any) -> None:
        counted_grads.append(held_bytes(policy.model, opt)["gradients"])

    optimizer.register_step_pre_hook(count_grads)

    steps: list[dict[str, float]] = []
    for step in range(args.steps):
        prompts, answers = questions(args.prompts, seed=step, chat=args.model != "tiny")
        counts = [args.samples] * len(prompts)
        settings = {"max_new_tokens": args.tokens, "temperature": 1.0, "top_p": 1.0, "seed": step}
        started = time.perf_counter()
        if group is not None:
            drawn = group.sample(prompts, counts, settings)
        else:
            drawn = sample(policy, prompts, counts, row_keys=list(range(len(prompts))), **settings)  # type: ignore[arg-type]
        sampled = time.perf_counter()
        peaks.close("rollout")
        reward = digits_shared if args.model == "tiny" else exact
        rewards = [reward(s.text, answers[s.prompt_index]) for s in drawn]
        batch = RolloutBatch(prompts=prompts, samples=drawn, rewards=rewards, max_new_tokens=args.tokens)
        rewarded = time.perf_counter()
        stats = group.update(batch, cfg, None) if group is not None else grpo_step(policy, optimizer, batch, cfg)
        updated = time.perf_counter()
        peaks.close("update")
        steps.append(
            {
                "rollout_s": sampled - started,
                "update_s": updated - rewarded,
                "step_s": updated - started,
                "reward_mean": statistics.fmean(rewards),
                "tokens": float(sum(s.n_tokens for s in drawn)),
                "updates": float(stats.get("updates", 0.0)),
                "tokens_sha256": hashlib.sha256(json.dumps([s.completion_ids for s in drawn]).encode()).hexdigest(),
            }
        )

    held = group.held() if group is not None else [held_bytes(policy.model, optimizer)]
    trainable = _trainable_shard_bytes(policy.model)
    if group is not None:
        from rlvr.trainer.ranks import launch

        launch.close_group()
    return {
        "ranks": ranks,
        "sharding": sharding if ranks > 1 else "one process",
        "held": held,
        "rank0_trainable_bytes": trainable,
        "rank0_counted_grads": max(counted_grads, default=0),
        "peaks": peaks.whole(),
        "phases": peaks.by_phase,
        "steps": steps,
    }


def _trainable_shard_bytes(model: Any) -> int:
    from rlvr.trainer.sharding import local

    return sum(local(p).numel() * local(p).element_size() for p in model.parameters() if p.requires_grad)


# --- the driver ----------------------------------------------------------------------------------------------


def run_configuration(args: argparse.Namespace, ranks: int, sharding: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", str(ranks), sharding, "--model", args.model]
    command += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples)]
    command += ["--tokens", str(args.tokens), *(f"--grpo={pair}" for pair in args.grpo)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    found = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not found:
        raise SystemExit(f"ranks={ranks} sharding={sharding} failed (exit {done.returncode})")
    return dict(json.loads(found[-1][len(RESULT) :]))


def state_bytes(held: dict[str, int]) -> int:
    """Parameters + gradients during the step (= the trainable parameter shards, all of them here) + optimizer."""
    return held["parameters"] * 2 + held["optimizer"]


def mean_after_first(steps: list[dict[str, float]], key: str) -> float:
    later = steps[1:] or steps
    return statistics.fmean(s[key] for s in later)


def print_table(results: list[dict[str, Any]], cores: int) -> None:
    print(
        "\n| N | sharding | rank | parameters MB | gradients MB (during step) | optimizer MB | state MB | "
        "peak RSS MB | step s | rollout s | update s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        steps = r["steps"]
        for rank, (held, peak) in enumerate(zip(r["held"], r["peaks"])):
            times = (
                f"{mean_after_first(steps, 'step_s'):.2f} | {mean_after_first(steps, 'rollout_s'):.2f} | "
                f"{mean_after_first(steps, 'update_s'):.2f}"
                if rank == 0
                else " | | "
            )
            print(
                f"| {r['ranks']} | {r['sharding']} | {rank} | {held['parameters'] / MB:.1f} | "
                f"{held['parameters'] / MB:.1f} | {held['optimizer'] / MB:.1f} | {state_bytes(held) / MB:.1f} | "
                f"{peak / MB:.0f} | {times} |"
            )
    print(
        "\nMB = 10^6 bytes. gradients: held during the step only (freed by zero_grad at its end), the size of the "
        "rank's trainable parameter shards; rank 0 counted: "
        + ", ".join(
            f"N={r['ranks']} {r['sharding']} {r['rank0_counted_grads'] / MB:.1f}"
            f" (shards {r['rank0_trainable_bytes'] / MB:.1f})"
            for r in results
        )
    )
    print("times: rank 0's clock, mean over steps 2.. (first step apart below); step = rollout + reward + update.")
    oversubscribed = sorted({r["ranks"] for r in results if r["ranks"] > cores})
    if oversubscribed:
        print(
            f"N = {', '.join(map(str, oversubscribed))} runs more single-threaded ranks than this machine's {cores} "
            "cores: the ranks take turns on the cores, so those times are not speed figures."
        )
    first = results[0]["steps"][0]["tokens_sha256"]
    same = [f"N={r['ranks']} {r['sharding']}" for r in results[1:] if r["steps"][0]["tokens_sha256"] == first]
    differ = [f"N={r['ranks']} {r['sharding']}" for r in results[1:] if r["steps"][0]["tokens_sha256"] != first]
    print(
        f"step 1's sampled tokens (same weights everywhere) equal N={results[0]['ranks']}'s: "
        f"{', '.join(same) or 'none'}" + (f"; differ: {', '.join(differ)}" if differ else "")
    )
    print("\npeak RSS MB by phase, per rank (load: imports + the whole policy on rank 0; adopt: group + sharding):")
    for r in results:
        cells = "; ".join(
            f"{phase} " + "/".join(f"{v / MB:.0f}" for v in values) for phase, values in r["phases"].items()
        )
        first = r["steps"][0]
        print(
            f"  N={r['ranks']} {r['sharding']}: {cells}; first step {first['step_s']:.2f} s "
            f"(rollout {first['rollout_s']:.2f}, update {first['update_s']:.2f}); reward mean per step "
            + ", ".join(f"{s['reward_mean']:.2f}" for s in r["steps"])
            + "; updates per step "
            + ", ".join(f"{s['updates']:.0f}" for s in r["steps"])
        )


def check_targets(results: list[dict[str, Any]]) -> list[str]:
    """Issue 38's two memory targets, one line each per rank count where both shardings ran."""
    by = {(r["ranks"], r["sharding"]): r for r in results}
    lines = []
    for n in sorted({r["ranks"] for r in results if r["ranks"] > 1}):
        fsdp, replicate = by.get((n, "fsdp")), by.get((n, "replicate"))
        if fsdp is None or replicate is None:
            continue
        worst = max(state_bytes(h) for h in fsdp["held"])
        whole = max(state_bytes(h) for h in replicate["held"])
        limit = whole / n * 1.05
        verdict = "holds" if worst <= limit else "MISSED"
        lines.append(
            f"target 1, N={n}: fsdp's counted state per rank at most 1/{n} of replicate's + 5%: largest rank "
            f"{worst / MB:.1f} MB <= {limit / MB:.1f} MB ({worst / whole:.3f}x replicate's {whole / MB:.1f}; "
            f"1/{n} = {1 / n:.3f}): {verdict}"
        )
        if n == 2:
            ratios = [f / p for f, p in zip(fsdp["peaks"], replicate["peaks"])]
            verdict = "holds" if max(ratios) <= 0.75 else "MISSED"
            lines.append(
                "target 2, N=2: fsdp's peak RSS per rank at most 0.75x replicate's: "
                + ", ".join(
                    f"rank {rank} {f / MB:.0f} / {p / MB:.0f} MB = {ratio:.3f}x"
                    for rank, (f, p, ratio) in enumerate(zip(fsdp["peaks"], replicate["peaks"], ratios))
                )
                + f": {verdict}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shardings", nargs="+", default=["replicate", "fsdp"], choices=["replicate", "fsdp"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--grpo", action="append", default=[], metavar="KEY=VALUE", help="a GRPOConfig setting")
    parser.add_argument("--one", nargs=2, metavar=("RANKS", "SHARDING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        result = one_configuration(args, int(args.one[0]), args.one[1])
        print(RESULT + json.dumps(result), flush=True)
        return

    cores = os.cpu_count() or 1
    print(
        f"{args.model}: {args.prompts} prompts x {args.samples} samples of {args.tokens} new tokens, {args.steps} "
        f"steps, AdamW, 1 thread a rank; {cores} cores; load average before {os.getloadavg()[0]:.2f}"
        + (f"; GRPOConfig {' '.join(args.grpo)}" if args.grpo else "; GRPOConfig defaults (the CPU's: no fused head)")
    )
    configurations = [(n, s) for n in args.ranks for s in (args.shardings if n > 1 else ["one process"])]
    results = []
    for n, sharding in configurations:
        started = time.perf_counter()
        results.append(run_configuration(args, n, sharding))
        print(f"  N={n} {sharding}: {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    print_table(results, cores)
    print()
    lines = check_targets(results)
    for line in lines:
        print(line)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if lines:
        print("memory targets: " + ("all hold" if all(line.endswith("holds") for line in lines) else "not all hold"))


if __name__ == "__main__":
    main()
