"""Every command of the README, run as printed, in a scratch copy of the repository (issue 51: the README's
commands do what they say). Prints a row per command (exit status, minutes, its last line) and a last line with
how many did what the README says.

The copy is `git archive HEAD` unpacked under --out, with this checkout's `.venv` linked in (its install stamps make
`make demo`, `make smollm2` and `make envs` run at once). What a command needs first is done as a user would have
done it: RUN_ID and CHECKPOINT_ID are the demo's (its last lines print both), `rlvr resume my-run` resumes a demo
run named my-run killed after a minute, `rlvr schedule NAME --cron ...` serves until the Ctrl-C the script sends
it once it says it serves, and a command ending in `&` runs beside the rest and is stopped at the end. `make test`
is CI's own command and is not run here. Long commands (`--skip-long` leaves them out) are the real-model ones.

    python benchmarks/readme_commands.py [--out DIR] [--skip-long] [--timeout-minutes 90]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
DEMO_LINE = re.compile(r"held-out greedy accuracy \(test split\): before \S+ -> after warm start \S+ -> after RL \S+")
LONG = ("smollm2", "guess-the-number", "judge-tiny", "serve-rm")


@dataclass
class Outcome:
    command: str
    status: int | None
    minutes: float
    last: str
    expected: bool


def readme_commands() -> list[str]:
    """The README's shell commands in order: code blocks' lines, continuations joined, comments kept out."""
    found = []
    for block in FENCE.findall((REPO / "README.md").read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(line.split(" # ")[0].split("   #")[0].strip())
    return found


def scratch_copy(out: Path) -> Path:
    root = out / "repo"
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / ".venv").symlink_to(REPO / ".venv")
    # The venv is this checkout's: were the copy's pyproject.toml newer than its install stamp (tar gives it the
    # commit's time), `make demo` would reinstall the package editable from the copy, and this checkout's venv
    # would import the copy's code until the next `make venv`.
    stamp = REPO / ".venv" / ".installed"
    if not stamp.exists() or stamp.stat().st_mtime < (REPO / "pyproject.toml").stat().st_mtime:
        sys.exit("readme_commands: run `make venv` first (the venv is missing or older than pyproject.toml)")
    installed = stamp.stat().st_mtime
    os.utime(root / "pyproject.toml", (installed, installed))
    return root


def run(command: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, float, str]:
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return None, (time.monotonic() - started) / 60, f"timed out: {output.strip().splitlines()[-1:]}"
    text = (done.stdout + done.stderr).strip()
    return done.returncode, (time.monotonic() - started) / 60, text


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:150] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--timeout-minutes", type=float, default=90)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="rlvr-readme-"))
    root = scratch_copy(out)
    env = {**os.environ, "PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PREFECT_API_URL", None)
    timeout = args.timeout_minutes * 60
    names: dict[str, str] = {}
    background: list[subprocess.Popen[bytes]] = []
    outcomes: list[Outcome] = []
    for command in readme_commands():
        if command == "make test" or (args.skip_long and any(word in command for word in LONG)):
            continue
        shown = command
        for placeholder, value in names.items():
            command = command.replace(placeholder, value)
        if command.endswith("&"):
            background.append(subprocess.Popen(["bash", "-c", command.rstrip("&")], cwd=root, env=env))
            wait_for_port(command)
            outcomes.append(Outcome(shown, 0, 0.0, "started in the background", True))
            continue
        if command.startswith("rlvr resume my-run"):
            prepare_killed_run(root, env)
        if command.startswith("rlvr schedule") and "--cron" in command:
            outcomes.append(serve_briefly(shown, command, root, env))
            continue
        status, minutes, text = run(command, root, env, timeout)
        expected = status == 0
        if command.startswith("make demo"):
            expected = expected and DEMO_LINE.search(text) is not None
            names["RUN_ID"] = re.search(r"run id: (\S+)", text).group(1) if "run id:" in text else "RUN_ID"
            checkpoint = re.search(r"rlvr lineage (checkpoints-\S+)", text)
            names["CHECKPOINT_ID"] = checkpoint.group(1) if checkpoint else "CHECKPOINT_ID"
        if "guess-the-number" in command:
            expected = expected and "held-out greedy accuracy" in text
        outcomes.append(Outcome(shown, status, minutes, last_line(text), expected))
        print(f"{'ok ' if expected else 'NOT'} {minutes:6.1f} min  rc={status}  {shown[:90]}", flush=True)
    for process in background:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    print()
    print("| command | exit | minutes | last line | as the README says |")
    print("|---|---|---|---|---|")
    for o in outcomes:
        print(f"| `{o.command[:80]}` | {o.status} | {o.minutes:.1f} | {o.last} | {'yes' if o.expected else 'NO'} |")
    good = sum(o.expected for o in outcomes)
    print(f"\n{good} of {len(outcomes)} README commands did what the README says (copy under {out})")
    sys.exit(0 if good == len(outcomes) else 1)


def wait_for_port(command: str, seconds: float = 300) -> None:
    """A server started in the background (`--port N`) answers its /health within `seconds`, or the run goes on."""
    import urllib.request

    port = re.search(r"--port (\d+)", command)
    deadline = time.monotonic() + seconds
    while port and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)


def prepare_killed_run(root: Path, env: dict[str, str]) -> None:
    """A demo run named my-run, killed after a minute: what `rlvr resume my-run` is for."""
    process = subprocess.Popen(
        ["rlvr", "run", "--run-id", "my-run", "--store", "./rlvr-store"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(60)
    process.send_signal(signal.SIGKILL)
    process.wait()


def serve_briefly(shown: str, command: str, root: Path, env: dict[str, str]) -> Outcome:
    """`rlvr schedule NAME --cron ...` serves until Ctrl-C: sent once it says it serves (the README's next line
    deletes the schedule after that)."""
    started = time.monotonic()
    log = root / "schedule.log"
    with log.open("w") as sink:
        process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=root, env=env, stdout=sink, stderr=sink)
        while time.monotonic() - started < 300 and "serving schedule" not in log.read_text():
            time.sleep(1)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text()
    expected = "serving schedule" in text and "stopped serving" in text
    print(f"{'ok ' if expected else 'NOT'}  schedule served, then Ctrl-C: {last_line(text)}", flush=True)
    return Outcome(shown, process.returncode, (time.monotonic() - started) / 60, last_line(text), expected)


if __name__ == "__main__":
    main()
