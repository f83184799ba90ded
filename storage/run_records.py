"""Run records (runs/RUN_ID.json): their statuses, parsing, and whether a run recorded as running is dead."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from rlvr.storage.errors import DamagedFile, unreadable_message
from rlvr.storage.processes import HEARTBEAT_TIMEOUT_ENV, heartbeat_timeout_s, pid_alive

RUN_STATUSES = ("running", "failed", "completed")


def parsed_run_record(path: str, data: bytes) -> dict[str, Any]:
    """The record in a run file's bytes; a DamagedFile naming the file when they are not one."""
    try:
        record = json.loads(data)
        if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
            raise ValueError("not a run record (a JSON object with a run_id)")
        return record
    except (ValueError, UnicodeDecodeError) as exc:
        remedy = "`rlvr resume` of the run writes it again from the run's config artifact"
        raise DamagedFile(unreadable_message("run record", path, exc, remedy)) from None


def run_death(record: Mapping[str, Any], now: datetime | None = None) -> str | None:
    """Why a run recorded as running is dead, or None: its process on this host is gone, or (any host)
    its heartbeat is older than `heartbeat_timeout_s()`. Records without a heartbeat get only the first check."""
    if record.get("status") != "running":
        return None
    pid, host = record.get("pid"), record.get("host")
    if host == socket.gethostname() and not pid_alive(pid):
        return f"process {pid} on {host} ended without finishing the run (killed or crashed)"
    beat = record.get("heartbeat_at")
    if not beat:
        return None
    try:
        age = ((now or datetime.now(UTC)) - datetime.fromisoformat(str(beat))).total_seconds()
    except (TypeError, ValueError):
        return None
    limit = heartbeat_timeout_s()
    if age > limit:
        return f"no heartbeat from process {pid} on {host} for {age:.0f} s (limit {limit:g} s, {HEARTBEAT_TIMEOUT_ENV})"
    return None


def run_status(record: Mapping[str, Any]) -> str:
    """The run's real status: a "running" run whose process is gone (`run_death`) has failed."""
    status = str(record.get("status"))
    return "failed" if run_death(record) is not None else status
