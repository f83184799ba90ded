"""Whose work is it: live processes on this host, host tags in temp file names, a dead writer's temp files,
and the heartbeat timeout."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from functools import lru_cache
from typing import Any

from rlvr.child_guard import start_time
from rlvr.errors import UserError

TMP_MARK = ".tmp-"
TMP_RE = re.compile(r"\.tmp-(?:([0-9a-f]{8})-)?(\d+)-[0-9a-f]+$")  # host tag (absent in older stores), pid


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` exists on this host (an unknown pid counts as alive: trust the record)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: the process exists but belongs to someone else
        return True
    return True


def pid_start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux /proc), to tell a pid reused by a new
    process from the one recorded; None where that cannot be read (another OS, a process gone or a zombie)."""
    return start_time(pid)


@lru_cache(maxsize=1)
def host_tag() -> str:
    """8 hex digits naming this host in temp file names (a hostname may hold any character)."""
    return hashlib.sha256(socket.gethostname().encode("utf-8")).hexdigest()[:8]


def mtime_of(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return time.time()


def temp_writer_gone(name: str, mtime: float) -> bool:
    """Whether a file named `name` is a temp file (`_write_temp`) whose writer will never rename it: its
    process is gone from this host, or (another host, or a name from before host tags) it has not changed
    for longer than the heartbeat timeout. No store write lasts that long."""
    match = TMP_RE.search(name)
    if match is None:
        return False
    host, pid = match.group(1), int(match.group(2))
    if host == host_tag() and not pid_alive(pid):
        return True
    return time.time() - mtime > heartbeat_timeout_s()


HEARTBEAT_TIMEOUT_ENV = "RLVR_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 600.0


def seconds_from_env(name: str, default: float) -> float:
    """A duration in seconds from the environment variable `name` (default when unset); > 0, else a UserError."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{name}={raw!r}: give a number of seconds greater than 0")
    return value


def heartbeat_timeout_s() -> float:
    """How long a running run may go without a heartbeat before it counts as dead (RLVR_HEARTBEAT_TIMEOUT_S)."""
    return seconds_from_env(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S)
