"""flow.sampler=process: the worker process that samples beside the trainer (flows/sampler_process.py), the
in-place weight reload it samples each new policy with (trainer/checkpoints.py `reloaded_policy`), and a run
whose steps are sampled there: the same artifacts and weights as with the sampler on a thread, up to k steps
ahead with the staleness bound held on every row."""

from __future__ import annotations

import ast

import pytest
import torch
from safetensors.torch import load as safetensors_load

from rlvr.errors import UserError
from rlvr.flows.config import load_config
from rlvr.flows.rl_step import StepRefs
from rlvr.flows.run_preflight import check_async
from rlvr.flows.sampler_process import SamplerDied, WorkerProcess
from rlvr.flows.step_loop import Lag
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer import checkpoints
from rlvr.trainer.checkpoints import _load_in_place, _plain_weights, source_checkpoint
from rlvr.trainer.policy import PolicyConfig, init_policy, policy_files
from tests.cli_helpers import rlvr
from tests.conftest import TINY_OVERRIDES
from tests.fork_server import ForkServer
from tests.sampler_jobs import Doubler


def test_worker_answers_queued_jobs_in_order_and_raises_what_a_job_raised():
    worker = WorkerProcess(Doubler, (1,), name="test-worker")
    try:
        for job in (1, 2, "fail", 3, "user", 4):
            worker.submit(job)
        assert worker.pending == 6
        assert [worker.result(), worker.result()] == [3, 5]
        with pytest.raises(RuntimeError, match="ValueError: no such number"):
            worker.result()
        assert worker.result() == 7  # a failed job does not stop the worker
        with pytest.raises(UserError, match="^a one-line reason$"):
            worker.result()
        assert worker.result() == 9 and worker.pending == 0
        worker.submit("exit")
        with pytest.raises(SamplerDied, match="exit code 7"):
            worker.result()
    finally:
        worker.close()


def test_a_killed_worker_is_named_by_its_signal_whether_sent_to_or_read_from():
    """SIGKILL (what the out-of-memory killer sends) with a job queued: reading its answer and queueing the next
    one both raise SamplerDied naming the signal, not a bare pipe error."""
    worker = WorkerProcess(Doubler, (1,), name="test-worker")
    try:
        worker.submit("kill")  # dies mid-job: the read sees it
        with pytest.raises(SamplerDied, match=r"^the sampler process was killed by SIGKILL \(the kernel's out-of"):
            worker.result()
        with pytest.raises(SamplerDied, match="killed by SIGKILL"):
            for _ in range(1000):  # a send fills the dead pipe's buffer or meets its reset
                worker.submit(list(range(10_000)))
    finally:
        worker.close()


def test_lag_names_the_sampling_policy_up_to_k_steps_back():
    refs = StepRefs(problems=("p",), difficulty="d", policy_ref="P1", start_ref="P1")
    lag = Lag(2, 1, refs)
    assert [(s.policy_ref, s.staleness) for s in map(lag.sampler, (1, 2, 3))] == [("P1", 0), ("P1", 1), ("P1", 2)]
    assert lag.sampler(4) is None  # the policy entering step 2 is not trained yet
    assert lag.trained(1, "P2") == ("P1",)
    assert (lag.sampler(4).policy_ref, lag.sampler(4).staleness) == ("P2", 2)
    assert lag.trained(2, "P3") == ("P1", "P2")
    assert lag.trained(3, "P4") == ("P2", "P3")  # P1 is read by no later step
    # a later subflow starts from those: the same sampler for each step
    later = Lag(2, 4, StepRefs(problems=("p",), difficulty="d", policy_ref="P4", start_ref="P1", earlier=("P2", "P3")))
    assert [later.sampler(s).policy_ref for s in (4, 5, 6)] == ["P2", "P3", "P4"]


def test_weights_reload_in_place_and_refuse_what_they_do_not_cover():
    target, source = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    weights = safetensors_load(policy_files(source)["model.safetensors"])
    assert "lm_head.weight" not in weights  # tied: stored once, as save_pretrained does
    assert _load_in_place(target.model, weights)
    for (name, mine), theirs in zip(target.model.named_parameters(), source.model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()
    partial = {name: t for name, t in weights.items() if "layers.0.mlp" not in name}
    assert not _load_in_place(target.model, partial)
    assert not _load_in_place(target.model, {**weights, "extra.weight": torch.zeros(1)})


def module_level_imports(name: str, path) -> set[str]:
    """The modules a file imports when it is imported: what its top-level import statements name (the import
    contract's reading of them); those inside functions or under `if TYPE_CHECKING:` run later, if ever."""
    from tests.test_import_contract import imported_names

    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = ast.Module(
        body=[node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)], type_ignores=[]
    )
    return imported_names(top, name, path.name == "__init__.py")


def test_the_sampler_processs_module_imports_no_prefect():
    """Everything importing flows/sampling_server.py imports, followed through the package's modules (and the
    packages' faces): no Prefect, which the process never uses (it runs its stages in place) and which costs
    about 1.7 CPU-s a sampler process."""
    from tests.test_import_contract import modules

    files = {name: path for name, (_, path) in modules().items()}
    seen, todo, outside = set(), ["rlvr.flows.sampling_server"], set()
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for module in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):  # rlvr.flows, rlvr.flows.x, ...
            if module in files and module not in seen:
                seen.add(module)
                imported = module_level_imports(module, files[module])
                todo += [n for n in imported if n.startswith("rlvr.")]
                outside |= {n.split(".")[0] for n in imported if not n.startswith("rlvr")}
    assert "rlvr.flows.rl_step" in seen and "rlvr.flows.stages" in seen  # the stages it runs
    assert "prefect" not in outside, sorted(
        m for m in seen if any(n.startswith("prefect") for n in module_level_imports(m, files[m]))
    )


def test_a_process_sampler_needs_a_store_another_process_can_open():
    cfg = load_config(None, ["run_id=a", "flow.async_level=1"])
    with pytest.raises(UserError, match="flow.sampler=process needs a store another process can open"):
        check_async(cfg, "memory://runs")
    check_async(load_config(None, ["run_id=a", "flow.async_level=1", "flow.sampler=thread"]), "memory://runs")
    assert "sampler" not in load_config(None, ["run_id=a", "flow.sampler=process"]).flow.model_dump()


def _run(store: str, forks: ForkServer, *extra: str) -> None:
    sets = [arg for o in (*TINY_OVERRIDES, *extra) for arg in ("--set", o)]
    done = rlvr("run", "--store", store, "--run-id", "a", *sets, forks=forks)
    assert done.returncode == 0, done.stderr


def _weights(root: str) -> bytes:
    store = Store.open(root)
    final = query(store, "SELECT artifact_id FROM checkpoints ORDER BY step DESC LIMIT 1").to_pylist()[0]
    return store.read_file(final["artifact_id"], "model.safetensors")


@pytest.mark.slow
def test_process_and_thread_samplers_commit_the_same_run(tmp_path, rlvr_forks):
    """The process sampler's run through `rlvr run`; the thread sampler's in this process (`execute`, what the
    command calls), which spares a second interpreter's imports (about 8 CPU-seconds)."""
    from rlvr.flows.runs import execute

    process, thread = str(tmp_path / "process"), str(tmp_path / "thread")
    _run(process, rlvr_forks, "flow.async_level=1")
    execute(thread, load_config(None, ["run_id=a", *TINY_OVERRIDES, "flow.async_level=1", "flow.sampler=thread"]))
    ids = lambda root: sorted(m.artifact_id for m in Store.open(root).manifests() if m.kind != "runs")  # noqa: E731
    assert ids(process) == ids(thread)
    assert _weights(process) == _weights(thread)


@pytest.mark.slow
def test_level_2_samples_two_steps_ahead_within_the_bound(tmp_path, rlvr_forks, monkeypatch):
    store = str(tmp_path / "store")
    _run(store, rlvr_forks, "flow.async_level=2")
    sql = (
        "SELECT r.step, min(r.staleness) AS low, max(r.staleness) AS high, any_value(t.step) AS sampler_step "
        "FROM rollouts r LEFT JOIN train_steps t ON r.policy_id = t.policy_id GROUP BY r.step ORDER BY r.step"
    )
    rows = query(Store.open(store), sql).to_pylist()
    # step s is sampled by the policy entering step max(1, s - 2): trained by step s - 3 from step 4 on
    assert [(r["step"], r["low"], r["high"], r["sampler_step"]) for r in rows] == [
        (1, 0, 0, None),
        (2, 1, 1, None),
        (3, 2, 2, None),
        (4, 2, 2, 1),
        (5, 2, 2, 2),
        (6, 2, 2, 3),
    ]
    # what the sampler process copies into its model in place: the newest stored state's weights file alone
    store_ = Store.open(store)
    newest = query(store_, "SELECT policy_id FROM train_steps ORDER BY step DESC LIMIT 1").to_pylist()[0]
    weights = _plain_weights(store_, newest["policy_id"])
    assert weights is not None and "model.embed_tokens.weight" in weights
    # the chain's checkpoint, walked once (a manifest a step), then remembered for every policy on the chain
    initial = store_.manifest(trained_policy(store_, step=1)).extra["stage_run"]["inputs"]["policy"][0]
    assert store_.manifest(initial).kind == "checkpoints"  # the warm start's
    third = trained_policy(store_, step=3)
    reads: list[str] = []
    read_manifest = store_.manifest
    monkeypatch.setattr(store_, "manifest", lambda ref: reads.append(ref) or read_manifest(ref))
    monkeypatch.setattr(checkpoints, "_sources", {})
    assert source_checkpoint(store_, newest["policy_id"]) == initial
    assert len(reads) == 7  # six train steps and the checkpoint they started from
    assert source_checkpoint(store_, newest["policy_id"]) == initial
    assert source_checkpoint(store_, third) == initial
    assert len(reads) == 7


def trained_policy(store: Store, step: int) -> str:
    """The policy step `step` trained."""
    return query(store, f"SELECT policy_id FROM train_steps WHERE step = {step}").to_pylist()[0]["policy_id"]
