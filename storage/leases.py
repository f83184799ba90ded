"""Run leases: which process owns a run, so that runs sharing a store never touch each other's work.

A run is owned through numbered lease files, each created exclusively (a hard link on local disk, a
conditional PUT on an object store), so of several processes racing for the same number exactly one wins:

    leases/<run_id>/000000.json    {"pid", "host", "pid_started", "token", "purpose", "claimed_at",
    leases/<run_id>/000001.json     "heartbeat_at", "released_at"}

The highest number names the run's current owner. A new run creates number 0, so a second `rlvr run`
with the same id loses the race and says which process has the run. A resume (or a cleanup) of a run
whose owner is gone creates the next number. The owner refreshes `heartbeat_at` with the run record's
heartbeat and writes `released_at` when it stops; an owner that stops without it (SIGKILL, a crash, a
lost machine) is gone once its pid is dead on this host (with another start time, when the pid was
reused) or, from another host, once its heartbeat is older than RLVR_HEARTBEAT_TIMEOUT_S.

Only the owner of a run writes its run record and its artifacts, and only the owner removes what the
run's killed writers left (Store.cleanup_run): no process ever deletes files of a run it does not own.

Fencing. An owner can lose its run without knowing: frozen (SIGSTOP, a paused VM, a swapped-out machine) for
longer than the timeout, it is taken over from another host, and then thaws. So the lease number is a fencing
token. `owning` installs the lease on the process's Store (`Store.hold`), and every commit of the run checks
that the number is still the newest before it publishes anything (`Lease.check`: one listing of
leases/<run_id>/, once per commit of a batch, so once per RL step); every file write of the run checks the
lease in memory just before the rename or PUT that publishes it (`Lease.check_fresh`: a listing only when this
process has sent no heartbeat for half the timeout, which is the case just after a thaw; the heartbeat's and the
release's own writes too, so a thread frozen between its listing and its write does not touch its old lease file).
A failed check is `LeaseLost`, one line naming the run and its new owner; from then on every write of the run fails
at once, and a temp file written before the failed check is removed.
Manifests and the run record carry the lease number they were written under (`lease`). The heartbeat thread
that finds the run taken stops the run's main thread (flows/runs.py), which exits with status 2 without
writing its record or releasing a lease that is no longer its own. What is left: a write already past its
check when the process froze (the one rename, or PUT, that follows the check) completes when it thaws, and data
files written before a failed check stay behind uncommitted, for the new owner's cleanup.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rlvr.errors import UserError
from rlvr.storage.ids import canonical_json
from rlvr.storage.manifest import utc_now
from rlvr.storage.processes import heartbeat_timeout_s, pid_alive, pid_start_time
from rlvr.storage.store import Store

LEASES = "leases"
_LEASE_RE = re.compile(r"^(\d{6})\.json$")


class RunClaimed(UserError):
    """Another live process owns the run."""


class RunExists(UserError):
    """`rlvr run` named a run that already exists (running or not)."""


class LeaseLost(UserError):
    """This process's lease on a run is no longer the newest: another process took the run over."""


@dataclass
class Lease:
    """The claim of one run by this process: generation `number` of its lease files, and the fencing token its
    writes are checked against (see the module's docstring)."""

    store: Store
    run_id: str
    number: int
    record: dict[str, Any] = field(default_factory=dict)
    lost: str | None = None  # why the run is no longer this process's (one line), once a check found out
    beaten_at: float = field(default_factory=time.monotonic)  # when the last heartbeat was written (monotonic)
    fresh_s: float = field(default_factory=lambda: heartbeat_timeout_s() / 2)  # no listing that long after it

    @property
    def path(self) -> str:
        return lease_path(self.store, self.run_id, self.number)

    def beat(self) -> bool:
        """Refresh the heartbeat; False when another process has taken the run over since (this one's
        heartbeat stopped for longer than the timeout: a frozen or suspended process)."""
        if self.lost is not None:
            return False
        started = time.monotonic()  # another host times the heartbeat from its write: this is earlier
        newest = newest_lease_number(self.store, self.run_id)
        if newest is not None and newest > self.number:
            self._lose(newest)
            return False
        self.record["heartbeat_at"] = utc_now()
        try:  # fenced like any write of the run: a freeze between the listing above and the rename is caught
            self.store.write_small(self.path, canonical_json(self.record).encode("utf-8"), run_id=self.run_id)
        except LeaseLost:
            return False
        self.beaten_at = started
        return True

    def check(self) -> None:
        """A `LeaseLost` unless this lease is still the run's newest (one listing). Before every commit."""
        if self.lost is None:
            newest = newest_lease_number(self.store, self.run_id)
            if newest is not None and newest > self.number:
                self._lose(newest)
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def check_fresh(self) -> None:
        """`check` without its listing while this process's last heartbeat is recent (less than half the
        timeout that another host waits before it takes the run over); before every file write."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if time.monotonic() - self.beaten_at > self.fresh_s:
            self.check()

    def _lose(self, newest: int) -> None:
        owner = read_lease(self.store, self.run_id, newest)
        who = describe_owner(owner) if owner is not None else "another process"
        self.lost = (
            f"run {self.run_id!r} was taken over by {who} (lease {newest}) while this process "
            f"(lease {self.number}) sent no heartbeat; it stopped here and writes nothing more to the run"
        )

    def release(self) -> None:
        """Give the run up: any process may claim it next. A lease another process has taken over since is left
        alone: it is not this process's to end (and the newer lease file is never touched)."""
        if self.lost is not None:
            return
        newest = newest_lease_number(self.store, self.run_id)
        if newest is not None and newest > self.number:
            self._lose(newest)
            return
        self.record["released_at"] = utc_now()
        # fenced while the store still holds this lease: a freeze between the listing above and the write is caught
        self.store.write_small(self.path, canonical_json(self.record).encode("utf-8"), run_id=self.run_id)


def lease_path(store: Store, run_id: str, number: int) -> str:
    return store.path(LEASES, run_id, f"{number:06d}.json")


def newest_lease_number(store: Store, run_id: str) -> int | None:
    """The highest lease number of the run, or None when it was never claimed (one listing)."""
    directory = store.path(LEASES, run_id)
    store.fs.invalidate_cache(directory)
    try:
        names = [path.rstrip("/").rsplit("/", 1)[-1] for path in store.fs.ls(directory, detail=False)]
    except FileNotFoundError:
        return None
    numbers = [int(match.group(1)) for name in names if (match := _LEASE_RE.match(name))]
    return max(numbers, default=None)


def read_lease(store: Store, run_id: str, number: int) -> dict[str, Any] | None:
    """A lease record; None when the file is missing or not (yet) readable JSON."""
    try:
        record = json.loads(store.fs.cat_file(lease_path(store, run_id, number)))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def owner_gone(record: dict[str, Any] | None, now: datetime | None = None) -> str | None:
    """Why the owner named by a lease record no longer holds the run, or None while it does."""
    if record is None:
        return "its lease file is unreadable"
    if record.get("released_at"):
        return "released"
    pid, host = record.get("pid"), record.get("host")
    if host == socket.gethostname():
        if not pid_alive(pid):
            return f"process {pid} on {host} has ended"
        started = record.get("pid_started")
        if started is not None and isinstance(pid, int) and pid_start_time(pid) not in (None, started):
            return f"process {pid} on {host} has ended (its pid now belongs to another process)"
        return None
    beat = record.get("heartbeat_at") or record.get("claimed_at")
    try:
        age = ((now or datetime.now(UTC)) - datetime.fromisoformat(str(beat))).total_seconds()
    except (TypeError, ValueError):
        return "its lease names no time"
    if age > heartbeat_timeout_s():
        return f"no heartbeat from process {pid} on {host} for {age:.0f} s"
    return None


def current_owner(store: Store, run_id: str) -> dict[str, Any] | None:
    """The lease record of the live process that owns the run, or None when no live process does."""
    number = newest_lease_number(store, run_id)
    if number is None:
        return None
    record = read_lease(store, run_id, number)  # lease files appear whole (a link, or one PUT)
    return record if record is not None and owner_gone(record) is None else None


def live_runs(store: Store) -> dict[str, dict[str, Any]]:
    """Every run owned by a live process now, with its lease record."""
    directory = store.path(LEASES)
    store.fs.invalidate_cache(directory)
    try:
        run_ids = [path.rstrip("/").rsplit("/", 1)[-1] for path in store.fs.ls(directory, detail=False)]
    except FileNotFoundError:
        return {}
    owners = {run_id: current_owner(store, run_id) for run_id in run_ids}
    return {run_id: record for run_id, record in owners.items() if record is not None}


def describe_owner(record: dict[str, Any]) -> str:
    what = f" ({record['purpose']})" if record.get("purpose") not in (None, "run") else ""
    return f"process {record.get('pid')} on {record.get('host')}{what}, since {record.get('claimed_at')}"


def claim_run(store: Store, run_id: str, *, new: bool, purpose: str = "run") -> Lease:
    """Own `run_id` in `store`, or raise a one-line UserError naming the process that owns it.

    `new`: the run must not exist yet (`rlvr run`); otherwise the run may exist, and is taken over when its
    previous owner is gone (`rlvr resume`, `rlvr difficulty`, a cleanup). `purpose` is shown to a process
    that finds the run taken.
    """
    while True:
        number = newest_lease_number(store, run_id)
        if number is not None:
            record = read_lease(store, run_id, number)
            gone = owner_gone(record)
            if gone is None and record is not None:
                raise RunClaimed(
                    f"run {run_id!r} is already running: {describe_owner(record)}; "
                    "wait for it, or stop that process and `rlvr resume` the run"
                )
            if new:
                raise _exists(store, run_id)
        elif new and store.read_run(run_id) is not None:
            raise _exists(store, run_id)  # a run recorded before leases existed
        following = 0 if number is None else number + 1
        record = _owner_record(purpose)
        if store.create_new(lease_path(store, run_id, following), canonical_json(record).encode("utf-8")):
            return Lease(store, run_id, following, record)
        # Another process claimed this number first: look again (it may have released it already).


@contextmanager
def owning(store: Store, run_id: str, *, new: bool = False, purpose: str = "run") -> Iterator[Lease]:
    """Own the run for the duration of the block, releasing it at the end whatever happens (unless another
    process took it over meanwhile). Inside, the store fences the run's writes with the lease."""
    lease = claim_run(store, run_id, new=new, purpose=purpose)
    store.hold(run_id, lease)  # every commit of the run checks the lease from now on
    try:
        yield lease
    finally:
        try:
            lease.release()
        except (LeaseLost, OSError):
            pass  # taken over since (not this process's to end), or a full disk or lost store: it ends with the process
        finally:
            store.let_go(run_id, lease)


def _exists(store: Store, run_id: str) -> RunExists:
    return RunExists(
        f"run {run_id!r} already exists in {store.root}; continue it with `rlvr resume {run_id}`, "
        "or choose another --run-id"
    )


def _owner_record(purpose: str) -> dict[str, Any]:
    now = utc_now()
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "pid_started": pid_start_time(pid),
        "token": secrets.token_hex(8),
        "purpose": purpose,
        "claimed_at": now,
        "heartbeat_at": now,
        "released_at": None,
    }
