"""benchmarks/gpu_throughput.py on the CPU with the tiny model: the transformers engine's shared-prompt cache and
graph loop each produce every completion at full length, and the report compares them (the GPU figures need a
lent machine: docs/benchmarks.md)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_both_caches_generate_every_token_and_the_report_compares_them():
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--model", "tiny", "--device", "cpu"]
    command += ["--engines", "transformers", "graph", "--prompts", "4", "--samples", "4", "--new-tokens", "16"]
    command += ["--prompt-tokens", "8", "--train-prompts", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for engine in ("transformers", "transformers-graph"):
        row = re.search(rf"^{engine}\s+[0-9.]+\s+[0-9.]+\s+(\d+)\s+\d+\s+(\w+)$", done.stdout, re.MULTILINE)
        assert row and row.groups() == ("256", "True"), done.stdout  # 4 x 4 rows of 16 tokens, all full length
    assert re.search(r"^graph / shared-prompt rollout tokens/s: [0-9.]+x$", done.stdout, re.MULTILINE)
    assert re.search(r"^\s+8\s+\d+\s+[0-9.]+\s+\d+\s+nan$", done.stdout, re.MULTILINE)  # grpo_step on 2 x 4 rows
