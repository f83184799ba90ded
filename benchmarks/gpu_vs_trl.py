"""A whole `rlvr run` against TRL's GRPOTrainer on one GPU: a Qwen2.5-0.5B-shaped model, 64 prompts x 8 samples,
256 new tokens, bf16 autocast, gradient checkpointing and micro-batches of 32 rows on both sides.

On a lent GPU machine (no package registry there; /work/shared/gpu/README.md). Here, from the project's root,
with everything committed (the bundle carries HEAD as the installed project; the script runs from the checkout):

    echo /gpu/ >> .git/info/exclude          # once: the bundle travels as an ignored folder
    ../shared/gpu/bundle.sh . gpu --with-trl   # --with-trl adds trl==1.16.0 and datasets (TRL_VERSION below)

There, from the checkout's root, with the `gpu` folder carried along (not yet run on a GPU: expect a few minutes,
and up to ~20 GB of /tmp for the model, the store's checkpoints and its newest train state; `--steps 2` shortens it):

    s=$(bash gpu/setup-on-device.sh) && eval "$s" || exit 1
    python3 benchmarks/gpu_vs_trl.py --device cuda 2>&1 | tee "$OUT/gpu_vs_trl.txt"

TRL then runs in the same interpreter as ours (the bundle installs it beside the project). Elsewhere it runs
in benchmarks/out/.venv-trl, created on first use as `trainer_vs_trl.py` does. The smoke mode, which the test
suite runs (tests/test_gpu_vs_trl_smoke.py), takes the built-in tiny model and a few prompts on the CPU:

    python benchmarks/gpu_vs_trl.py --model tiny --device cpu [--no-trl]
    python benchmarks/gpu_vs_trl.py [--model 0.5b|tiny] [--device cuda|cuda:N|cpu] [--prompts 64] [--n 8]
        [--new-tokens 256] [--prompt-tokens 64] [--micro-batch 32] [--warmup 1] [--steps 3] [--threads 1]
        [--no-trl] [--keep] [--set key=value ...]

Model "0.5b": `gpu_throughput.qwen_05b` (Qwen2.5-0.5B's shape: vocab 151,936, hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, tied embeddings) with random float32 weights, saved with a tokenizer as a Hugging
Face directory that both sides load with `from_pretrained`; nothing is downloaded. Model "tiny": the built-in tiny
model (`build_tiny_model`, seed 0) with its embeddings resized to TINY_VOCAB. The tokenizer is the built-in
character tokenizer with its vocabulary filled up to the model's with letter strings ("a".."z", "aa", ...), and
no `<s>` prepended (TRL tokenizes prompts without special tokens), so a prompt of --prompt-tokens digit and
operator characters is exactly that many tokens on both sides, and every sampled id decodes to text.

Why letters: a verifier that scores a random model's text 0/1 scores every sample 0, so every group's advantages
are 0; our trainer leaves such groups out of the update while TRL still runs them through forward and backward
at zero loss, and the two would not do the same work. The reward here, `LetterShare` (this module, loaded by
import path through `rlvr.verifiers.registry` on our side and through `trl_reward_func` on TRL's), is the share
of a response's letters that are among the reference's (a-m): random letter strings score about 0.5, each a
little differently, so every group trains on both sides (ours prints the share of groups it trained).

Settings, both sides: one GRPO update per step (ours: `train.grpo.minibatches=1`; TRL: a generation batch of
prompts x n rows per optimizer step, `steps_per_generation` = `gradient_accumulation_steps` = rows / micro-batch),
lr 1e-6 constant, clip 0.2, no KL, sampling at temperature 1 with no top-p or top-k (`rollout.temperature`,
`rollout.top_p`; ours has no top-k; TRL `top_k=0`), float32 weights with bf16 autocast for training
(`train.grpo.autocast=bf16`; TRL `bf16=True`), gradient checkpointing (`train.grpo.gradient_checkpointing`;
TRL's default), micro-batches of --micro-batch rows (ours: `train.grpo.micro_batch_tokens` is a budget of padded
tokens, rows x (prompt + completion width), so it is set to micro-batch x (prompt tokens + new tokens); TRL:
`per_device_train_batch_size`), the transformers generation engine (`rollout.type=transformers`; TRL without
vLLM), the device (`policy.device`; TRL on cuda, or `use_cpu`) and the same torch threads (`policy.threads`;
`torch.set_num_threads`). Differences that remain, by design of each trainer: TRL samples under accelerate's
bf16 autocast entered per forward call (its `bf16=True` wraps the model's forward) where ours enters it once per
`generate` (`rollout.precision: auto`: float32 weights on a GPU decode under bf16 autocast, without its cast cache;
`--set policy.dtype=bfloat16` stores the weights in bf16 instead); both take π_old from the loss pass's detached
log-probs when a step makes one update; both loss passes apply the LM head without keeping the full logits (TRL's fused
head; ours `train.grpo.fused_head`, on by default on CUDA since 2026-11-26, after the figures of that date); ours
shares each prompt's key/value cache across its group while sampling; ours commits every artifact of every step
(rollouts, rewards, metrics) where TRL keeps everything in memory, and the weights and optimizer state (~6 GB at
0.5B) at the last step only (`train.state_every`: a resumed run replays the steps since the last stored state).
Ours runs `rlvr run` in a subprocess with a fresh store, no warm start, evaluation and a checkpoint only at the
last step, and a 2-sample difficulty pass; problems come from a JSONL file (the `file` source), and TRL's dataset
is the problems our run selected from (splits train + warmup).

Figures, over the steady steps (warm-up steps and the last step excluded, as in trainer_vs_trl.py): completions/s;
rollout tokens/s = sampled tokens / sampling time (ours: the rollout stage's build seconds; TRL: its
`model.generate` calls); training tokens/s = (prompt + completion tokens of the step's rows) / update time (ours:
`train_steps.compute_seconds`, i.e. `grpo_step` with its old-log-prob pass; TRL: `compute_loss`, backward, gradient
clipping and the optimizer step); the share of a step outside the model = (step - sampling - update -
verification) / step: for ours the storage (reads, commits, serialising the train state) and orchestration
(Prefect, the curriculum stages, the rest), split as benchmarks/step_overhead.py does; for TRL its own
bookkeeping (tokenising, decoding, advantages, the dataloader). Peak GPU memory is torch's
`max_memory_allocated` in each process: ours the largest `peak_memory_bytes` of the run's `stage_runs` rows
(each stage's model work), TRL's read at the end of training. TRL's timers synchronise CUDA around each timed call.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainer_vs_trl import (
    TRL_VENV,
    TRL_VERSION,
    counting_reward,
    ensure_trl_venv,
    measured,
    prefect_env,
    rlvr_command,
    steady_rate,
    step_clock,
    step_completions,
    step_ends,
    trained_problems,
    trl_env,
    trl_grpo_settings,
)

from rlvr.verifiers.base import Score, Verifier, non_text_error

BENCHMARKS = Path(__file__).resolve().parent
VERIFIER = "gpu_vs_trl:LetterShare"  # importable with BENCHMARKS on the path (rlvr's verifier import paths)
REFERENCE = "abcdefghijklm"
LR = 1e-6
TINY_VOCAB = 512
FULL = {"prompts": 64, "n": 8, "new_tokens": 256, "prompt_tokens": 64, "micro_batch": 32, "warmup": 1, "steps": 3}
SMOKE = {"prompts": 4, "n": 4, "new_tokens": 8, "prompt_tokens": 8, "micro_batch": 8, "warmup": 1, "steps": 1}
GIB = 2**30


class LetterShare(Verifier):
    """The share of the response's letters that are among the reference's letters; 0 for a response without
    letters. Status ok from one half up. The benchmark's reward: see the module docstring for why."""

    name = "letter_share"
    domain = "benchmark"
    version = "1"

    def score(self, response: str, reference: Any) -> Score:
        wrong_type = non_text_error(response)
        if wrong_type is not None:
            return wrong_type
        letters = [char for char in response if char.isalpha()]
        if not letters:
            return Score(0.0, "unparseable", reason="no letters in the response")
        wanted = set(str(reference))
        value = sum(char in wanted for char in letters) / len(letters)
        return Score(value, "ok" if value >= 0.5 else "wrong")


# --- the model, the tokenizer and the problems ---------------------------------------------------------------


def letter_words() -> Any:
    """ "a" .. "z", "aa" .. "zz", "aaa", ...: the strings that fill the tokenizer's vocabulary."""
    import itertools
    import string

    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield "".join(letters)


def benchmark_tokenizer(vocab_size: int) -> Any:
    """The built-in character tokenizer (`build_tiny_tokenizer`) with its vocabulary filled up to `vocab_size` with
    letter strings, and without the `<s>` it prepends. Prompts of its characters encode one token per character,
    as before; every id decodes to text. (Loaded back with AutoTokenizer next to a qwen2 config.json it becomes a
    merge-less byte-level BPE, which encodes and decodes these characters and letter strings alike.)"""
    from tokenizers import models, processors

    from rlvr.trainer.tiny_model import UNK, VOCAB, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    vocab = {token: index for index, token in enumerate(VOCAB)}
    for word in letter_words():
        if len(vocab) >= vocab_size:
            break
        vocab[word] = len(vocab)
    backend = tokenizer.backend_tokenizer
    backend.model = models.WordLevel(vocab=vocab, unk_token=UNK)
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    return tokenizer


def save_model(name: str, max_positions: int, directory: Path) -> None:
    """The benchmark's model and tokenizer, saved for `from_pretrained` (float32 weights, built on the CPU so that
    this process holds no GPU memory while the two runs measure theirs)."""
    from transformers.utils import logging as transformers_logging

    from rlvr.trainer.rng import seeded_rng
    from rlvr.trainer.tiny_model import TinyModelConfig, build_tiny_model

    transformers_logging.disable_progress_bar()

    if name == "0.5b":
        from gpu_throughput import QWEN_05B_VOCAB, qwen_05b

        model, vocab_size = qwen_05b("cpu"), QWEN_05B_VOCAB
    else:
        model, vocab_size = build_tiny_model(TinyModelConfig(max_positions=max(64, max_positions)), seed=0), TINY_VOCAB
        with seeded_rng(0):
            model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.save_pretrained(directory)
    benchmark_tokenizer(vocab_size).save_pretrained(directory)


def write_problems(path: Path, prompts: int, prompt_tokens: int) -> None:
    """2 x prompts + 8 problems (so that splits train + warmup, ~80% of them, hold more than one step's prompts): seeded
    random strings of `prompt_tokens` digits and operators, each with the reference letters."""
    from rlvr.trainer.tiny_model import VOCAB

    alphabet = [token for token in VOCAB if len(token) == 1]
    rng = random.Random(0)
    with path.open("w") as out:
        for index in range(2 * prompts + 8):
            prompt = "".join(rng.choices(alphabet, k=prompt_tokens))
            out.write(json.dumps({"id": f"p{index}", "prompt": prompt, "reference": REFERENCE}) + "\n")


# --- ours -----------------------------------------------------------------------------------------------------


def rlvr_overrides(args: argparse.Namespace, model_dir: Path, problems: Path) -> list[str]:
    total = args.warmup + args.steps + 1
    # The data stage accepts only registered verifier names: the problems name `text` (exact match, which their
    # reference passes), and label.verifier, which the difficulty pass and evaluation use too, scores them all.
    source = {"type": "file", "path": str(problems), "verifier": "text"}
    return [
        f"synthesize.source={json.dumps(source)}",
        f"label.verifier={VERIFIER}",
        f"policy.model={model_dir}",
        f"policy.device={args.device}",
        f"policy.threads={args.threads}",
        f"select.batch_size={args.prompts}",
        f"allocate.n={args.n}",
        "rollout.type=transformers",
        f"rollout.max_new_tokens={args.new_tokens}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "train.grpo.minibatches=1",
        f"train.grpo.lr={LR}",
        "train.grpo.autocast=bf16",
        "train.grpo.gradient_checkpointing=true",
        f"train.grpo.micro_batch_tokens={args.micro_batch * (args.prompt_tokens + args.new_tokens)}",
        "warmstart.steps=0",
        "difficulty.k=2",
        f"train.steps={total}",
        f"train.state_every={total}",  # weights + Adam state (~6 GB at 0.5B) stored at the last step only
        f"evaluate.every={total}",
        f"checkpoint.every={total}",
        f"flow.steps_per_subflow={total}",
        *args.overrides,
    ]


def with_benchmarks_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this folder on PYTHONPATH, so that the run's verifier workers import `VERIFIER`."""
    paths = [p for p in (env.get("PYTHONPATH", ""), str(BENCHMARKS)) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def store_rows(store: Any, sql: str) -> list[dict[str, Any]]:
    from rlvr.storage.views import query

    return query(store, sql).to_pylist()


def run_ours(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One whole `rlvr run` in `tmp` (run from there: a checkout's root would shadow the installed `rlvr` package
    on a machine where the project is installed, not linked); its figures over the steady steps."""
    overrides = rlvr_overrides(args, tmp / "model", tmp / "problems.jsonl")
    figures = measured(
        rlvr_command(tmp / "store", overrides), with_benchmarks_path(prefect_env(tmp)), tmp / "rlvr.log", tmp
    )
    from rlvr.storage.store import Store

    store = Store.open(str(tmp / "store"))
    first, last = args.warmup, args.warmup + args.steps
    ends = step_ends(store)
    figures["steady_per_s"] = steady_rate(ends, step_completions(store), args.steps, args.warmup)
    figures["step_s"] = (ends[last] - ends[first]) / args.steps
    timed = f"step > {first} AND step <= {last}"
    stages = store_rows(store, "SELECT * FROM stage_runs")
    steady = [r for r in stages if r["step"] is not None and first < r["step"] <= last]
    rollouts = store_rows(
        store,
        f"SELECT count(*) AS n, sum(n_tokens)::DOUBLE AS tokens, avg(n_tokens) AS mean FROM rollouts WHERE {timed}",
    )[0]
    trains = store_rows(store, f"SELECT compute_seconds, effective_ratio FROM train_steps WHERE {timed}")

    def build(stage: str) -> float:
        return sum(r["build_seconds"] for r in steady if r["stage"] == stage) / args.steps

    compute = sum(r["compute_seconds"] for r in trains) / args.steps
    figures.update(
        rollout_s=build("rollout"),
        rollout_tokens=rollouts["tokens"] / args.steps,
        train_s=compute,
        train_tokens=(rollouts["tokens"] + rollouts["n"] * args.prompt_tokens) / args.steps,
        verify_s=build("label"),
        mean_new_tokens=rollouts["mean"],
        trained_groups=sum(r["effective_ratio"] for r in trains) / len(trains),
        serialise_s=build("train") - compute,
        read_commit_s=sum(r["read_seconds"] + r["commit_seconds"] for r in steady) / args.steps,
        curriculum_s=sum(r["build_seconds"] for r in steady if r["stage"] not in ("rollout", "train", "label"))
        / args.steps,
    )
    builds = sum(r["build_seconds"] for r in steady) / args.steps
    figures["orchestration_s"] = figures["step_s"] - builds - figures["read_commit_s"]
    figures.update(peak_memory(stages))
    return figures


def peak_memory(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's peak GPU memory from its stage runs: the largest `peak_memory_bytes` (each stage's model work),
    per stage too; a note instead where this checkout's `stage_runs` has no such column or the run used no GPU."""
    if not stages or "peak_memory_bytes" not in stages[0]:
        return {"peak_bytes": None, "peak_note": "n/a: this checkout's stage_runs has no peak_memory_bytes column"}
    devices = sorted({str(r["device"]) for r in stages if r.get("device")})
    measured_rows = [r for r in stages if r["peak_memory_bytes"] is not None]
    if not measured_rows:
        return {"peak_bytes": None, "peak_note": f"n/a on {', '.join(devices) or 'the CPU'}", "devices": devices}
    by_stage: dict[str, int] = {}
    for r in measured_rows:
        by_stage[r["stage"]] = max(by_stage.get(r["stage"], 0), r["peak_memory_bytes"])
    return {"peak_bytes": max(by_stage.values()), "peak_by_stage": by_stage, "devices": devices}


# --- the peer -------------------------------------------------------------------------------------------------


def trl_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """The interpreter TRL runs in and where it comes from, or None and why TRL is skipped."""
    if args.no_trl:
        return None, "TRL skipped: --no-trl"
    if importlib.util.find_spec("trl") is not None:
        return sys.executable, "this interpreter"
    if (TRL_VENV / f".installed-trl-{TRL_VERSION}").exists():
        return str(TRL_VENV / "bin" / "python"), str(TRL_VENV)
    if args.model == "tiny":
        return None, (
            f"TRL skipped: the smoke mode runs it only where trl is importable or {TRL_VENV} exists "
            "(benchmarks/trainer_vs_trl.py creates it)"
        )
    return ensure_trl_venv(), str(TRL_VENV)


def run_trl(args: argparse.Namespace, tmp: Path, python: str, problems: list[dict[str, str]]) -> dict[str, Any]:
    """TRL's GRPOTrainer in `python` (this file with --trl-worker); its figures over the steady steps."""
    spec = {**vars(args), "problems": problems, "model_dir": str(tmp / "model")}
    (tmp / "trl-spec.json").write_text(json.dumps(spec))
    env = with_benchmarks_path(trl_env(tmp, args.threads))
    if args.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = args.device.partition(":")[2]  # TRL takes the first visible GPU
    command = [python, str(Path(__file__).resolve()), "--trl-worker", str(tmp)]
    figures = measured(command, env, tmp / "trl.log", tmp)
    worker = json.loads((tmp / "trl.json").read_text())
    series = {name: {int(k): v for k, v in values.items()} for name, values in worker["per_step"].items()}
    ends = series.pop("ends")
    first, last = args.warmup, args.warmup + args.steps

    def steady(name: str) -> float:
        return sum(series[name].get(step, 0) for step in range(first + 1, last + 1)) / args.steps

    figures.update(
        steady_per_s=steady_rate(ends, series["completions"], args.steps, args.warmup),
        step_s=(ends[last] - ends[first]) / args.steps,
        rollout_s=steady("generate_s"),
        rollout_tokens=steady("new_tokens"),
        train_s=steady("train_s"),
        train_tokens=steady("new_tokens") + steady("completions") * args.prompt_tokens,
        verify_s=steady("reward_s"),
        mean_new_tokens=steady("new_tokens") / steady("completions"),
        peak_bytes=worker["peak_bytes"],
        peak_note=None if worker["peak_bytes"] is not None else "n/a on the CPU",
        versions=worker["versions"],
    )
    return figures


def trl_worker(args: argparse.Namespace) -> None:
    """Inside TRL's interpreter: train with GRPOTrainer under timers; write per-step figures to trl.json."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.verifiers.adapters import trl_reward_func

    tmp = Path(args.trl_worker)
    spec = json.loads((tmp / "trl-spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    cuda = spec["device"].startswith("cuda")
    ends: dict[int, float] = {}
    per_step: dict[str, dict[int, float]] = {"generate_s": {}, "train_s": {}, "reward_s": {}, "new_tokens": {}}
    scored: dict[int, int] = {}

    def add(name: str, value: float) -> None:
        step = len(ends) + 1  # the step running now (as `counting_reward` counts)
        per_step[name][step] = per_step[name].get(step, 0.0) + value

    def timed(name: str, call: Any) -> Any:
        @functools.wraps(call)  # TRL names a reward function's metrics after its __name__
        def wrapper(*positional: Any, **named: Any) -> Any:
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                return call(*positional, **named)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                add(name, time.perf_counter() - started)

        return wrapper

    score = trl_reward_func(VERIFIER)

    def scored_with_tokens(**columns: Any) -> list[float]:
        add("new_tokens", sum(len(ids) for ids in columns.get("completion_ids") or []))
        return score(**columns)

    reward = timed("reward_s", counting_reward(scored_with_tokens, ends, scored, "letter_share"))

    settings = trl_settings(spec, tmp)
    data = Dataset.from_list([{"prompt": p["prompt"], "reference": p["reference"]} for p in spec["problems"]])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.generate = timed("generate_s", model.generate)  # the instance TRL unwraps for generation
    trainer = GRPOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
        reward_funcs=[reward],
        args=GRPOConfig(**settings),
        train_dataset=data,
        callbacks=[step_clock(ends), optimizer_clock(cuda, add)],
    )
    trainer.compute_loss = timed("train_s", trainer.compute_loss)
    trainer.accelerator.backward = timed("train_s", trainer.accelerator.backward)
    trainer.accelerator.clip_grad_norm_ = timed("train_s", trainer.accelerator.clip_grad_norm_)
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}
    result = {
        "per_step": {"ends": ends, "completions": scored, **per_step},
        "peak_bytes": peak,
        "versions": {**versions, "python": platform.python_version()},
    }
    (tmp / "trl.json").write_text(json.dumps(result))


def trl_settings(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """GRPOConfig's arguments: the shared GRPO shape, our micro-batch as TRL's per-device batch (one optimizer
    step over all the step's rows), no top-k, bf16 and checkpointing."""
    rows = spec["prompts"] * spec["n"]
    settings = trl_grpo_settings(tmp / "trl-out", spec["warmup"] + spec["steps"] + 1, spec["n"], spec["new_tokens"])
    return settings | {
        "learning_rate": LR,
        "per_device_train_batch_size": spec["micro_batch"],
        "gradient_accumulation_steps": rows // spec["micro_batch"],
        "steps_per_generation": rows // spec["micro_batch"],
        "top_k": 0,
        "use_cpu": not spec["device"].startswith("cuda"),
        "bf16": True,
        "gradient_checkpointing": True,
    }


def optimizer_clock(cuda: bool, add: Any) -> Any:
    """A TrainerCallback adding each optimizer step's time to `train_s` (CUDA synchronised around it)."""
    import torch
    from transformers import TrainerCallback

    class OptimizerClock(TrainerCallback):  # type: ignore[misc]
        started = 0.0

        def on_pre_optimizer_step(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_optimizer_step(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            add("train_s", time.perf_counter() - self.started)

    return OptimizerClock()


# --- the report --------------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    """The GPU's name (torch.cuda.get_device_name; called after both runs: it starts CUDA in this process), or the
    CPU's."""
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        return f"{torch.cuda.get_device_name(index)} ({device})"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def report(args: argparse.Namespace, ours: dict[str, Any], peer: dict[str, Any] | None, why_no_peer: str) -> None:
    print_setup(args, peer, why_no_peer)
    for side in (ours, peer):
        if side is not None:
            derive_figures(side)
    print_table(ours, peer)
    print_ours_outside_the_model(ours, peer)
    if peer is None:
        print(f"rlvr run completions/s = {ours['steady_per_s']:.1f} (no TRL figures: {why_no_peer})")
        return
    memory = f"{ours['peak_gib'] / peer['peak_gib']:.2f}x" if ours["peak_gib"] and peer["peak_gib"] else "n/a"
    print(f"rlvr/TRL completions/s = {ours['steady_per_s'] / peer['steady_per_s']:.2f}x, peak GPU memory {memory}")


def print_setup(args: argparse.Namespace, peer: dict[str, Any] | None, why_no_peer: str) -> None:
    """The date, device, versions of both sides and the benchmark's shape."""
    import torch
    import transformers

    print(
        f"gpu_vs_trl {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; device {device_name(args.device)}; python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    if peer is not None:
        v = peer["versions"]
        print(
            f"TRL {v['trl']} in {args.trl_from}: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}"
        )
    else:
        print(why_no_peer)
    print(
        f"model {args.model}, {args.prompts} prompts x {args.n} samples, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens, bf16 autocast, gradient checkpointing, micro-batches of {args.micro_batch} "
        f"rows, {args.threads} torch thread(s); {args.steps} steady step(s) after {args.warmup} warm-up step(s) "
        "(+1 final step not timed)"
    )


def derive_figures(side: dict[str, Any]) -> None:
    """Rates, the time outside the model and its share, and the peak in GiB, from one side's measurements."""
    side["rollout_per_s"] = side["rollout_tokens"] / side["rollout_s"] if side["rollout_s"] else None
    side["train_per_s"] = side["train_tokens"] / side["train_s"] if side["train_s"] else None
    model_s = side["rollout_s"] + side["train_s"] + side["verify_s"]
    side["outside_s"] = side["step_s"] - model_s
    side["outside_share"] = side["outside_s"] / side["step_s"]
    side["peak_gib"] = side["peak_bytes"] / GIB if side["peak_bytes"] is not None else None


def print_table(ours: dict[str, Any], peer: dict[str, Any] | None) -> None:
    rows = [
        ("completions/s", "steady_per_s", ".1f"),
        ("step s", "step_s", ".2f"),
        ("rollout s/step", "rollout_s", ".2f"),
        ("rollout tokens/s", "rollout_per_s", ".0f"),
        ("training s/step", "train_s", ".2f"),
        ("training tokens/s", "train_per_s", ".0f"),
        ("verification s/step", "verify_s", ".3f"),
        ("outside the model s/step", "outside_s", ".2f"),
        ("outside the model share", "outside_share", ".1%"),
        ("mean new tokens", "mean_new_tokens", ".1f"),
        ("peak GPU memory GiB", "peak_gib", ".2f"),
        ("peak process-tree PSS MB", "tree_pss_mb", ".0f"),
        ("whole command wall s", "wall_s", ".1f"),
    ]
    print(f"{'':28}{'rlvr run':>12}{'TRL ' + TRL_VERSION:>12}{'ratio':>8}")
    for label, key, fmt in rows:
        mine, theirs = ours.get(key), peer.get(key) if peer else None
        ratio = mine / theirs if mine is not None and theirs else None
        ratio_text = "" if key == "outside_share" else cell(ratio, ".2f")
        print(f"{label:28}{cell(mine, fmt):>12}{cell(theirs, fmt):>12}{ratio_text:>8}")


def print_ours_outside_the_model(ours: dict[str, Any], peer: dict[str, Any] | None) -> None:
    """Where our step's time outside the model goes, our peak memory by stage, and why a peak is missing."""
    overhead = (ours["read_commit_s"] + ours["orchestration_s"]) / ours["step_s"]
    print(
        f"rlvr run outside the model, s/step: reading and committing artifacts {ours['read_commit_s']:.3f}, "
        f"serialising the weights and optimizer state {ours['serialise_s']:.3f}, curriculum stages "
        f"{ours['curriculum_s']:.3f}, orchestration {ours['orchestration_s']:.3f}; orchestration + storage as "
        f"step_overhead.py counts it (reads, commits, orchestration): {overhead:.1%} of the step; groups trained "
        f"{ours['trained_groups']:.0%}"
    )
    if ours.get("peak_by_stage"):
        stages = ", ".join(f"{stage} {value / GIB:.2f}" for stage, value in sorted(ours["peak_by_stage"].items()))
        print(f"rlvr run peak GPU memory by stage, GiB (stage_runs.peak_memory_bytes): {stages}")
    notes = [
        f"{name}: {side['peak_note']}"
        for name, side in (("rlvr run", ours), ("TRL", peer))
        if side and side.get("peak_note")
    ]
    if notes:
        print("peak GPU memory " + "; ".join(notes))


# --- the command -------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["0.5b", "tiny"], default="0.5b", help="tiny: the CPU smoke mode")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when there is one)")
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--n", type=int, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--micro-batch", type=int, help="rows per forward/backward, both sides")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--steps", type=int, help="timed steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both (rlvr's default: 1)")
    parser.add_argument("--no-trl", action="store_true", help="run ours only")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra rlvr override key=value")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (model, stores, logs)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return args
    for key, value in (SMOKE if args.model == "tiny" else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if (args.prompts * args.n) % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide prompts x n = {args.prompts * args.n}")
    return args


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if not args.device.startswith("cuda"):
        print(f"note: device {args.device}: a smoke test, not a GPU measurement", file=sys.stderr)
    python, args.trl_from = trl_python(args)
    tmp = Path(tempfile.mkdtemp(prefix="rlvr-gpu-vs-trl-"))
    try:
        save_model(args.model, args.prompt_tokens + args.new_tokens, tmp / "model")
        write_problems(tmp / "problems.jsonl", args.prompts, args.prompt_tokens)
        ours = run_ours(args, tmp)
        peer = None
        if python is not None:
            from rlvr.storage.store import Store

            problems = trained_problems(Store.open(str(tmp / "store")), "prompt, reference")
            peer = run_trl(args, tmp, python, problems)
        report(args, ours, peer, args.trl_from)
    finally:
        if args.keep:
            print(f"model, store and logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
