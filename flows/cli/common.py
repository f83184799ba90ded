"""What the `rlvr` commands share: where the store is, opening it, Prefect's set-up for a command that runs a
flow, and the progress over a run's progress events: a bar in a terminal, plain lines in a pipe or a file."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any, TypeVar

import typer

from rlvr.errors import Stopped

if TYPE_CHECKING:  # the store's modules load pyarrow and fsspec, rich's progress more: not for `rlvr --help`
    from rich.progress import Progress

    from rlvr.storage.store import Store

T = TypeVar("T")

DEFAULT_STORE = "./rlvr-store"
StoreOption = typer.Option(
    None, "--store", help="store root: a path or fsspec URL (default $RLVR_STORE or ./rlvr-store)"
)


def store_root(store: str | None) -> str:
    """The store named by --store, else $RLVR_STORE, else ./rlvr-store."""
    return store or os.environ.get("RLVR_STORE") or DEFAULT_STORE


def open_existing(store: str | None) -> Store:
    """The store named as `store_root` finds it (one-line errors when it is not a store)."""
    from rlvr.storage.store import open_store

    return open_store(store_root(store))


def flow_store(store: str | None) -> str:
    """The store root of a command that runs a flow, with Prefect set up on the store's database (created when
    the store is new)."""
    from rlvr.flows.prefect_env import configure_prefect
    from rlvr.storage.store import open_store

    root = store_root(store)
    configure_prefect(open_store(root, create=True))
    return root


PLAIN_EVERY_S = 5.0  # in a pipe or a file, at most one progress line this often (stage starts and ends apart)


class ProgressLines:
    """A run's progress as plain lines, for output that is not a terminal (a file, a pipe, a batch job's log),
    where a bar would show nothing until the run ends: no control codes, each line flushed as it is written.
    A stage's start and end are always written; the other events (steps, shards, data phases, evaluations) at
    most one every `every` seconds, the newest one held back is written before the next stage starts."""

    def __init__(
        self,
        stream: IO[str],
        *,
        steps: int | None = None,
        every: float = PLAIN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.steps, self.every, self.clock = stream, steps, every, clock
        self.began = clock()
        self.last_line = float("-inf")  # when the last throttled line was written
        self.held: tuple[str, dict[str, Any]] | None = None  # the newest throttled event not written
        self.stage: tuple[str, float] | None = None  # the stage running and when it started
        self.accuracy: float | None = None
        self._lock = threading.Lock()  # stages report from several threads

    def hear(self, event: str, fields: dict[str, Any]) -> None:
        """One progress event (rlvr/progress.py)."""
        with self._lock:
            if event == "warning":
                self._write(f"warning: {fields['message']}")
            elif event == "stage":
                self._begin(str(fields["name"]))
            elif event == "shard":
                if self.stage is None or self.stage[0] != fields["stage"]:
                    self._begin(str(fields["stage"]))  # the RL flow's difficulty stage says so only by its shards
                self._throttled(event, fields)
            elif event == "eval":
                self.accuracy = fields["accuracy"]
                held_step = self.held is not None and self.held[0] == "step" and self.held[1]["step"] == fields["step"]
                if not held_step:  # else the step's line, when written, carries the accuracy
                    self._throttled(event, fields)
            elif event in ("step", "data"):
                self._throttled(event, fields)

    def _line(self, event: str, fields: dict[str, Any]) -> str:
        if event == "shard":
            return f"{fields['stage']}: shard {fields['done']}/{fields['total']}"
        if event == "data":
            where = fields.get("source") or f"{fields.get('rows', 0)} rows"
            return f"synthesize: {fields['phase']} ({where})"
        if event == "eval":
            at = fields.get("phase") or f"step {fields['step']}"
            return f"held-out accuracy {_number(fields['accuracy'])} ({at})"
        of = f"/{self.steps}" if self.steps else ""
        line = f"rl step {fields['step']}{of}: reward {_number(fields['reward'])}"
        return line + (f", held-out accuracy {_number(self.accuracy)}" if self.accuracy is not None else "")

    def finish(self) -> None:
        """The run ended well: the last stage's end."""
        with self._lock:
            self._end()

    def _begin(self, name: str) -> None:
        self._end()
        self.stage = (name, self.clock())
        self._write(name)

    def _end(self) -> None:
        if self.held is not None:
            self._write(self._line(*self.held))
            self.held = None
        if self.stage is not None:
            name, began = self.stage
            self._write(f"{name} done in {self.clock() - began:.0f} s")
            self.stage = None

    def _throttled(self, event: str, fields: dict[str, Any]) -> None:
        if self.clock() - self.last_line < self.every:
            self.held = (event, fields)
            return
        self.held = None
        self.last_line = self.clock()
        self._write(self._line(event, fields))

    def _write(self, line: str) -> None:
        elapsed = timedelta(seconds=int(self.clock() - self.began))
        self.stream.write(f"[{elapsed}] {line}\n")
        self.stream.flush()


def _number(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def with_progress(
    start: Callable[[], T],
    bar: Progress,
    update: Callable[[str, dict[str, Any]], None],
    *,
    steps: int | None = None,
) -> T:
    """`start()` under `bar`, shown from the run's first progress event on (a run refused at once shows only its
    one-line error); warnings print above the bar, every other event goes to `update`. Where the bar's console is
    not an interactive terminal, plain lines instead (`ProgressLines`; `steps`: the run's RL steps). Ctrl-C becomes
    `Stopped` (exit 130 at once), which Typer does not catch: it would turn it into an exit that waits for stage
    threads."""
    from rlvr import progress

    lines = None if bar.console.is_interactive else ProgressLines(bar.console.file, steps=steps)

    def listener(event: str, fields: dict[str, Any]) -> None:
        if lines is not None:
            lines.hear(event, fields)
            return
        if event == "warning":
            bar.console.print(f"warning: {fields['message']}", markup=False, highlight=False)
            return
        if not bar.live.is_started:
            bar.start()
        update(event, fields)

    progress.listen(listener)
    try:
        result = start()
    except KeyboardInterrupt as exc:
        raise Stopped("interrupted", 128 + signal.SIGINT) from exc
    finally:
        progress.stop_listening(listener)
        if bar.live.is_started:
            bar.stop()
    if lines is not None:
        lines.finish()
    return result
