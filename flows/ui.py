"""A store's own Prefect server: Prefect's UI over the store's run history (`rlvr ui`), and the scheduler
that `rlvr schedule` needs when no PREFECT_API_URL is set.

Every run records its flows and tasks in the Prefect database of the store's Prefect home
(`<store>/_prefect/prefect.db`, written by the embedded server; see prefect_env.py). The embedded server
has neither UI nor scheduler, so this module starts `prefect server start` on that database, on
localhost, and waits until it answers. One server per store at a time: the command that starts it
writes `<store>/_prefect/server.json` (URL and process ids) and removes it when it stops; a later
`rlvr ui` or `rlvr schedule` on the same store uses the running one instead of opening the database twice.

Nothing here imports Prefect: the server is a subprocess, and the caller sets PREFECT_API_URL before
importing Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlvr.errors import UserError
from rlvr.flows.prefect_env import configure_prefect
from rlvr.flows.prefect_template import DATABASE_NAME, seed_database
from rlvr.storage.processes import pid_alive
from rlvr.storage.store import Store

SERVER_FILE = "server.json"
LOG_FILE = "server.log"


@dataclass
class StoreServer:
    """A Prefect server over a store's database: started by this process (`process`) or found running."""

    url: str
    pid: int
    home: Path
    started_by: str
    process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def stop(self) -> None:
        """Stop the server if this process started it (SIGTERM, then SIGKILL after 20 s) and forget it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        record = _read_record(self.home)
        if record is not None and record.get("pid") == self.pid:
            (self.home / SERVER_FILE).unlink(missing_ok=True)
        self.process = None


def prefect_home(store: Store) -> Path:
    """The Prefect home whose database holds this store's run history (as runs of this process use it)."""
    configure_prefect(store)
    return Path(os.environ["PREFECT_HOME"])


def running_server(home: Path) -> StoreServer | None:
    """The store's server if one is up (its process alive and answering); a stale record is removed."""
    record = _read_record(home)
    if record is None or record.get("host") != socket.gethostname():
        return None  # a server on another machine sharing the store listens on its own localhost
    if _alive(record.get("pid")) and healthy(str(record.get("url"))):
        return StoreServer(str(record["url"]), int(record["pid"]), home, str(record.get("started_by", "")))
    (home / SERVER_FILE).unlink(missing_ok=True)
    return None


def start_server(
    home: Path, *, host: str = "127.0.0.1", port: int, started_by: str, timeout: float = 180
) -> StoreServer:
    """Start `prefect server start` (UI, scheduler and the other services on) over the database in `home`."""
    if not port_free(host, port):
        raise UserError(f"port {port} on {host} is in use; choose another with --port")
    seed_database(home / DATABASE_NAME)  # a new store's database starts migrated (prefect_template.py)
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
    with open(home / LOG_FILE, "ab") as log:
        process = subprocess.Popen(
            command,
            env=server_env(home),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the rlvr command, which stops the server last
            preexec_fn=_die_with_parent,
        )
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    server = StoreServer(url, process.pid, home, started_by, process)
    try:
        _wait_until_healthy(server, timeout)
    except BaseException:
        server.stop()
        raise
    _write_record(server)
    return server


def server_env(home: Path) -> dict[str, str]:
    """The server's environment: this store's Prefect home, its UI on, no analytics, not a client of another server."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_URL")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_UI_ENABLED="true",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    return env


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ui_url_of(api_url: str) -> str:
    """Prefect's UI lives at the server's root; its API under /api."""
    return api_url.rstrip("/").removesuffix("/api")


def _wait_until_healthy(server: StoreServer, timeout: float) -> None:
    assert server.process is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise UserError(
                f"the Prefect server exited at start (status {server.process.returncode}): "
                f"{_last_log_line(server.home)} (log: {server.home / LOG_FILE})"
            )
        if healthy(server.url):
            return
        time.sleep(0.5)
    log = server.home / LOG_FILE
    raise UserError(f"the Prefect server at {server.url} did not answer within {timeout:.0f} s (log: {log})")


def _last_log_line(home: Path) -> str:
    try:
        lines = [line.strip() for line in (home / LOG_FILE).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def _read_record(home: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((home / SERVER_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _write_record(server: StoreServer) -> None:
    record = {
        "url": server.url,
        "host": socket.gethostname(),
        "pid": server.pid,
        "owner_pid": os.getpid(),
        "started_by": server.started_by,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    temporary = server.home / f".{SERVER_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(record, indent=2))
    temporary.replace(server.home / SERVER_FILE)


def _alive(pid: Any) -> bool:
    """Whether the server's recorded process runs here (an unusable pid counts as gone: start a new server)."""
    return isinstance(pid, int) and pid > 0 and pid_alive(pid)
    return True


def _die_with_parent() -> None:
    """In the server's process before exec: on Linux, get SIGTERM when the process that started it dies
    (even by SIGKILL), so no orphaned server keeps the store's database open."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


@dataclass
class PrefectTarget:
    """Where this process's Prefect talks to for a store: a server given by PREFECT_API_URL, the store's
    running server, one to start on `port` (its URL is set already), or Prefect's embedded server (None)."""

    api_url: str | None
    home: Path
    port: int | None = None
    origin: str = "Prefect's embedded server"

    def start(self, started_by: str) -> StoreServer | None:
        """Start the planned server (None when there is none to start); the caller stops it."""
        if self.port is None:
            return None
        return start_server(self.home, port=self.port, started_by=started_by)


def point_prefect_at_store(store: Store, *, need_server: bool) -> PrefectTarget:
    """Set PREFECT_API_URL for the store before Prefect is imported. `need_server`: a real server is needed
    (a scheduler), so when neither PREFECT_API_URL nor a running store server exists, plan one on a free
    port and point there already (start it with `.start()`), so config errors show before it starts."""
    home = prefect_home(store)
    given = os.environ.get("PREFECT_API_URL")
    if given:
        return PrefectTarget(given, home, origin="PREFECT_API_URL")
    found = running_server(home)
    if found is not None:
        os.environ["PREFECT_API_URL"] = found.api_url
        return PrefectTarget(found.api_url, home, origin=f"the store's server, started by {found.started_by}")
    if not need_server:
        return PrefectTarget(None, home)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    os.environ["PREFECT_API_URL"] = api_url
    return PrefectTarget(api_url, home, port, origin="started on the store's Prefect database; its UI is there")


def serve_ui(store: Store, *, host: str, port: int, say: Callable[[str], None]) -> None:
    """`rlvr ui`: Prefect's UI over the store's run history until interrupted (or the URL of one already up)."""
    api = os.environ.get("PREFECT_API_URL")
    if api:
        say(f"runs of this store are recorded on the Prefect server at {api}; its UI: {ui_url_of(api)}")
        return
    home = prefect_home(store)
    found = running_server(home)
    if found is not None:
        say(f"Prefect UI for {store.root}: {found.url} (already running, started by {found.started_by})")
        return
    if not (home / "prefect.db").exists():
        say(f"note: no Prefect database in {home} yet; the UI starts empty and shows the runs made from now on")
    server = start_server(home, host=host, port=port, started_by="rlvr ui")
    say(f"Prefect UI for {store.root}: {server.url}  (API {server.api_url}; database {home / 'prefect.db'})")
    say("press Ctrl-C to stop it")
    try:
        with sigterm_as_interrupt():
            assert server.process is not None
            server.process.wait()
            raise UserError(f"the Prefect server stopped (status {server.process.returncode}); see {home / LOG_FILE}")
    except KeyboardInterrupt:
        say("stopping the Prefect server")
    finally:
        server.stop()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt, so a stopped command cleans up as after Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
