"""A run across machines, tried on one machine as two: two torchrun launches (`--nnodes 2`, one rank each) meet
at a rendezvous on 127.0.0.1; node 0's rank 0 runs the flow and node 1's rank serves it (trainer/ranks/serve.py).
The run's artifacts, rollouts and final weights equal those of a one-node run at the same rank count (two ranks
the run starts itself)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.storage.store import Store
from rlvr.storage.views import query
from tests.cli_helpers import REPO, cli_env, rlvr

pytestmark = pytest.mark.slow

SETS = [
    "train.steps=4",
    "train.data_parallel=2",
    "select.batch_size=4",  # not the defaults' 64 prompts x 8 samples a step: 16 rollouts share out as well
    "allocate.n=4",
    "warmstart.steps=10",
    "difficulty.k=2",
    "evaluate.every=2",
    "checkpoint.every=2",
    "synthesize.source.per_category=6",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_arguments(store: Path) -> list[str]:
    args = ["run", "--store", str(store), "--run-id", "nodes"]
    for item in SETS:
        args += ["--set", item]
    return args


def _contents(store: Path) -> tuple[list[str], list[dict], bytes]:
    s = Store.open(str(store))
    ids = sorted(m.artifact_id for m in s.manifests())
    rollouts = query(s, "SELECT step, slot, sample_index, completion_ids FROM rollouts ORDER BY ALL").to_pylist()
    final = max(s.manifests(kind="checkpoints"), key=lambda m: m.step)
    return ids, rollouts, s.read_file(final.artifact_id, "model.safetensors")


def test_two_nodes_on_localhost_equal_one_node(tmp_path, rlvr_forks):
    env = cli_env(PREFECT_API_URL=rlvr_forks.env["PREFECT_API_URL"])
    port = _free_port()
    nodes = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
        command += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        command += ["-m", "rlvr.flows.cli", *_run_arguments(tmp_path / "two-nodes")]
        nodes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [node.communicate(timeout=900)[0].decode(errors="replace") for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    assert "run nodes completed" in outputs[0]  # node 0 ran the flow; node 1 only served

    one = rlvr(*_run_arguments(tmp_path / "one-node"), timeout=900, forks=rlvr_forks)  # forked: imports paid
    assert one.returncode == 0, one.stderr[-3000:]
    two_ids, two_rollouts, two_weights = _contents(tmp_path / "two-nodes")
    one_ids, one_rollouts, one_weights = _contents(tmp_path / "one-node")
    assert two_ids == one_ids and len(one_ids) > 30
    assert two_rollouts == one_rollouts
    assert two_weights == one_weights
