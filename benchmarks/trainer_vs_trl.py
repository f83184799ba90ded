"""A whole `rlvr run` against TRL's GRPOTrainer on the same tiny model, prompts and GRPO shape, in one run.

Ours: `rlvr run` in a subprocess of this venv, every artifact committed to a temp store, arithmetic `a+b=`
problems (1 digit), no warm start, evaluation and checkpoints only at the end. Peer: TRL's GRPOTrainer
(pinned TRL_VERSION) in its own venv, created on first use under benchmarks/out/.venv-trl (torch 2.13.0
first, then trl, math-verify and this project with --no-deps), on the same tiny Qwen2 + character tokenizer
(built here with `build_tiny_model(seed=0)` and saved, then loaded with `from_pretrained`), the same
problems (read from our run's `problems` view: splits train + warmup), the same reward
(`rlvr.verifiers.adapters.trl_reward_func("arithmetic")`), group size, new tokens and steps, one update per
step (steps_per_generation 1, num_iterations 1), loss "grpo" (our seq-mean-token-mean), constant lr 1e-3,
clip 0.2, no KL, float32, gradient checkpointing off (TRL's default is on), and the same torch threads
(--threads, default 1 as `policy.threads`): on a 2-core machine with other jobs, TRL at torch's default of
2 threads ran ~10x slower (163 vs 1,619 completions/s measured 2026-11-23), so both get the same count.

    python benchmarks/trainer_vs_trl.py [--steps 100] [--prompts 16] [--n 8] [--new-tokens 3] [--set key=value ...]
    python benchmarks/trainer_vs_trl.py --baseline REV [--now REV2] [--rounds 3]    # ours at REV2 (or the working
                                                                                    # tree) against ours at REV

With `--baseline REV` the peer is this project at an earlier commit, not TRL: REV is checked out in a temporary
git worktree, its folders are linked under the `rlvr.*` names its pyproject.toml maps them to, and `rlvr run` is
run from there (PYTHONPATH, same venv) and from the working tree in turn, `--rounds` times each, alternating so
that a change in the machine's load falls on both. It prints each run's steady completions/s and the ratio of
the medians. A change that must not slow a step (issue 51's one rollout path: "within 5%") is checked this way.

Steady completions/s, start-up excluded: both runs take WARMUP_STEPS + steps + 1 steps; the rate is the
completions of steps WARMUP_STEPS+1 .. WARMUP_STEPS+steps over the time from the end of step WARMUP_STEPS
to the end of step WARMUP_STEPS+steps (the last step, which evaluates and checkpoints in ours, is left
out). Ours: a step ends at the latest `finished_at` of its rows in the `stage_runs` view (its last
manifest) and its completions are its rows in the `rollouts` view. TRL: a step ends at the trainer's
`on_step_end` callback and its completions are those its reward function scored. Whole-command wall time
is printed too (ours includes Prefect's server start, synthesis and the difficulty pass; TRL's the imports
and model load).

Memory: the subprocess's process tree (the Prefect server and verifier workers included) is sampled
from /proc every SAMPLE_SECONDS: peak summed PSS (shared pages split between the processes that map them;
the figure the target uses) and peak summed RSS, plus the largest single process's peak RSS (`wait4`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / "benchmarks" / "out" / ".venv-trl"
TRL_VERSION = "1.16.0"
WARMUP_STEPS = 5
SAMPLE_SECONDS = 0.1
TARGET_RATIO = 2.5


# --- the peer's environment --------------------------------------------------------------------------------


def ensure_trl_venv() -> Path:
    """The python of the TRL venv, created and installed on first use (a stamp marks a finished install)."""
    python, stamp = TRL_VENV / "bin" / "python", TRL_VENV / f".installed-trl-{TRL_VERSION}"
    if stamp.exists():
        return python
    print(f"creating {TRL_VENV} (torch 2.13.0, trl {TRL_VERSION}; a few minutes the first time)", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first: a bare torch may pull a CUDA build
    subprocess.run([*pip, f"trl=={TRL_VERSION}", "math-verify"], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)  # for the tiny model's code and the reward
    stamp.touch()
    return python


# --- measuring a subprocess --------------------------------------------------------------------------------


def _tree(root: int) -> list[int]:
    """`root` and its live descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in kB, from /proc/PID/smaps_rollup; (0, 0) once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:] if line.endswith("kB")}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def measured(command: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> dict[str, float]:
    """Run `command` in `cwd` (output to `log`), sampling its process tree's memory; wall seconds and peaks in MB."""
    peaks = {"tree_rss_mb": 0.0, "tree_pss_mb": 0.0}
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_SECONDS):
            rss, pss = map(sum, zip(*(_memory_kb(pid) for pid in _tree(proc.pid))))
            peaks["tree_rss_mb"] = max(peaks["tree_rss_mb"], rss / 1024)
            peaks["tree_pss_mb"] = max(peaks["tree_pss_mb"], pss / 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{command[0]} ... failed ({proc.returncode}); last output:\n{log.read_text()[-3000:]}")
    return {"wall_s": time.monotonic() - started, "max_process_rss_mb": usage.ru_maxrss / 1024, **peaks}


def steady_rate(ends: dict[int, float], completions: dict[int, int], steps: int, warmup: int = WARMUP_STEPS) -> float:
    """Completions/s over steps warmup+1 .. warmup+steps, from each step's end time."""
    first, last = warmup, warmup + steps
    done = sum(completions[s] for s in range(first + 1, last + 1))
    return done / (ends[last] - ends[first])


# --- ours -----------------------------------------------------------------------------------------------------


def rlvr_overrides(args: argparse.Namespace) -> list[str]:
    total = WARMUP_STEPS + args.steps + 1
    return [
        "synthesize.source={type: arithmetic, digits: 1}",
        f"select.batch_size={args.prompts}",
        f"allocate.n={args.n}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "train.grpo.minibatches=1",
        "warmstart.steps=0",
        f"train.steps={total}",
        f"evaluate.every={total}",
        f"checkpoint.every={total}",
        f"flow.steps_per_subflow={total}",
        f"policy.threads={args.threads}",
        *args.overrides,
    ]


def rlvr_command(store: Path, overrides: list[str]) -> list[str]:
    """`rlvr run` into `store` (run id "bench") with each override as a --set, in this interpreter."""
    command = [sys.executable, "-m", "rlvr.flows.cli", "run", "--store", str(store), "--run-id", "bench"]
    for item in overrides:
        command += ["--set", item]
    return command


def prefect_env(tmp: Path) -> dict[str, str]:
    """The environment of an `rlvr run` subprocess: its own Prefect home in `tmp`, quiet, no UI or analytics."""
    return {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    }


def step_ends(store: Any) -> dict[int, float]:
    """Each RL step's end (epoch seconds): the latest `finished_at` of its rows in the `stage_runs` view."""
    from rlvr.storage.views import query

    ends = query(store, "SELECT step, max(finished_at) AS t FROM stage_runs WHERE step > 0 GROUP BY step").to_pylist()
    return {r["step"]: datetime.fromisoformat(r["t"]).timestamp() for r in ends}


def step_completions(store: Any) -> dict[int, int]:
    """Each RL step's completions: its rows in the `rollouts` view."""
    from rlvr.storage.views import query

    counts = query(store, "SELECT step, count(*) AS n FROM rollouts GROUP BY step").to_pylist()
    return {r["step"]: r["n"] for r in counts}


def trained_problems(store: Any, columns: str = "prompt, answer") -> list[dict[str, str]]:
    """The problems a run's steps select from (splits train + warmup), in id order: the peer's dataset."""
    from rlvr.storage.views import query

    sql = f"SELECT {columns} FROM problems WHERE split IN ('train', 'warmup') ORDER BY problem_id"
    return query(store, sql).to_pylist()


def run_rlvr(args: argparse.Namespace, tmp: Path, pythonpath: Path | None = None) -> dict[str, Any]:
    """One whole `rlvr run` (a fresh store and Prefect home in `tmp`); its figures and the problems it trained on.
    With `pythonpath`, the `rlvr` package found there runs (an earlier revision's, `baseline_package`)."""
    env = prefect_env(tmp)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)  # ahead of the venv's editable finder, which sits after the path
    cwd = ROOT if pythonpath is None else tmp  # `-m` puts the working folder first: ROOT holds today's rlvr/
    figures = measured(rlvr_command(tmp / "store", rlvr_overrides(args)), env, tmp / "rlvr.log", cwd)
    from rlvr.storage.store import Store

    store = Store.open(str(tmp / "store"))
    figures["steady_per_s"] = steady_rate(step_ends(store), step_completions(store), args.steps)
    return {**figures, "problems": trained_problems(store)}


# --- ours at an earlier revision ---------------------------------------------------------------------------


def baseline_package(rev: str, tmp: Path) -> Path:
    """A folder to put on PYTHONPATH that imports `rlvr` as revision `rev` had it: a worktree of `rev` with its
    folders linked under the package names its pyproject.toml's package-dir gives them (in `tmp`, made here)."""
    import tomllib

    tmp.mkdir(parents=True)
    worktree = tmp / "worktree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), rev], check=True)
    mapping = tomllib.loads((worktree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = tmp / "package" / "rlvr"
    package.mkdir(parents=True)
    for name in (worktree / "rlvr").iterdir():
        (package / name.name).symlink_to(name)
    for dotted, folder in mapping.items():
        if dotted != "rlvr":
            (package / dotted.removeprefix("rlvr.")).symlink_to(worktree / folder)
    return tmp / "package"


def compare_baseline(args: argparse.Namespace) -> None:
    """Ours at `args.baseline` and ours now, alternately, `args.rounds` times each; the medians' ratio."""
    import statistics

    tmp = Path(tempfile.mkdtemp(prefix="rlvr-vs-baseline-"))
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True, text=True, check=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.now or "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if args.now:
        dirty = ""
    paths = {"baseline": baseline_package(args.baseline, tmp / "old")}
    paths["now"] = baseline_package(args.now, tmp / "new") if args.now else None
    rates: dict[str, list[float]] = {"baseline": [], "now": []}
    try:
        for round_ in range(args.rounds):
            for side in ("baseline", "now") if round_ % 2 == 0 else ("now", "baseline"):
                run_dir = tmp / f"{side}-{round_}"
                run_dir.mkdir()
                figures = run_rlvr(args, run_dir, paths[side])
                rates[side].append(figures["steady_per_s"])
                print(
                    f"round {round_ + 1} {side:8} {figures['steady_per_s']:8.0f} completions/s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    finally:
        for side in ("old", "new"):
            if (tmp / side / "worktree").exists():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / side / "worktree")])
    old, new = statistics.median(rates["baseline"]), statistics.median(rates["now"])
    print(f"{args.prompts} prompts x {args.n} completions, {args.new_tokens} new tokens, {args.steps} steady steps")
    print(f"baseline {revision}: {', '.join(f'{r:.0f}' for r in rates['baseline'])} completions/s, median {old:.0f}")
    print(
        f"now {head}{' (with uncommitted changes)' if dirty else ''}: "
        f"{', '.join(f'{r:.0f}' for r in rates['now'])} completions/s, median {new:.0f}"
    )
    print(f"now/baseline = {new / old:.3f}")


# --- the peer -------------------------------------------------------------------------------------------------


def save_tiny_model(directory: Path) -> None:
    """Our tiny Qwen2 (seed 0, default shape) and character tokenizer, saved for `from_pretrained`."""
    from rlvr.trainer.tiny_model import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

    build_tiny_model(TinyModelConfig(), seed=0).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)


def run_trl(args: argparse.Namespace, tmp: Path, problems: list[dict[str, str]]) -> dict[str, Any]:
    """TRL's GRPOTrainer in its venv (this file with --trl-worker); its figures."""
    save_tiny_model(tmp / "model")
    (tmp / "problems.json").write_text(json.dumps(problems))
    command = [
        str(ensure_trl_venv()),
        str(Path(__file__).resolve()),
        "--trl-worker",
        str(tmp),
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--n={args.n}",
        f"--new-tokens={args.new_tokens}",
        f"--threads={args.threads}",
    ]
    figures = measured(command, trl_env(tmp, args.threads), tmp / "trl.log")
    worker = json.loads((tmp / "trl.json").read_text())
    ends = {int(k): v for k, v in worker["ends"].items()}
    counts = {int(k): v for k, v in worker["completions"].items()}
    return {**figures, "steady_per_s": steady_rate(ends, counts, args.steps), "threads": worker["threads"]}


def trl_env(tmp: Path, threads: int) -> dict[str, str]:
    """The environment of a TRL worker: `threads` OpenMP threads, offline, its own HF home in `tmp`."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def step_clock(ends: dict[int, float]) -> Any:
    """A TrainerCallback that records each step's end (epoch seconds) in `ends`, keyed by step from 1."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends[len(ends) + 1] = datetime.now().timestamp()

    return StepClock()


def counting_reward(score: Any, ends: dict[int, float], scored: dict[int, int], name: str) -> Any:
    """TRL reward function `score` that also counts the completions it scores per step (in `scored`); the step
    is the one running, i.e. the one after the last that `step_clock` saw end."""

    def reward(prompts: list[Any] | None = None, completions: list[Any] | None = None, **columns: Any) -> list[float]:
        step = len(ends) + 1  # called while step `step` runs, before its on_step_end
        scored[step] = scored.get(step, 0) + len(completions or [])
        return score(prompts=prompts, completions=completions, **columns)

    reward.__name__ = name
    return reward


def trl_grpo_settings(output_dir: Path, max_steps: int, n: int, new_tokens: int) -> dict[str, Any]:
    """The GRPOConfig settings both TRL benchmarks share: plain GRPO as ours does it by default (loss "grpo",
    group-scaled rewards, clip 0.2, no KL, one pass over each generation), constant lr 1e-3 without weight
    decay, sampling at temperature 1 without top-p, and no logging, saving or progress bars."""
    return {
        "output_dir": str(output_dir),
        "max_steps": max_steps,
        "num_generations": n,
        "num_iterations": 1,
        "max_completion_length": new_tokens,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "epsilon": 0.2,
        "beta": 0.0,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "temperature": 1.0,
        "top_p": 1.0,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }


def trl_worker(args: argparse.Namespace) -> None:
    """Inside the TRL venv: train with GRPOTrainer and write step end times and completion counts to trl.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.verifiers.adapters import trl_reward_func

    torch.set_num_threads(args.threads)
    tmp = Path(args.trl_worker)
    problems = json.loads((tmp / "problems.json").read_text())
    data = Dataset.from_list([{"prompt": p["prompt"], "reference": p["answer"]} for p in problems])
    ends: dict[int, float] = {}
    scored: dict[int, int] = {}
    reward = counting_reward(trl_reward_func("arithmetic"), ends, scored, "arithmetic")
    config = GRPOConfig(
        **trl_grpo_settings(tmp / "trl-out", WARMUP_STEPS + args.steps + 1, args.n, args.new_tokens),
        per_device_train_batch_size=args.prompts * args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
    )
    model_dir = str(tmp / "model")
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=[reward],
        args=config,
        train_dataset=data,
        callbacks=[step_clock(ends)],
    )
    trainer.train()
    result = {"ends": ends, "completions": scored, "threads": torch.get_num_threads()}
    (tmp / "trl.json").write_text(json.dumps(result))


# --- the report --------------------------------------------------------------------------------------------


def report(args: argparse.Namespace, ours: dict[str, Any], peer: dict[str, Any], load: tuple[float, ...]) -> None:
    print(
        f"{args.prompts} prompts x {args.n} completions, {args.new_tokens} new tokens, one update per step; "
        f"{args.steps} steady steps after {WARMUP_STEPS} warm-up steps (+1 final step not timed)"
    )
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: {os.getloadavg()[0]:.2f}")
    rows = [
        ("steady completions/s", "steady_per_s", ".0f"),
        ("whole command wall s", "wall_s", ".1f"),
        ("peak tree PSS MB", "tree_pss_mb", ".0f"),
        ("peak tree RSS MB", "tree_rss_mb", ".0f"),
        ("largest process peak RSS MB", "max_process_rss_mb", ".0f"),
    ]
    print(f"{'':30}{'rlvr run':>12}{'TRL ' + TRL_VERSION:>12}{'ratio':>8}")
    for label, key, fmt in rows:
        print(f"{label:30}{ours[key]:>12{fmt}}{peer[key]:>12{fmt}}{ours[key] / peer[key]:>8.2f}")
    print(f"torch threads: rlvr policy.threads={args.threads}; TRL torch.set_num_threads({peer['threads']})")
    ratio = ours["steady_per_s"] / peer["steady_per_s"]
    met = ratio >= TARGET_RATIO and ours["tree_pss_mb"] <= peer["tree_pss_mb"]
    print(
        f"rlvr/TRL completions/s = {ratio:.2f}x, memory (tree PSS) {ours['tree_pss_mb'] / peer['tree_pss_mb']:.2f}x; "
        f"target >= {TARGET_RATIO}x TRL's completions/s at equal or lower memory: {'met' if met else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps (after the warm-up steps)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both (rlvr's default: 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra rlvr override key=value")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (stores, logs)")
    parser.add_argument("--baseline", metavar="REV", help="compare with ours at git revision REV, not with TRL")
    parser.add_argument(
        "--now", metavar="REV", help="with --baseline: run REV as the new side (default: the working tree)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each side, alternating")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if args.baseline:
        compare_baseline(args)
        return
    ensure_trl_venv()
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="rlvr-vs-trl-"))
    ours = run_rlvr(args, tmp)
    peer = run_trl(args, tmp, ours.pop("problems"))
    report(args, ours, peer, load)
    if args.keep:
        print(f"stores and logs in {tmp}")


if __name__ == "__main__":
    main()
