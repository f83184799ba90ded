"""Kill and resume on a GPU: what a SIGKILLed `rlvr run` on CUDA keeps after `rlvr resume`.

Two runs of the same config and run id in two stores, both on `policy.device` (the tiny built-in model, SEC and
Knapsack RL on): one uninterrupted, one SIGKILLed (its whole process group) as soon as `--kill-at` train steps
are committed and then resumed with `rlvr resume`. Prints whether the two stores hold the same artifact ids,
the same decisions (selections, allocations, training figures) and byte-identical final weights; where weights
differ, the largest absolute difference. tests/test_kill_resume.py asserts the same on the CPU.

    python benchmarks/gpu_resume.py [--device cuda] [--steps 8] [--kill-at 4] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OVERRIDES = [
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=20",
    "difficulty.k=4",
    "evaluate.every=4",
    "checkpoint.every=4",
    "select.type=sec",
    "allocate.type=knapsack",
]
RUN_ID = "gpu-resume"


def rlvr(*args: str) -> subprocess.Popen:
    return subprocess.Popen(["rlvr", *args], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run_args(store: Path, device: str, steps: int, extra: list[str]) -> list[str]:
    args = ["run", "--store", str(store), "--run-id", RUN_ID]
    for o in [*OVERRIDES, f"train.steps={steps}", f"policy.device={device}", *extra]:
        args += ["--set", o]
    return args


def committed(store: Path, kind: str) -> int:
    try:
        return sum(1 for n in os.listdir(store / "manifests") if n.startswith(f"{kind}-") and n.endswith(".json"))
    except FileNotFoundError:
        return 0


def finish(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{what} failed ({proc.returncode}): {err.decode()[-2000:]}")


def compare(reference: Path, killed: Path) -> None:
    import torch
    from safetensors.torch import load as load_tensors

    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    stores = {name: Store.open(str(root)) for name, root in (("reference", reference), ("killed", killed))}
    ids = {name: sorted(m.artifact_id for m in s.manifests()) for name, s in stores.items()}
    print(f"artifact ids equal: {ids['reference'] == ids['killed']} ({len(ids['reference'])} artifacts)")
    for table, sql in {
        "selections": "SELECT step, slot, problem_id, arm FROM selections ORDER BY step, slot",
        "allocations": "SELECT step, slot, n_rollouts, p_hat FROM allocations ORDER BY step, slot",
        "train_steps": "SELECT step, loss, mean_reward FROM train_steps ORDER BY step",
        "rollouts": "SELECT step, problem_id, sample_index, response FROM rollouts ORDER BY step, problem_id, sample_index",
    }.items():
        rows = {name: query(s, sql).to_pylist() for name, s in stores.items()}
        print(f"{table} equal: {rows['reference'] == rows['killed']} ({len(rows['reference'])} rows)")
    weights = {}
    for name, s in stores.items():
        final = max(s.manifests(kind="checkpoints"), key=lambda m: m.step)
        weights[name] = s.read_file(final.artifact_id, "model.safetensors")
    print(f"final weights byte-identical: {weights['reference'] == weights['killed']}")
    if weights["reference"] != weights["killed"]:
        a, b = load_tensors(weights["reference"]), load_tensors(weights["killed"])
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        print(f"largest absolute weight difference: {diff:.3e}")
    del torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlvr-gpu-resume-"))
    reference, killed = root / "reference", root / "killed"
    started = time.monotonic()
    ref = rlvr(*run_args(reference, args.device, args.steps, args.overrides))
    proc = rlvr(*run_args(killed, args.device, args.steps, args.overrides))
    while committed(killed, "train_steps") < args.kill_at:
        if proc.poll() is not None:
            finish(proc, "the run to kill")
            sys.exit(f"the run ended before {args.kill_at} train steps were committed")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed at {committed(killed, 'train_steps')} committed train steps, {time.monotonic() - started:.1f} s")
    finish(rlvr("resume", RUN_ID, "--store", str(killed)), "rlvr resume")
    finish(ref, "the reference run")
    print(f"both runs done in {time.monotonic() - started:.1f} s")
    compare(reference, killed)


if __name__ == "__main__":
    main()
