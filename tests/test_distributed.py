"""Data-parallel GRPO with FSDP2 (trainer/sharding.py, trainer/distributed.py): two gloo processes give the
parameters one process gets on the whole batch, with the model sharded (`fsdp`) or replicated (`replicate`).

The batch is ragged on purpose (groups of 1-5 samples, completions of 1-6 tokens, one uniform group and one
group of one that carry no signal), so that in every minibatch the two ranks hold different numbers of
sequences, of tokens and of micro-batches: a plain gradient average would then differ from the single-process
gradient, and unequal pass counts would leave a rank waiting for the other's weights.

Tolerances. The two runs sum the same float32 terms in a different order (per-rank partial sums, then the
reduction): gradients agree to ~1e-6 relative. With plain SGD the parameters are linear in the gradients,
so they must agree within `ATOL` = 1e-6 while the step moves them by ~1e-3. AdamW divides by sqrt(v) + 1e-8,
which turns float noise in a gradient that is ~0 (the k_proj biases: softmax ignores them) into a visible
step: through AdamW the parameters agree only to a few 1e-3 x lr, so the rank-group test allows 2e-2 x lr there."""

import dataclasses
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlvr.storage.manifest import sha256_hex
from rlvr.storage.store import Store
from rlvr.trainer.distributed import distributed_grpo_step, shard_plan
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import (
    Policy,
    PolicyConfig,
    init_policy,
    make_optimizer,
    policy_from_files,
)
from rlvr.trainer.sharding import SHARDINGS, full_state, shard

ATOL = 1e-6
DIGITS = list(range(4, 14))  # token ids of "0".."9" in the tiny vocabulary
EOS = 2


def ragged_batch(seed: int, sizes: list[int], uniform: tuple[int, ...] = ()) -> RolloutBatch:
    """Group g has sizes[g] samples of 1-6 tokens (odd samples end in eos, the others ran out of length);
    rewards in {0, 0.5, 1}, all 1 in the groups of `uniform`."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [f"{g % 10}+{(3 * g + 1) % 10}=" if g % 2 else f"{g}{g}+{g}=" for g in range(len(sizes))]
    samples, rewards = [], []
    for group, size in enumerate(sizes):
        for index in range(size):
            length = int(torch.randint(1, 7, (1,), generator=generator))
            ids = [DIGITS[int(t)] for t in torch.randint(0, 10, (length,), generator=generator)]
            if index % 2:
                ids[-1] = EOS
            samples.append(Sample(group, index, ids, "", len(ids), "stop" if ids[-1] == EOS else "length"))
            reward = 1.0 if group in uniform else float(torch.randint(0, 3, (1,), generator=generator)) / 2
            rewards.append(reward)
    return RolloutBatch(prompts=prompts, samples=samples, rewards=rewards, max_new_tokens=6)


# Groups 0, 1, 3, 5 carry signal (3, 5, 4, 3 samples); 2 is uniform and 4 is a group of one.
BATCH = ragged_batch(0, [3, 5, 2, 4, 1, 3], uniform=(2,))
WEIGHTED = dataclasses.replace(BATCH, kl_weights=[0.5, 1.0, 1.0, 2.0, 1.0, 0.5])  # CLPO's per-group β factors
ONE_GROUP = ragged_batch(1, [4, 2], uniform=(1,))  # one active group: the second rank holds nothing
SCENARIOS: dict[str, tuple[RolloutBatch, GRPOConfig]] = {
    "seq-mean": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, aggregation="seq-mean-token-mean")),
    "token-mean": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, aggregation="token-mean", weight_decay=0.1)),
    "token-sum": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, aggregation="token-sum", advantage_scale="none")),
    "kl": (WEIGHTED, GRPOConfig(lr=1e-2, aggregation="token-mean", kl_beta=0.5, clip_high=0.3, dual_clip=3.0)),
    "overlong-mask": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, overlong="mask", advantage_scale="batch")),
    "idle-rank": (ONE_GROUP, GRPOConfig(lr=1e-2, minibatches=2)),
    # micro-batches of one row each (the budget is below a row's padded width) inside each rank's shard
    "micro-batched": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, aggregation="token-mean", micro_batch_tokens=1)),
    # the LM head applied block by block over the root's gathered weight (trainer/fused_head.py), forced on the CPU
    "fused-head": (BATCH, GRPOConfig(lr=1e-2, minibatches=2, aggregation="token-mean", fused_head=True)),
}


def _fresh(cfg: GRPOConfig, optimizer: str = "sgd") -> tuple[Policy, torch.optim.Optimizer, Policy | None]:
    """The tiny policy (seed 0), its optimizer, and a different reference (seed 1) when there is a KL term."""
    policy = init_policy(PolicyConfig(), seed=0)
    reference = init_policy(PolicyConfig(), seed=1) if cfg.kl_beta > 0 else None
    if optimizer == "sgd":
        return policy, torch.optim.SGD(policy.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay), reference
    return policy, make_optimizer(policy, cfg.lr, cfg.weight_decay), reference


def _assert_same_parameters(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    initial = init_policy(PolicyConfig(), seed=0).model.state_dict()
    assert got.keys() == expected.keys()
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 100 * atol  # the step moved the parameters far more than the tolerance
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _assert_same_stats(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One rank: every scenario under both shardings from the same initial policy; rank 0 saves what it got."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for sharding in SHARDINGS:
            for name, (batch, cfg) in SCENARIOS.items():
                policy, _, reference = _fresh(cfg)
                shard(policy.model, sharding, torch.device("cpu"))
                if reference is not None:
                    reference.model.requires_grad_(False)
                    shard(reference.model, sharding, torch.device("cpu"))
                optimizer = torch.optim.SGD(policy.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
                stats = distributed_grpo_step(policy, optimizer, batch, cfg, reference)
                state = full_state(policy.model)
                if rank == 0:
                    torch.save({"state": state, "stats": stats}, Path(out_dir) / f"{sharding}-{name}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, dict]:
    """Every scenario on two spawned gloo ranks (one spawn for all: starting a process costs seconds)."""
    with tempfile.TemporaryDirectory(prefix="rlvr-dp-test-") as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        return {
            f"{sharding}-{name}": torch.load(Path(tmp) / f"{sharding}-{name}.pt")
            for sharding in SHARDINGS
            for name in SCENARIOS
        }


def test_shards_are_whole_groups_with_unequal_counts():
    plan = shard_plan(torch.tensor([0, 1, 3, 5]), torch.tensor([9.0, 20, 5, 14, 2, 10]), minibatches=2, world_size=2)
    assert [[owned.tolist() for owned in minibatch] for minibatch in plan] == [[[1], [0]], [[3], [5]]]
    sizes = {0: 3, 1: 5, 3: 4, 5: 3}
    assert all(sizes[int(a)] != sizes[int(b)] for (a,), (b,) in plan)  # the share weighting matters
    # More ranks than groups: the extra ranks get none, and every group is somewhere exactly once.
    plan = shard_plan(torch.tensor([2, 7, 9]), torch.ones(10), minibatches=1, world_size=4)
    assert sorted(torch.cat(plan[0]).tolist()) == [2, 7, 9] and plan[0][3].numel() == 0


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_gloo_processes_match_one_process_on_the_whole_batch(two_rank_results, scenario, sharding):
    batch, cfg = SCENARIOS[scenario]
    policy, optimizer, reference = _fresh(cfg)
    expected_stats = grpo_step(policy, optimizer, batch, cfg, reference)
    result = two_rank_results[f"{sharding}-{scenario}"]
    _assert_same_parameters(result["state"], policy.model.state_dict(), ATOL)
    _assert_same_stats(result["stats"], expected_stats)


PROMPTS = ["1+2=", "33+4=", "5+6=", "7+18=", "9+0="]  # left-padded to different widths in a batch


def _assert_ranks_sample_what_one_process_samples(sharded: Policy, whole: Policy) -> None:
    """Both ranks decode a share of the prompts (row-seeded sampling, and greedy), and the tokens are those one
    process draws with the same keys from the same weights."""
    from rlvr.trainer.generation import greedy, sample

    counts, settings = [3, 1, 4, 2, 3], dict(max_new_tokens=4, temperature=1.0, top_p=0.9, seed=11)
    expected = sample(whole, PROMPTS, counts, row_keys=range(len(PROMPTS)), **settings)
    got = sample(sharded, PROMPTS, counts, **settings)  # through the rank group: every rank its share
    assert all(drawn > 0 for drawn in sharded.ranks.state.sampled)
    assert sum(sharded.ranks.state.sampled) == sum(counts)
    assert [(s.prompt_index, s.sample_index, s.completion_ids) for s in got] == [
        (s.prompt_index, s.sample_index, s.completion_ids) for s in expected
    ]
    assert greedy(sharded, PROMPTS, max_new_tokens=4) == greedy(whole, PROMPTS, max_new_tokens=4)
    _assert_ranks_play_what_one_process_plays(sharded, whole)


ANSWERS = ["3", "37", "11", "25", "9"]


def _assert_ranks_play_what_one_process_plays(sharded: Policy, whole: Policy) -> None:
    """Multi-turn episodes (the retry environment) split over the ranks by tasks give one process's trajectories:
    the same tokens, masks, turns and stop reasons, sampled and greedy."""
    from rlvr.environments.base import EnvConfig
    from rlvr.trainer.episodes import Budgets, play_episodes

    env = EnvConfig(type="retry", max_turns=3, verifier="arithmetic")
    tasks = [{"prompt": p, "reference": a} for p, a in zip(PROMPTS, ANSWERS)]
    budgets, keys = Budgets(max_turns=3, max_tokens=64, max_new_tokens=4, max_tool_output_tokens=32), [4, 0, 2, 9, 5]
    for settings, counts in (
        (dict(temperature=1.0, top_p=0.9, seed=11), [3, 1, 4, 2, 3]),
        (dict(temperature=0.0, top_p=1.0, seed=0), [1] * 5),
    ):
        played = [
            play_episodes(policy, env, tasks, counts, budgets=budgets, settings=settings, row_keys=keys)
            for policy in (sharded, whole)
        ]
        assert all(drawn > 0 for drawn in sharded.ranks.state.sampled)
        got, expected = (
            [
                (
                    t.prompt_index,
                    t.sample_index,
                    t.completion_ids,
                    t.loss_mask,
                    t.stop_reason,
                    [(u.role, u.start, u.end) for u in t.turns],
                )
                for t in ts
            ]
            for ts in played
        )
        assert got == expected
        if settings["temperature"] > 0:
            assert any(0 in t.loss_mask for t in played[1])  # some sampled episode had a feedback turn


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_the_rank_group_trains_as_one_process_does(sharding, tmp_path):
    """`train.data_parallel=2` (trainer/ranks/launch.py): this process is rank 0 and adopts a whole policy; one
    worker rank lives across updates. Three AdamW updates (with a KL reference) give one process's losses
    within 1e-5 and its weights within 2e-2 x lr; with fsdp each rank holds half the parameters and optimizer
    state that replicate holds, counted; a forward on rank 0 outside an operation is refused (it would wait for
    the other rank forever); closing the group ends the worker."""
    from rlvr.trainer.ranks import launch
    from rlvr.trainer.updates import update_policy

    cfg = GRPOConfig(lr=1e-3, minibatches=2, kl_beta=0.5, aggregation="token-mean", micro_batch_tokens=30)
    single, single_optimizer, reference = _fresh(cfg, optimizer="adamw")
    whole, _, _ = _fresh(cfg, optimizer="adamw")
    group = launch.rank_group(2, sharding, torch.device("cpu"))
    try:
        policy, optimizer = group.adopt(whole, None, cfg.lr, cfg.weight_decay)
        assert policy.ranks is group and len(group.workers) == 1
        _assert_ranks_sample_what_one_process_samples(policy, single)
        for batch in (BATCH, WEIGHTED, BATCH):
            expected = grpo_step(single, single_optimizer, batch, cfg, reference)
            got = update_policy(policy, optimizer, batch, cfg, reference)
            assert got["updates"] == 2.0
            assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
            assert got["ref_kl"] == pytest.approx(expected["ref_kl"], abs=1e-5)
        whole_files = group.whole_files()
        gathered = policy_from_files(whole_files)  # what a checkpoint held, gathered whole on rank 0
        store = Store.open(
            str(tmp_path / "store"), create=True
        )  # what it holds now: streamed from the shards a tensor at a time
        entry = group.write_weights(str(store.root), "checkpoints", "checkpoints-streamed")
        streamed = (
            tmp_path / "store" / "artifacts" / "checkpoints" / "checkpoints-streamed" / entry["path"]
        ).read_bytes()
        assert streamed == whole_files["model.safetensors"]
        assert entry == {
            "path": "files/model.safetensors",
            "rows": None,
            "bytes": len(streamed),
            "sha256": sha256_hex(streamed),
        }
        _assert_same_parameters(gathered.model.state_dict(), single.model.state_dict(), atol=2e-2 * cfg.lr)
        steps = {float(state["step"]) for state in optimizer.state.values()}
        assert steps == {6.0} and single_optimizer.state_dict()["state"][0]["step"] == 6
        held = group.held()
        whole_parameters = sum(p.numel() * 4 for p in single.model.parameters())
        if sharding == "fsdp":
            assert all(h["parameters"] < 0.55 * whole_parameters for h in held)
            assert sum(h["parameters"] for h in held) == pytest.approx(whole_parameters, rel=0.02)
        else:
            assert all(h["parameters"] == whole_parameters for h in held)
        with pytest.raises(RuntimeError, match="sharded over 2 data-parallel ranks: call it through its rank group"):
            policy.model(torch.tensor([[4, 5]]))
        worker = group.workers[0]
    finally:
        launch.close_group()
    assert worker.wait(timeout=30) == 0
    assert launch.current_group() is None


def _count_whole_layers(policy: Policy, counts: list[int]) -> None:
    """At each forward of a decoder layer of `policy` (sharded, in this process: rank 0), how many of its layers are
    whole (gathered, not DTensors), appended to `counts`."""
    from torch.distributed.tensor import DTensor

    from rlvr.trainer.sharding import decoder_layers

    layers = decoder_layers(policy.model)
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda *_: counts.append(sum(not isinstance(next(m.parameters()), DTensor) for m in layers))
        )


@pytest.mark.slow
@pytest.mark.parametrize(("decode", "most_whole"), [("units", (1, 2)), ("whole", (4, 4))])
def test_fsdp_ranks_decode_in_lockstep_one_unit_whole_at_a_time(decode, most_whole):
    """Sampling, greedy decoding and multi-turn episodes of a policy sharded with fsdp over two ranks: the tokens one
    process draws. With `train.decode_weights=units` (trainer/lockstep_decoding.py) no rank gathers the whole
    weights: at most 2 of 4 layers are whole at any forward (the ranks' shares differ in length and in turns, so
    ranks whose share ends first run idle rounds); with `whole` every layer is, gathered once a call."""
    from rlvr.trainer.ranks import launch
    from rlvr.trainer.tiny_model import TinyModelConfig

    four_layers = PolicyConfig(tiny=TinyModelConfig(num_layers=4))
    group = launch.rank_group(2, "fsdp", torch.device("cpu"), decode=decode)
    gathered_layers: list[int] = []  # on rank 0, at each decoder layer's forward: how many layers are whole
    try:
        policy, _ = group.adopt(init_policy(four_layers, seed=4), None, 1e-3, 0.0)
        _count_whole_layers(policy, gathered_layers)
        _assert_ranks_sample_what_one_process_samples(policy, init_policy(four_layers, seed=4))
    finally:
        launch.close_group()
    low, high = most_whole  # units: the layer computing and at most one prefetched, of 4
    assert len(gathered_layers) > 40 and low <= max(gathered_layers) <= high


@pytest.mark.slow
def test_rlpr_scores_on_the_ranks_are_the_bits_one_process_gives():
    """RLPR's reference probabilities of a sharded policy (label.reward=rlpr with train.data_parallel=2): each rank
    scores whole micro-batches of the one-process split, so every term, the end token's included, equals one
    process's exactly; each forward gathers the decoder layers one at a time (at most two of four whole at once)."""
    from rlvr.trainer.ranks import launch
    from rlvr.trainer.rlpr import reference_probabilities
    from rlvr.trainer.tiny_model import TinyModelConfig
    from rlvr.verifiers.rlpr import ReferenceText

    four_layers = PolicyConfig(tiny=TinyModelConfig(num_layers=4))
    whole = init_policy(four_layers, seed=4)
    texts = [
        ReferenceText(prompt=f"{a}+{b}=", before=f"{a}+{b} is ", reference=str(a + b), after=" ok", stopped=k % 2 == 0)
        for k, (a, b) in enumerate([(1, 2), (12, 30), (7, 8), (45, 5), (3, 3), (60, 21), (9, 90)])
    ]
    texts.append(ReferenceText(prompt="1+1=", before="two", reference=""))  # no reference tokens: mean 0
    expected = reference_probabilities(whole, texts, temperature=0.9, micro_batch_tokens=40, end_cap=0.5)
    group = launch.rank_group(2, "fsdp", torch.device("cpu"))
    gathered_layers: list[int] = []  # on rank 0, at each decoder layer's forward: how many layers are whole
    try:
        policy, _ = group.adopt(init_policy(four_layers, seed=4), None, 1e-3, 0.0)
        _count_whole_layers(policy, gathered_layers)
        got = reference_probabilities(policy, texts, temperature=0.9, micro_batch_tokens=40, end_cap=0.5)
    finally:
        launch.close_group()
    assert got == expected
    assert gathered_layers and max(gathered_layers) <= 2  # the layer computing and the one prefetched, of 4
    assert expected[-1].mean == 0.0 and all(term.tokens > 0 for term in expected[:-1])


def test_buffers_no_state_dict_holds_are_computed_again_from_the_config():
    """A model built on the meta device and materialised empty (`to_empty`) gets the rotary frequencies a model
    built with weights has, exactly (sharding.rebuild_buffers; left empty, every rank would decode garbage)."""
    from rlvr.trainer.memory_plan import meta_model
    from rlvr.trainer.sharding import rebuild_buffers
    from rlvr.trainer.tiny_model import TinyModelConfig, build_tiny_model, tiny_config

    empty = meta_model(tiny_config(TinyModelConfig()), torch.float32)
    empty.to_empty(device="cpu")
    for buffer in empty.buffers():
        buffer.fill_(float("nan"))
    rebuild_buffers(empty)
    built = dict(build_tiny_model(TinyModelConfig(), seed=0).named_buffers())
    assert built.keys() == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    for name, buffer in empty.named_buffers():
        assert torch.equal(buffer, built[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_a_stored_checkpoint_is_adopted_by_slices_without_the_whole_policy_on_rank_0(sharding, tmp_path, monkeypatch):
    """A checkpoint stored whole (one model.safetensors) becomes the rank group's with each rank reading only its
    slices of the file: no code path that loads the whole policy runs on rank 0, the rotary frequencies are
    computed again on every rank, and the group samples and gathers exactly the stored weights."""
    from rlvr.storage.stage import rows_to_table
    from rlvr.trainer import checkpoints
    from rlvr.trainer.policy import policy_files
    from rlvr.trainer.ranks import launch

    stored = init_policy(PolicyConfig(), seed=3)
    files = policy_files(stored)
    store = Store.open(str(tmp_path / "store"), create=True)
    row = {
        "run_id": "r",
        "step": 0,
        "artifact_id": "checkpoints-c0",
        "stage": "initialize",
        "policy_id": None,
        "n_params": 1,
    }
    store.write_artifact(
        "checkpoints",
        "checkpoints-c0",
        rows_to_table("checkpoints", [row]),
        run_id="r",
        stage="initialize",
        parents=[],
        code_version="1",
        config={},
        files=files,
    )
    whole_loads = []
    monkeypatch.setattr(checkpoints, "load_policy", lambda *a, **k: whole_loads.append(a) or stored)
    monkeypatch.setattr(checkpoints, "policy_from_files", lambda *a, **k: whole_loads.append(a) or stored)
    try:
        ranks = checkpoints.Ranks(2, sharding)
        state = checkpoints.take_trainer_state(
            store, "checkpoints-c0", 1e-3, 0.0, device=torch.device("cpu"), ranks=ranks
        )
        assert whole_loads == [] and state.policy.ranks is launch.current_group()
        assert not state.optimizer.state  # a checkpoint holds no optimizer state: fresh moments
        _assert_ranks_sample_what_one_process_samples(state.policy, stored)  # rotary buffers rebuilt on each rank
        assert state.policy.ranks.whole_files()["model.safetensors"] == files["model.safetensors"]
    finally:
        launch.close_group()


@pytest.mark.slow
def test_a_rank_dead_before_an_operation_is_named_by_it(monkeypatch):
    """A rank killed between operations, before the watchdog looks: the next operation's announcement fails in
    gloo, and the run is told which rank died and how (RankLost, a Stopped), never gloo's own error."""
    from rlvr.trainer.ranks import launch

    monkeypatch.setattr(launch, "WATCH_S", 3600.0)  # the watchdog sleeps: only the operation can see it
    group = launch.rank_group(2, "replicate", torch.device("cpu"))
    try:
        group.adopt(init_policy(PolicyConfig(), seed=0), None, 1e-3, 0.0)
        (worker,) = group.workers
        worker.kill()
        worker.wait(timeout=30)
        lost = rf"^stopped: data-parallel rank 1 \(pid {worker.pid}\) was killed by SIGKILL$"
        with pytest.raises(launch.RankLost, match=lost):
            group.held()
        assert group.lost is not None
    finally:
        launch.close_group()
    assert launch.current_group() is None


@pytest.mark.slow
def test_a_rank_dead_after_the_last_operation_lets_the_group_close(monkeypatch):
    """A rank that died after the run's last operation and is not yet seen dead: closing the group tells the
    ranks to stop, that broadcast fails in gloo, and the group still closes (the other ranks ended, the process
    group left) without an error: the run's work is committed."""
    from rlvr.trainer.ranks import launch

    monkeypatch.setattr(launch, "WATCH_S", 3600.0)
    group = launch.rank_group(2, "replicate", torch.device("cpu"))
    group.adopt(init_policy(PolicyConfig(), seed=0), None, 1e-3, 0.0)
    (worker,) = group.workers
    worker.kill()
    worker.wait(timeout=30)
    monkeypatch.setattr(worker, "poll", lambda: None)  # as if its death were not seen yet
    launch.close_group()
    assert launch.current_group() is None and group.lost is None
    assert worker.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_data_parallel_run_keeps_one_rank_process_and_leaves_none(tmp_path, prefect_api):
    """A whole `rlvr run` with `train.data_parallel=2` trains every step through its worker rank, and leaves no
    rank process behind when it ends."""
    from tests.cli_helpers import cli_env, rank_processes, rlvr

    mark = f"RLVR_TEST_MARK=dp-{tmp_path.name}"
    sets = ["train.steps=3", "train.data_parallel=2", "warmstart.steps=5", "difficulty.k=2", "evaluate.every=3"]
    sets += ["select.batch_size=4", "allocate.n=4"]  # not the defaults' 64 x 8 rollouts a step
    args = ["run", "--store", str(tmp_path / "s"), "--run-id", "dp"]
    for item in [*sets, "synthesize.source.per_category=6"]:
        args += ["--set", item]
    env = cli_env(PREFECT_API_URL=prefect_api, RLVR_TEST_MARK=mark.partition("=")[2])
    done = rlvr(*args, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    rows = query(Store.open(str(tmp_path / "s")), "SELECT step, updates FROM train_steps ORDER BY step").to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rank_processes(mark) == []


def _whole_copies(shapes: set[tuple[int, ...]]) -> set[int]:
    """Storages of plain tensors alive in this process whose shape is one of a model's whole parameters', with
    memory behind them (FSDP2 keeps each parameter's unsharded tensor over an empty storage between gathers)."""
    import gc

    from torch.distributed.tensor import DTensor

    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # type(): no lazy attributes
    found = {
        t.untyped_storage().data_ptr()
        for t in tensors
        if not isinstance(t, (DTensor, torch.nn.Parameter))
        and tuple(t.shape) in shapes
        and t.untyped_storage().nbytes() >= t.numel() * t.element_size() > 0
    }
    return found


def test_a_streamed_checkpoint_holds_at_most_one_tensor_whole(monkeypatch):
    """trainer/streamed_weights.py over a model sharded on a fake group of 2 ranks in this process (collectives do
    nothing, shapes are real): when each tensor is gathered whole, the one before it is gone, so a rank holds at
    most one whole tensor beyond its shards; the file's chunks are the header and one per tensor."""
    from rlvr.trainer import streamed_weights
    from rlvr.trainer.memory_plan import fake_group
    from rlvr.trainer.tiny_model import TinyModelConfig

    policy = init_policy(PolicyConfig(tiny=TinyModelConfig(num_layers=4)), seed=0)
    whole_shapes = {tuple(p.shape) for p in policy.model.parameters()}
    real, most = streamed_weights.whole_tensors, []

    def watched(model: torch.nn.Module):
        for item in real(model):
            most.append(len(_whole_copies(shapes) - before))
            yield item
            del item

    monkeypatch.setattr(streamed_weights, "whole_tensors", watched)
    with fake_group(2):
        shard(policy.model, "fsdp", torch.device("cpu"))
        shapes = whole_shapes - {tuple(p.to_local().shape) for p in policy.model.parameters()}  # a shard's is not
        before = _whole_copies(shapes)  # other tests' tensors, alive in this process
        chunks = [len(chunk) for chunk in streamed_weights.safetensors_chunks(policy.model)]
    assert len(chunks) == 1 + len(streamed_weights.file_tensors(policy.model)) and len(most) == len(chunks) - 1
    assert len(shapes) >= 3 and max(most) == 1
