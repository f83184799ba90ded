"""Multi-turn rollouts with a calculator tool: our batched loop (trainer/episodes.py) against TRL's
GRPOTrainer(tools=...) rollout generation and a one-conversation-at-a-time loop, in one command, on the CPU: the
sides alternate, `--rounds` times each, every run in a fresh process (`worker`), the load average printed.

    python benchmarks/multi_turn.py [--model smollm2|tiny] [--prompts 8] [--samples 4] [--rounds 2] [--threads 1]
        [--max-turns 3] [--max-new-tokens 48] [--max-tokens 256] [--no-trl]

The task: products of a 3-digit and a 2-digit number, the `calculator` environment (environments/calculator.py)
with its tool taught in the system message (SmolLM2's chat template renders no tools), and two worked examples
before the question (a call, its `<tool_response>`, the answer) so that the untrained 135M model writes calls at
all. The same opening messages, hence the same prompt ids (checked), go to every side.

What is timed, per side and round, wall clock around one call:
- ours: `run_episodes` over every prompt x sample: environments made and reset, every running episode's turn
  decoded in one batch, the calculator's calls run by the environment's tool runner, replies appended as ids.
- TRL (pinned TRL_VERSION, `--no-deps` into benchmarks/out/trl-side, on this venv's torch and transformers):
  `GRPOTrainer._generate(prompts)`, the rollout half of a step (the prompts rendered, one `model.generate`
  batch a turn, tool calls parsed with `parse_response`, the tool run, its message appended as ids), without
  reward scoring, log-probs or the update. The trainer is built once outside the clock, on a copy of the same
  weights; the per-rollout tool tables `_generate_and_score_completions` would set are set before the call.
- sequential: `run_episodes` once per conversation (one task, one sample), so nothing is batched.

Budgets, matched: at most `--max-turns` assistant turns (TRL: max_tool_calling_iterations = turns - 1),
`--max-new-tokens` sampled a turn (TRL: generation_kwargs max_new_tokens), `--max-tokens` after the prompt,
tool tokens included (TRL: max_completion_length). Sampling: temperature and top-p the same, top-k off.
The draws differ between sides (our row-seeded sampler against torch's global generator), so trajectories
differ in length; tokens/s is printed beside trajectories/s for that reason.

The tiny built-in model has no chat template, which TRL's tool loop needs, so `--model tiny` (the quick smoke
mode) compares ours with the sequential loop only; it writes no tool calls.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers

from rlvr.environments.base import Environment
from rlvr.environments.registry import environment_factory
from rlvr.environments.tools import CALCULATOR, ToolLimits
from rlvr.trainer.episodes import Budgets, Trajectory, run_episodes
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy

ROOT = Path(__file__).resolve().parent.parent
TRL_SIDE = ROOT / "benchmarks" / "out" / "trl-side"
TRL_VERSION = "1.16.0"
MODELS = {"smollm2": "smollm2-135m-instruct", "tiny": "tiny"}
SEED = 17
TARGET_RATIO = 1.0

# Two worked examples put before each question: the untrained model copies their call format.
EXAMPLES = [(481, 26), (217, 34)]


def _call_text(a: int, b: int) -> str:
    return json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})


def _response(output: str) -> str:
    """A calculator result as the environment's tool message carries it (`tool_format` "prompt")."""
    return f"<tool_response>\n{output}\n</tool_response>"


def problems(count: int, seed: int) -> list[dict[str, str]]:
    """`count` tasks: a 3-digit by 2-digit product asked after the worked examples, and its reference."""
    rng = random.Random(seed)
    shots: list[dict[str, str]] = []
    for a, b in EXAMPLES:
        shots += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>{_call_text(a, b)}</tool_call>"},
            {"role": "tool", "content": _response(str(a * b))},
            {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
        ]
    tasks = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        messages = [*shots, {"role": "user", "content": f"What is {a} * {b}?"}]
        tasks.append({"prompt": json.dumps(messages), "reference": str(a * b)})
    return tasks


@dataclass
class Figures:
    """One timed run of one side."""

    seconds: float
    trajectories: int
    sampled_tokens: int  # the model's own tokens (loss mask 1)
    trajectory_tokens: int  # every token after the prompt, tool tokens included
    tool_calls: int
    turns: int  # assistant turns

    def line(self, name: str) -> str:
        return (
            f"{name:<14}{self.seconds:>9.2f}{self.trajectories / self.seconds:>10.3f}"
            f"{self.sampled_tokens / self.seconds:>11.1f}{self.trajectory_tokens / self.seconds:>11.1f}"
            f"{self.tool_calls:>7}{self.turns / self.trajectories:>8.2f}"
            f"{self.sampled_tokens / self.trajectories:>9.1f}"
        )


def _our_figures(seconds: float, trajectories: list[Trajectory]) -> Figures:
    return Figures(
        seconds,
        len(trajectories),
        sum(sum(t.loss_mask) for t in trajectories),
        sum(len(t.completion_ids) for t in trajectories),
        sum(len(turn.tool_uses) for t in trajectories for turn in t.turns),
        sum(turn.role == "assistant" for t in trajectories for turn in t.turns),
    )


@dataclass
class Setup:
    """What every side shares."""

    policy: Policy
    factory: Callable[[], Environment]
    tasks: list[dict[str, str]]
    samples: int
    budgets: Budgets
    temperature: float
    top_p: float


def run_ours(setup: Setup, seed: int) -> tuple[Figures, list[Trajectory]]:
    """Every prompt x sample through one `run_episodes` call (batched turns)."""
    n = len(setup.tasks)
    started = time.perf_counter()
    trajectories = run_episodes(
        setup.policy,
        [setup.factory] * n,
        setup.tasks,
        [setup.samples] * n,
        budgets=setup.budgets,
        temperature=setup.temperature,
        top_p=setup.top_p,
        seed=seed,
        row_keys=list(range(n)),
    )
    return _our_figures(time.perf_counter() - started, trajectories), trajectories


def run_sequential(setup: Setup, seed: int) -> Figures:
    """One `run_episodes` call per conversation: no two conversations share a batch."""
    trajectories: list[Trajectory] = []
    started = time.perf_counter()
    for i, task in enumerate(setup.tasks):
        for j in range(setup.samples):
            trajectories += run_episodes(
                setup.policy,
                [setup.factory],
                [task],
                [1],
                budgets=setup.budgets,
                temperature=setup.temperature,
                top_p=setup.top_p,
                seed=seed,
                row_keys=[i * setup.samples + j],
            )
    return _our_figures(time.perf_counter() - started, trajectories)


# --- TRL --------------------------------------------------------------------------------------------------------


def import_trl(install: bool) -> tuple[Any | None, str]:
    """TRL, from this venv or from TRL_SIDE (installed there with --no-deps on first use); None and why not."""
    try:
        import trl
    except ImportError:
        if not (TRL_SIDE / "trl").is_dir():
            if not install:
                return None, f"trl is not importable and {TRL_SIDE} does not exist"
            print(f"installing trl=={TRL_VERSION} --no-deps into {TRL_SIDE}", flush=True)
            pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TRL_SIDE)]
            subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
        sys.path.append(str(TRL_SIDE))  # appended: the side folder holds trl alone and shadows nothing
        trl = importlib.import_module("trl")
    if trl.__version__ != TRL_VERSION:
        return None, f"trl {trl.__version__} is importable, the benchmark pins {TRL_VERSION}"
    return trl, ""


_CONTENT_END = "message['content'] + '<|im_end|>'"
_CALLS_END = (
    "message['content'] }}{% for call in message.tool_calls or [] %}{{ '<tool_call>' + (call.function | tojson) + "
    "'</tool_call>' }}{% endfor %}{{ '<|im_end|>'"
)


def with_tool_calls(template: str) -> str:
    """SmolLM2's ChatML template with assistant `tool_calls` rendered as `<tool_call>` JSON (the format the system
    message teaches). TRL refuses a template that drops tool calls; messages without them render as before, so
    the openings keep their ids (checked in `main`)."""
    if template.count(_CONTENT_END) != 1:
        raise ValueError("not SmolLM2's ChatML template: cannot add a tool_calls branch to it")
    return template.replace(_CONTENT_END, _CALLS_END)


class TrlSide:
    """TRL's GRPOTrainer with the calculator as a tool, built once; `run` times its rollout generation."""

    def __init__(self, setup: Setup, openings: list[list[dict[str, str]]], out: Path) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
        from trl.chat_template_utils import qwen3_template

        self.calls = 0
        limits = ToolLimits()

        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.

            Args:
                expression: the expression, e.g. "123*45"
            """
            self.calls += 1
            return _response(CALCULATOR.run(expression, limits).output)

        self.tool = calculator
        tokenizer = copy.deepcopy(setup.policy.tokenizer)
        tokenizer.chat_template = with_tool_calls(tokenizer.chat_template)
        # SmolLM2 writes ChatML, the format of TRL's Qwen3 response template; TRL recognises only known
        # templates by their text, so it is set here (the trainer keeps a template that is already set).
        tokenizer.response_template = qwen3_template
        n = len(openings) * setup.samples
        config = GRPOConfig(
            output_dir=str(out),
            per_device_train_batch_size=n,
            num_generations=setup.samples,
            max_completion_length=setup.budgets.max_tokens,
            max_tool_calling_iterations=setup.budgets.max_turns - 1,
            generation_kwargs={"max_new_tokens": setup.budgets.max_new_tokens},
            temperature=setup.temperature,
            top_p=setup.top_p,
            top_k=0,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            seed=SEED,
        )
        self.trainer = GRPOTrainer(
            model=copy.deepcopy(setup.policy.model),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_list([{"prompt": o} for o in openings]),
            processing_class=tokenizer,
            tools=[calculator],
        )
        self.prompts = [o for o in openings for _ in range(setup.samples)]

    def prompt_ids(self, opening: list[dict[str, str]]) -> list[int]:
        ids, _, _ = self.trainer._tokenize_prompts([opening])
        return list(ids[0])

    def run(self, prompts: list[list[dict[str, str]]] | None = None) -> Figures:
        prompts = self.prompts if prompts is None else prompts
        trainer = self.trainer
        # What `_generate_and_score_completions` sets before generating: each rollout's tool table.
        trainer._sync_tool_dicts = [{self.tool.__name__: self.tool} for _ in prompts]
        trainer._async_tool_dicts = [{} for _ in prompts]
        self.calls = 0
        started = time.perf_counter()
        _, completion_ids, tool_mask, completions, *_ = trainer._generate(prompts)
        seconds = time.perf_counter() - started
        return Figures(
            seconds,
            len(prompts),
            sum(sum(mask) for mask in tool_mask),
            sum(len(ids) for ids in completion_ids),
            self.calls,
            sum(message["role"] == "assistant" for row in completions for message in row),
        )


# --- the run ----------------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    return f"{platform.node()}, {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}"


def commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="smollm2 needs `make smollm2`")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="each side runs once a round, sides alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every side")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--no-trl", action="store_true", help="skip TRL (ours vs sequential only)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time loop")
    parser.add_argument("--worker", choices=["ours", "TRL", "sequential"], help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def _setup(args: argparse.Namespace) -> Setup:
    policy = init_policy(PolicyConfig(model=MODELS[args.model], threads=args.threads), seed=SEED)
    return Setup(
        policy,
        environment_factory({"type": "calculator", "max_turns": args.max_turns, "max_tokens": args.max_tokens}),
        problems(args.prompts, SEED),
        args.samples,
        Budgets(args.max_turns, args.max_tokens, args.max_new_tokens, 64),
        args.temperature,
        args.top_p,
    )


def worker(args: argparse.Namespace) -> None:
    """One side's timed run in this (fresh) process, after an untimed one-conversation warm-up; its figures
    as JSON in `args.result`. Each run has a process of its own so that no side inherits another's state (a
    first version, all in one process at 2 threads on a busy machine, timed our loop 5x slower after TRL's
    trainer was built; 2 threads on 2 oversubscribed cores may explain it as well, not settled)."""
    setup = _setup(args)
    seed = SEED + args.round
    warm = Setup(**{**vars(setup), "tasks": setup.tasks[:1], "samples": 1})
    extra: dict[str, Any] = {}
    if args.worker == "TRL":
        if import_trl(install=False)[0] is None:
            raise SystemExit("trl is not importable")
        openings = [list(setup.factory().reset(task, 0).messages) for task in setup.tasks]
        with tempfile.TemporaryDirectory(prefix="multi-turn-bench-") as tmp:
            peer = TrlSide(setup, openings, Path(tmp))
            ours_ids = run_ours(warm, 0)[1][0].prompt_ids  # what our loop reads for the same opening
            extra["same_prompt_ids"] = peer.prompt_ids(openings[0]) == ours_ids
            extra["prompt_tokens"] = len(ours_ids)
            peer.run(peer.prompts[:1])
            figures = peer.run()
    elif args.worker == "ours":
        run_ours(warm, 0)
        figures = run_ours(setup, seed)[0]
    else:
        run_ours(warm, 0)
        figures = run_sequential(setup, seed)
    args.result.write_text(json.dumps({**vars(figures), **extra}))


def main() -> None:
    args = _arguments()
    if args.worker:
        worker(args)
        return
    print(f"date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; commit {commit()}; machine {machine()}")
    print(f"load average before: {load()}")
    trl, why_not = (None, "--no-trl") if args.no_trl else (None, "")
    if not args.no_trl and args.model == "tiny":
        why_not = "the tiny model has no chat template, which TRL's tool loop needs"
    elif not args.no_trl:
        trl, why_not = import_trl(install=True)
    versions = f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    versions += f", trl {trl.__version__}" if trl is not None else f"; TRL not run: {why_not}"
    print(versions)
    print(
        f"model {MODELS[args.model]}; {args.prompts} prompts x {args.samples} samples; max_turns {args.max_turns}, "
        f"max_new_tokens {args.max_new_tokens} a turn, max_tokens {args.max_tokens}; temperature "
        f"{args.temperature}, top_p {args.top_p}; torch threads {args.threads}; each run in a fresh process"
    )
    sides: dict[str, list[Figures]] = {"ours": []}
    if trl is not None:
        sides["TRL"] = []
    if not args.no_sequential:
        sides["sequential"] = []
    passed = [a for a in sys.argv[1:] if a not in ("--no-trl", "--no-sequential")]
    with tempfile.TemporaryDirectory(prefix="multi-turn-bench-") as tmp:
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                result = Path(tmp) / f"{name}-{r}.json"
                command = [
                    sys.executable,
                    __file__,
                    *passed,
                    "--worker",
                    name,
                    "--round",
                    str(r),
                    "--result",
                    str(result),
                ]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                found = json.loads(result.read_text())
                if "same_prompt_ids" in found:
                    same, tokens = found.pop("same_prompt_ids"), found.pop("prompt_tokens")
                    if not same:
                        raise SystemExit("TRL read other prompt ids than ours; the comparison would be void")
                    print(f"prompt ids identical on both sides ({tokens} tokens)")
                figures = Figures(**found)
                sides[name].append(figures)
                print(f"round {r + 1} {name}: {figures.seconds:.2f} s (load {load()})", flush=True)

    print(f"load average after: {load()}")
    print(
        f"{'side':<14}{'seconds':>9}{'traj/s':>10}{'sampled/s':>11}{'traj tok/s':>11}{'calls':>7}"
        f"{'turns':>8}{'sampled':>9}"
    )
    for name, runs in sides.items():
        for r, figures in enumerate(runs):
            print(figures.line(f"{name} r{r + 1}"))
    print("(traj/s: trajectories a second; sampled/s: model tokens a second; traj tok/s: with tool tokens;")
    print(" calls: tool calls run; turns: assistant turns a trajectory; sampled: model tokens a trajectory)")

    def mean_rates(name: str) -> tuple[float, float]:
        runs = sides[name]
        seconds = sum(f.seconds for f in runs)
        return sum(f.trajectories for f in runs) / seconds, sum(f.sampled_tokens for f in runs) / seconds

    ours_traj, ours_tok = mean_rates("ours")
    for peer_name in [name for name in sides if name != "ours"]:
        peer_traj, peer_tok = mean_rates(peer_name)
        print(
            f"ratio ours / {peer_name} (all rounds pooled): trajectories/s {ours_traj / peer_traj:.2f}x, "
            f"sampled tokens/s {ours_tok / peer_tok:.2f}x"
        )
    headline = "TRL" if "TRL" in sides else "sequential" if "sequential" in sides else None
    if headline is not None:
        ratio = ours_traj / mean_rates(headline)[0]
        print(f"ratio vs {headline}: {ratio:.2f}x trajectories/s (aim >= {TARGET_RATIO:.1f}x)")


if __name__ == "__main__":
    main()
