"""Fencing: a process that has lost its run to another process writes nothing more to it.

The store checks the writer's lease number before every commit (storage/leases.py): on a local store here and on
S3 in test_s3_store.py (`check_fencing` runs on both). Then two real processes race on one run: `rlvr run` is
frozen (SIGSTOP) halfway through an RL step, a second process on "another host" (its hostname patched) takes the
run over with `rlvr resume` once the heartbeat is older than the timeout, and the frozen one is thawed while the
new owner writes. Every file operation of the old process is logged (its os and open calls, patched); none may
come after the freeze, every manifest and the run record written since carry the new owner's lease number, and
the old process exits with status 2 and one line naming the run and its new owner. Both processes are forked by
one interpreter per module that already imported what a run imports (ForkServer): each is still a process of its
own, with its pid, signals and exit status, without ~7 CPU-seconds of imports apiece.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rlvr.storage.ids import canonical_json
from rlvr.storage.leases import LeaseLost, claim_run, lease_path, newest_lease_number, owning
from rlvr.storage.manifest import Manifest
from rlvr.storage.processes import TMP_MARK, TMP_RE
from rlvr.storage.store import Store
from tests.cli_helpers import FolderChanges, cli_env, committed, store_folders, wait_for
from tests.fork_server import ForkServer, fork_server

RUN_ID = "raced"
OTHER_HOST = "another-host"


def take_over(store: Store, run_id: str, number: int, pid: int = 4242) -> None:
    """What `claim_run` in a process on another host writes once it judged the owner gone: the next lease."""
    record = {"pid": pid, "host": OTHER_HOST, "purpose": "run", "claimed_at": "2026-12-01T00:00:00+00:00"}
    assert store.create_new(lease_path(store, run_id, number), canonical_json(record).encode("utf-8"))


def write(store: Store, aid: str, run_id: str = "r") -> Manifest:
    table = pa.table({"x": [1, 2, 3]})
    return store.write_artifact(
        "test_rows", aid, table, run_id=run_id, stage="t", parents=[], code_version="1", config={}
    )


def store_files(store: Store) -> dict[str, bytes]:
    """Every file of the store and its bytes (lease files included)."""
    return {path: bytes(store.fs.cat_file(path)) for path in sorted(store.fs.find(store.root))}


def check_fencing(store: Store) -> None:
    """The lease checks of one store (local or S3): commits carry the lease number; after a takeover, a batch,
    a background batch, a single commit, a shard, a file and the run record all fail with one line, and
    nothing of them appears; the lost lease is not released; a commit costs one listing, not one per file."""
    with owning(store, "r") as lease:
        assert lease.number == 0 and store.lease_number("r") == 0
        assert write(store, "a-1").lease == 0 and Store.open(store.root).manifest("a-1").lease == 0
        assert store.write_run({"run_id": "r", "status": "running"})["lease"] == 0
        assert write(store, "other-1", run_id="unowned").lease is None  # a run this process holds no lease on

        with store.batch(background=True):
            write(store, "a-2")
        store.wait()
        taken = store.write_run({"run_id": "r", "status": "running"})

        with pytest.raises(LeaseLost) as caught, store.batch():
            write(store, "a-3")
            take_over(store, "r", 1)  # while the batch is open: its data is written, its commit is refused
            write(store, "a-4")
        line = str(caught.value)
        assert "\n" not in line and line.startswith("run 'r' was taken over by process 4242 on another-host")
        assert lease.lost == line
        assert not any(s.exists(aid) for s in (store, Store.open(store.root)) for aid in ("a-3", "a-4"))
        before = store_files(store)  # with the uncommitted data of a-3 and a-4, for the new owner's cleanup
        for attempt in (
            lambda: write(store, "a-5"),
            lambda: store.write_run({"run_id": "r", "status": "failed"}),
            lambda: store.writer("test_rows", "s-1", **sharded_fields()).write_shard(0, pa.table({"x": [1]})),
            lambda: store.writer("test_rows", "s-2", **sharded_fields()).add_file("w.bin", b"w"),
            lambda: store.delete_artifact("a-1"),
        ):
            with pytest.raises(LeaseLost):
                attempt()
        with pytest.raises(LeaseLost), store.batch(background=True):
            write(store, "a-6")
        assert store_files(store) == before  # not a byte changed: no manifest, no data file, no record, no lease
        assert write(store, "other-2", run_id="unowned").lease is None  # other runs are not this run's lease's
    assert store.lease_number("r") is None
    assert json.loads(store.fs.cat_file(lease_path(store, "r", 0)))["released_at"] is None  # not its to release
    assert Store.open(store.root).read_run("r") == taken

    # A process frozen past the timeout finds out at its next write, before it writes (no heartbeat came).
    with owning(store, "q") as lease:
        take_over(store, "q", 1)
        lease.beaten_at -= lease.fresh_s + 1
        with pytest.raises(LeaseLost):
            write(store, "q-1", run_id="q")
        assert not store.fs.exists(store.artifact_dir("test_rows", "q-1"))


def sharded_fields() -> dict[str, Any]:
    return {"run_id": "r", "stage": "t", "parents": [], "code_version": "1", "config": {}}


def test_commits_check_the_lease_on_a_local_store(tmp_path: Path) -> None:
    check_fencing(Store.open(str(tmp_path / "store"), create=True))


def test_a_batch_commit_costs_one_listing_of_the_leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr.storage import leases

    store = Store.open(str(tmp_path / "store"), create=True)
    listings = [0]

    def counted(*args: Any) -> int | None:
        listings[0] += 1
        return newest_lease_number(*args)

    with owning(store, "r"):
        monkeypatch.setattr(leases, "newest_lease_number", counted)
        for background in (False, True):
            listings[0] = 0
            with store.batch(background=background):
                for i in range(8):
                    store.write_artifact(
                        "test_rows",
                        f"b-{background}-{i}",
                        pa.table({"x": [i]}),
                        files={"w.bin": b"w"},
                        run_id="r",
                        stage="t",
                        parents=[],
                        code_version="1",
                        config={},
                    )
            store.wait()
            assert listings[0] == 1


def test_a_heartbeat_frozen_between_its_listing_and_its_write_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat thread lists the leases, is frozen past the timeout, the run is taken over, and it thaws:
    its write is fenced like any other, so its own old lease file is left as it was (CI caught this once)."""
    from rlvr.storage import leases

    store = Store.open(str(tmp_path / "store"), create=True)
    with owning(store, "r") as lease:
        listed = lease_path(store, "r", 0)
        before = store.fs.cat_file(listed)
        calls = [0]

        def frozen_after_listing(*args: Any) -> int | None:
            newest = newest_lease_number(*args)
            calls[0] += 1
            if calls[0] == 1:  # the beat's own listing: the owner is still this one, then the freeze
                take_over(store, "r", 1)
                lease.beaten_at -= lease.fresh_s + 1
            return newest

        monkeypatch.setattr(leases, "newest_lease_number", frozen_after_listing)
        assert lease.beat() is False
        assert lease.lost is not None and lease.lost.startswith("run 'r' was taken over by process 4242")
        assert store.fs.cat_file(listed) == before


def test_a_release_frozen_after_its_listing_leaves_the_taken_lease_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of `owning` lists the leases, is frozen past the timeout, the run is taken over, and it thaws: the
    release is fenced like any write, so the lease file stays as it was (never marked released) and the block
    ends without an error."""
    from rlvr.storage import leases

    store = Store.open(str(tmp_path / "store"), create=True)
    with owning(store, "r") as lease:
        before = store.fs.cat_file(lease.path)

        def frozen_after_listing(*args: Any) -> int | None:
            newest = newest_lease_number(*args)
            if newest == 0:  # release's own listing: the owner is still this one, then the freeze
                take_over(store, "r", 1)
                lease.beaten_at -= lease.fresh_s + 1
            return newest

        monkeypatch.setattr(leases, "newest_lease_number", frozen_after_listing)
    assert store.fs.cat_file(lease.path) == before and json.loads(before)["released_at"] is None
    assert lease.lost is not None and store.lease_number("r") is None
    assert [p.name for p in tmp_path.rglob("*.tmp-*")] == []


def test_a_process_frozen_while_it_writes_a_temp_file_removes_it_at_the_failed_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen between opening a temp file and renaming it, taken over, thawed: the check before the rename fails
    and the temp file goes with it, for a small file (the heartbeat's, the run record's) and an artifact's part
    (CI caught a thawed heartbeat's temp file left in leases/<run>/)."""
    store = Store.open(str(tmp_path / "store"), create=True)
    written = Store._write_temp
    leases_held: list[Any] = []

    def frozen_while_writing(path: str, data: bytes, sync: bool) -> str:
        tmp = written(path, data, sync)
        if leases_held:  # the freeze, once: the run is taken over meanwhile
            lease = leases_held.pop()
            take_over(store, lease.run_id, 1)
            lease.beaten_at -= lease.fresh_s + 1
        return tmp

    monkeypatch.setattr(Store, "_write_temp", staticmethod(frozen_while_writing))
    with owning(store, "r") as lease:
        before = store.fs.cat_file(lease.path)
        leases_held.append(lease)
        with pytest.raises(LeaseLost):
            store.write_small(lease.path, b"{}", run_id="r")
        assert store.fs.cat_file(lease.path) == before
    with owning(store, "s") as lease:
        leases_held.append(lease)
        with pytest.raises(LeaseLost):
            write(store, "s-1", run_id="s")
    assert not leases_held and [p.name for p in tmp_path.rglob("*.tmp-*")] == []
    assert not list((tmp_path / "store" / "artifacts").rglob("part-*"))


def test_a_manifest_written_before_leases_were_recorded_still_reads() -> None:
    manifest = Manifest("a", "k", "r", "s", None, 0, "", [], [], "1", {}, "2026-01-01", 0.0)
    text = json.loads(manifest.to_json())
    del text["lease"]
    assert Manifest.from_file("m.json", json.dumps(text)).lease is None
    assert claim_run  # (imported for the docstring's reader: the claim the takeovers below imitate)


# ----- two real processes --------------------------------------------------------------------------------


_audit: dict[str, Any] = {}  # where the patched file calls log to: the store's root and the log's descriptor


def install_write_audit(root: str, log: str) -> None:
    """In the process under test: log every call that creates, changes or removes a file under `root` (its time,
    pid, the call and the path) to `log`, through os.write on a descriptor opened now (one append per call)."""
    patch_file_calls()
    _audit["fd"] = _audit["os.open"](log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    _audit["root"] = os.path.abspath(root)


def patch_file_calls() -> None:
    """Wrap the calls that write files (open, os.*, shutil.rmtree) to log them once `install_write_audit` names the
    log; until then they log nothing. Done before the run's modules are imported, so a name bound at their import
    (`from os import replace`) is the wrapper too."""
    if "os.open" in _audit:
        return
    _audit["os.open"] = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def note(what: str, path: Any) -> None:
        root = _audit.get("root")
        if root is None:
            return
        try:
            text = os.fsdecode(path)
        except TypeError:
            return
        if os.path.abspath(text).startswith(root):
            os.write(_audit["fd"], f"{time.time():.6f} {os.getpid()} {threading.get_ident()} {what} {text}\n".encode())

    def logged(what: str, call: Callable[..., Any], *, path_arg: int = 0, when: Callable[..., bool] | None = None):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > path_arg and (when is None or when(*args, **kwargs)):
                note(what, args[path_arg])
            return call(*args, **kwargs)

        return wrapper

    def writes(_path: Any, mode: str = "r", *_: Any, **kwargs: Any) -> bool:
        mode = kwargs.get("mode", mode)
        return isinstance(mode, str) and any(flag in mode for flag in "wax+")

    opener = logged("open", builtins.open, when=writes)
    builtins.open = io.open = opener  # type: ignore[assignment]
    os.open = logged("os.open", os.open, when=lambda _p, flags, *a, **k: bool(flags & write_flags))  # type: ignore
    for name in ("remove", "unlink", "rmdir", "mkdir", "truncate", "utime"):
        setattr(os, name, logged(f"os.{name}", getattr(os, name)))
    for name in ("replace", "rename", "link"):
        setattr(os, name, logged(f"os.{name}", getattr(os, name), path_arg=1))  # the name it makes
    shutil.rmtree = logged("rmtree", shutil.rmtree)  # type: ignore[assignment]


def child_setup(spec: dict[str, Any]) -> None:
    """In a forked `rlvr` process (tests/fork_server.py), before it runs: with `audit` (a store's root, a log) its
    file calls under that root are logged; with `host`, that is its hostname (nothing in the imports read it)."""
    if spec.get("audit"):
        install_write_audit(*spec["audit"])
    if spec.get("host"):
        socket.gethostname = lambda: spec["host"]


STEPS = 4  # the takeovers land in steps 1 and 3; the new owner then finishes the run
OVERRIDES = [
    f"train.steps={STEPS}",
    "select.batch_size=2",
    "allocate.n=2",
    "warmstart.steps=2",
    "difficulty.k=1",
    "difficulty.shard_size=8",
    "evaluate.every=4",
    "checkpoint.every=4",
    "synthesize.source.per_category=3",
]
TIMEOUT_S = 4.0  # RLVR_HEARTBEAT_TIMEOUT_S of both processes: the frozen one is taken over after that


def uncommitted(store: Path, kinds: tuple[str, ...] = ()) -> bool:
    """Whether an artifact folder (of `kinds`, or any) has no manifest yet: written, not committed."""
    manifests = {name.removesuffix(".json") for name in os.listdir(store / "manifests")}
    folders = [store / "artifacts" / kind for kind in kinds] if kinds else (store / "artifacts").iterdir()
    return any(f.name not in manifests for folder in folders if folder.is_dir() for f in folder.iterdir())


MOMENTS = {
    # the group commit of the first RL step: its train_steps manifest is in, others of the group are not yet
    "in_the_step_commit": lambda store: committed(store, "train_steps") >= 1 and uncommitted(store),
    # a later step between its sampling and its update: its rollouts are written, not committed
    "between_sampling_and_update": lambda store: (
        committed(store, "train_steps") >= 2 and uncommitted(store, ("rollouts",))
    ),
}


def process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


@pytest.fixture(scope="module")
def rlvr_processes(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """The module's ForkServer, on the session's Prefect server, with heartbeats every 0.2 s and the timeout."""
    env = cli_env(PREFECT_API_URL=prefect_api, RLVR_HEARTBEAT_S="0.2", RLVR_HEARTBEAT_TIMEOUT_S=str(TIMEOUT_S))
    folder = tmp_path_factory.mktemp("fork-server")
    # the file calls wrapped before the run's modules are imported, dormant until a child names its log
    yield from fork_server(
        env, folder, prepare="tests.test_fencing:patch_file_calls", child="tests.test_fencing:child_setup"
    )


@pytest.mark.slow
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_run_taken_over_halfway_through_a_step_writes_nothing_after(
    tmp_path: Path, rlvr_processes: ForkServer, moment: str
) -> None:
    store, audit = tmp_path / "store", tmp_path / "old-writes.log"
    args = ["run", "--store", str(store), "--run-id", RUN_ID] + [a for o in OVERRIDES for a in ("--set", o)]
    old_err = tmp_path / "old.err"
    old = rlvr_processes.start(args, stderr=old_err, audit=[str(store), str(audit)])
    try:
        deadline = time.monotonic() + 300
        with FolderChanges() as changes:  # checked at each change of the folders the moments read: steps are short
            changes.watch(store_folders(store, "rollouts"))
            while not ((store / "manifests").exists() and MOMENTS[moment](store)):
                assert old.poll() is None, old_err.read_text()
                assert time.monotonic() < deadline, "the run never got halfway through an RL step"
                changes.wait(every=0.05)
                changes.watch(store_folders(store, "rollouts"))
        old.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(old.pid) == "T", 10, "the run to stop", every=0.01)
        frozen_at = time.time()  # nothing the old process does can happen between its freeze and its thaw
        frozen_step = committed(store, "train_steps")

        time.sleep(TIMEOUT_S + 0.5)  # its heartbeat is now older than the timeout: another host may take over
        new_err = tmp_path / "new.err"
        new = rlvr_processes.start(["resume", RUN_ID, "--store", str(store)], stderr=new_err, host=OTHER_HOST)
        s = Store.open(str(store))
        wait_for(lambda: newest_lease_number(s, RUN_ID) == 1, 120, "the takeover", log=new_err)
        wait_for(
            lambda: new.poll() is not None or committed_since(store, frozen_at),
            120,
            "the new owner's first commit",
            log=new_err,
            every=0.05,
        )
        old.send_signal(signal.SIGCONT)  # thawed while the new owner writes
        assert old.wait(timeout=60) == 2, old_err.read_text()
        assert new.wait(timeout=600) == 0, new_err.read_text()
    finally:
        for proc in [old] + ([new] if "new" in locals() else []):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()

    errors = [line for line in old_err.read_text().splitlines() if line.startswith(("error:", "warning:"))]
    assert len(errors) == 1 and "Traceback" not in old_err.read_text(), old_err.read_text()
    assert errors[0].startswith(f"error: run {RUN_ID!r} was taken over by process {new.pid} on {OTHER_HOST}")

    # The old process: no file created, changed or removed after its freeze, but for what each of its threads that
    # writes (the run's, its heartbeat's) had in flight past a lease check when it froze (see in_flight).
    writes = [line.split(" ", 4) for line in audit.read_text().splitlines()]
    assert writes and {int(w[1]) for w in writes} >= {old.pid}
    late = [w for w in writes if float(w[0]) > frozen_at]
    early = [w for w in writes if float(w[0]) <= frozen_at]
    by_thread: dict[tuple[str, str], list[list[str]]] = {}
    for w in late:
        by_thread.setdefault((w[1], w[2]), []).append(w)
    assert all(in_flight(calls, early, old.pid) for calls in by_thread.values()), (
        f"old process {old.pid}, frozen at {frozen_at}, wrote after: " + "; ".join(" ".join(w) for w in late[:10])
    )

    # Every manifest and the run record written since the freeze carry the new owner's lease; the rest the old's.
    s = Store.open(str(store))
    manifests = s.manifests(run_id=RUN_ID)
    since = [m for m in manifests if os.stat(s.manifest_path(m.artifact_id)).st_mtime > frozen_at]
    assert since and {m.lease for m in since} == {1}
    assert {m.lease for m in manifests if m not in since} == {0}
    record = s.read_run(RUN_ID)
    assert (record["status"], record["lease"], record["pid"], record["host"]) == ("completed", 1, new.pid, OTHER_HOST)
    assert committed(store, "train_steps") == STEPS > frozen_step
    # The old lease file is as the freeze left it (never released, never touched); the new one was released.
    old_lease, new_lease = (json.loads(Path(lease_path(s, RUN_ID, n)).read_text()) for n in (0, 1))
    assert old_lease["released_at"] is None and os.stat(lease_path(s, RUN_ID, 0)).st_mtime <= frozen_at
    assert (new_lease["pid"], new_lease["host"]) == (new.pid, OTHER_HOST) and new_lease["released_at"]
    # A temp file left anywhere is the new owner's or older than the freeze.
    for path in store.rglob("*.tmp-*"):
        assert path.stat().st_mtime <= frozen_at or temp_writer(path.name) == new.pid, path
    assert socket.gethostname() != OTHER_HOST


def in_flight(calls: list[list[str]], early: list[list[str]], pid: int) -> bool:
    """Whether one thread's writes after the freeze are what a freeze can leave in flight past the lease check before
    them, touching no committed file: a new artifact folder's `_owner.json` whose folder it made before the freeze
    (the lease was checked before both); its own temp file, opened or not yet, removed once the check at the thaw
    failed (the check before the rename); or the rename of the temp file it wrote last before the freeze, when the
    freeze fell between the check and the rename (storage/leases.py: a publishing call in flight completes)."""
    if {int(c[1]) for c in calls} != {pid}:
        return False
    names = [c[3] for c in calls]
    paths = {c[4] for c in calls}
    if names == ["open"] and calls[0][4].endswith("/_owner.json"):
        return ["os.mkdir", os.path.dirname(calls[0][4])] in [w[3:] for w in early]
    if names == ["os.replace"]:
        thread = [w for w in early if w[1:3] == calls[0][1:3]]
        if not thread or thread[-1][3] != "open":
            return False
        temp = thread[-1][4]
        return temp.startswith(calls[0][4] + TMP_MARK) and temp_writer(Path(temp).name) == pid
    own_temp = len(paths) == 1 and temp_writer(Path(paths.pop()).name) == pid
    return own_temp and names in (["os.remove"], ["os.unlink"], ["open", "os.remove"], ["open", "os.unlink"])


def temp_writer(name: str) -> int | None:
    """The pid in a temp file's name (storage/processes.py's TMP_RE), None for another file."""
    match = TMP_RE.search(name)
    return int(match.group(2)) if match else None


def committed_since(store: Path, moment: float) -> bool:
    """Whether a manifest was committed after `moment`."""
    for path in (store / "manifests").iterdir():
        try:
            if path.suffix == ".json" and path.stat().st_mtime > moment:
                return True
        except FileNotFoundError:
            continue
    return False


def test_what_a_thawed_thread_may_have_left_in_flight() -> None:
    """in_flight, the real-process tests' judge of the old process's late writes, on logs of one thread."""
    tmp = "/s/runs/raced.json.tmp-5bce98f7-7-4359a482"
    owner = "/s/artifacts/rollouts/a1/_owner.json"
    late = lambda *calls: [["2.0", "7", "1", call, path] for call, path in calls]  # noqa: E731
    early = [["1.0", "7", "1", "os.mkdir", "/s/artifacts/rollouts/a1"]]
    assert in_flight(late(("open", tmp), ("os.remove", tmp)), early, 7)  # opened, then removed at the failed check
    assert in_flight(late(("os.remove", tmp)), early, 7)
    assert in_flight(late(("open", owner)), early, 7)
    assert not in_flight(late(("open", tmp)), early, 7)  # left behind
    assert not in_flight(late(("open", tmp), ("os.replace", "/s/runs/raced.json")), early, 7)  # published
    assert not in_flight(late(("open", owner)), [], 7)  # its folder was not made before the freeze
    assert not in_flight(late(("os.remove", tmp)), early, 8)  # another process's temp file
    opened = [["1.5", "7", "1", "open", tmp]]
    assert in_flight(late(("os.replace", "/s/runs/raced.json")), early + opened, 7)  # frozen after its check
    assert not in_flight(late(("os.replace", "/s/runs/raced.json")), opened + early, 7)  # not its last write
    assert not in_flight(late(("os.replace", "/s/runs/other.json")), early + opened, 7)  # another file
    assert not in_flight(late(("os.replace", "/s/runs/raced.json")), [["1.5", "7", "2", "open", tmp]], 7)  # thread
    two = late(("os.replace", "/s/runs/raced.json"), ("os.replace", "/s/runs/raced.json"))
    assert not in_flight(two, early + opened, 7)  # a second write after the thaw
