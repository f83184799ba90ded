"""flow.async_level: a step's rollouts sampled by an earlier policy beside the trainer, which trains on them with
the sampling policy's stored log-probs. Resume after SIGKILL is in tests/test_kill_resume.py; that level 0 is the
synchronous run bit for bit is checked there too (same ids and weights as before the key existed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlvr.errors import UserError
from rlvr.flows.config import FlowConfig, load_config
from rlvr.flows.run_preflight import check_async
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer.checkpoints import load_policy
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import (
    GRPOConfig,
    RolloutBatch,
    behaviour_logprobs,
    behaviour_weights,
    clipped_surrogate_loss,
    grpo_step,
)
from rlvr.trainer.policy import PolicyConfig, init_policy, make_optimizer
from tests.cli_helpers import rlvr
from tests.conftest import TINY_OVERRIDES
from tests.test_distributed import ragged_batch


def test_level_0_leaves_the_config_dump_as_it_was():
    assert "async_level" not in FlowConfig().model_dump()
    assert FlowConfig(async_level=2).model_dump()["async_level"] == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("restructure.enabled=true", "does not combine with restructure.enabled"),
        ("train.data_parallel=2", "needs train.data_parallel = 1"),
    ],
)
def test_what_async_cannot_combine_with_is_one_line(extra, message):
    with pytest.raises(UserError, match=message):  # when the config is loaded (flows/compatibility.py)
        load_config(None, ["run_id=a", "flow.async_level=1", extra])
    check_async(load_config(None, ["run_id=a", extra]))  # without async: no complaint


def test_stored_logprobs_are_the_old_ones():
    """Samples that carry their sampler's log-probs train against those: their own policy's (recomputed) give
    ratio 1 (no clipping, KL 0); another policy's give a ratio away from 1."""
    cfg = GRPOConfig(minibatches=1, clip_low=0.01, clip_high=0.01)
    batch = ragged_batch(3, [5, 3, 4, 2])
    policy, other = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    own = behaviour_logprobs(policy, batch.prompts, batch.samples, cfg)
    assert [len(lp) for lp in own] == [s.n_tokens for s in batch.samples]

    def carrying(logprobs: list[list[float]]) -> RolloutBatch:
        samples = [dataclasses.replace(s, logprobs=lp) for s, lp in zip(batch.samples, logprobs)]
        return dataclasses.replace(batch, samples=samples)

    same = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), carrying(own), cfg)
    assert same["clip_fraction"] == 0.0 and abs(same["kl"]) < 1e-6
    policy = init_policy(PolicyConfig(), seed=0)
    stale = grpo_step(
        policy,
        make_optimizer(policy, 1e-3, 0.0),
        carrying(behaviour_logprobs(other, batch.prompts, batch.samples, cfg)),
        cfg,
    )
    assert stale["clip_fraction"] > 0.2 and stale["kl"] > 0.01


@pytest.mark.slow
def test_async_level_1_samples_one_step_behind_and_stores_what_it_sampled_with(tmp_path, rlvr_forks):
    store_root = tmp_path / "store"
    sets = [arg for o in (*TINY_OVERRIDES, "flow.async_level=1", "allocate.n=8") for arg in ("--set", o)]
    done = rlvr("run", "--store", str(store_root), "--run-id", "a", *sets, forks=rlvr_forks)
    assert done.returncode == 0, done.stderr
    store = Store.open(str(store_root))
    sql = (
        "SELECT r.step, min(r.staleness) AS low, max(r.staleness) AS high, any_value(r.policy_id) AS policy, "
        "count(DISTINCT r.policy_id) AS policies, any_value(t.step) AS sampler_step, count(r.logprobs) AS stored, "
        "count(*) AS n FROM rollouts r LEFT JOIN train_steps t ON r.policy_id = t.policy_id GROUP BY r.step ORDER BY r.step"
    )
    steps = query(store, sql).to_pylist()
    assert [(s["step"], s["low"], s["high"], s["policies"]) for s in steps] == [(1, 0, 0, 1)] + [
        (step, 1, 1, 1) for step in range(2, 7)
    ]
    # steps 1 and 2 sample with the starting policy; step s > 2 with the one step s - 2 trained
    assert [s["sampler_step"] for s in steps] == [None, None, 1, 2, 3, 4]
    assert all(s["stored"] == s["n"] for s in steps)
    # the stored log-probs, recorded while sampling, are the sampling policy's as the train stage computes π_old:
    # step 5 sampled with the policy step 3 trained, whose checkpoint is kept (the run keeps only its newest states)
    rows = query(store, "SELECT * FROM rollouts WHERE step = 5 ORDER BY slot, sample_index").to_pylist()
    checkpoint = query(store, "SELECT artifact_id FROM checkpoints WHERE step = 3").to_pylist()[0]["artifact_id"]
    sampler = load_policy(store, checkpoint, device=torch.device("cpu"))
    prompts = sorted({(r["slot"], r["prompt"]) for r in rows})
    index = {slot: i for i, (slot, _) in enumerate(prompts)}
    samples = [
        Sample(index[r["slot"]], r["sample_index"], list(r["completion_ids"]), r["response"], r["n_tokens"], "stop")
        for r in rows
    ]
    cfg = load_config(None, ["run_id=a", *TINY_OVERRIDES]).train.grpo
    again = behaviour_logprobs(sampler, [p for _, p in prompts], samples, cfg)
    assert again == [pytest.approx(list(r["logprobs"]), abs=1e-6) for r in rows]
    # every step's rollouts carry their sampler's log-probs: a step that updates records their mismatch with the
    # trainer's own (8 rollouts a prompt give groups with signal at steps 4 and 5); one that does not, none. At step
    # 4 the sampler's policy is the trainer's (no update since): only decoding's numerics differ
    figures = query(store, "SELECT step, updates, mismatch_mean, mismatch_max, corrected_share FROM train_steps")
    by_step = {f["step"]: f for f in figures.to_pylist()}
    assert {s for s, f in by_step.items() if f["updates"]} == {4, 5}
    assert all(f["mismatch_mean"] is None for f in by_step.values() if not f["updates"])
    assert by_step[4]["mismatch_max"] < 1e-5 and by_step[5]["mismatch_mean"] > 0.01
    assert by_step[4]["corrected_share"] == by_step[5]["corrected_share"] == 0.0


def test_token_weights_scale_each_tokens_objective():
    """clipped_surrogate_loss with token_weight: ℓ = -mean over tokens of w x min(ρA, clip(ρ)A), by hand."""
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.3]]))  # ρ = 2 (clipped to 1.2), then ρ = 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    weight = torch.tensor([[0.5, 3.0]])
    settings = dict(clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-mean")
    plain, _ = clipped_surrogate_loss(logp, old, torch.tensor([1.0]), mask, **settings)
    weighted, stats = clipped_surrogate_loss(logp, old, torch.tensor([1.0]), mask, token_weight=weight, **settings)
    assert float(plain) == pytest.approx(-(1.2 + 1.0) / 2)
    assert float(weighted) == pytest.approx(-(0.5 * 1.2 + 3.0 * 1.0) / 2)
    assert stats["clip_fraction"] == 0.5


def test_decoupled_ppo_clips_around_the_policy_entering_the_step():
    """decoupled=true on stale samples: the clip is centred on π_prox (the policy being trained, before its
    update), so a first update on another policy's samples clips nothing (where the plain loss clips most
    tokens), and each token is weighted by π_prox / π_behaviour. On the policy's own samples the weights are 1
    and the update is the plain one."""
    cfg = GRPOConfig(minibatches=1, clip_low=0.01, clip_high=0.01, decoupled=True)
    batch = ragged_batch(3, [5, 3, 4, 2])
    policy, other = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=1)
    stale = [
        dataclasses.replace(s, logprobs=lp)
        for s, lp in zip(batch.samples, behaviour_logprobs(other, batch.prompts, batch.samples, cfg))
    ]
    decoupled = grpo_step(policy, make_optimizer(policy, 1e-3, 0.0), dataclasses.replace(batch, samples=stale), cfg)
    assert decoupled["clip_fraction"] == 0.0 and abs(decoupled["kl"]) < 1e-6

    own = behaviour_logprobs(init_policy(PolicyConfig(), seed=0), batch.prompts, batch.samples, cfg)
    mine = [dataclasses.replace(s, logprobs=lp) for s, lp in zip(batch.samples, own)]
    trained, plain = init_policy(PolicyConfig(), seed=0), init_policy(PolicyConfig(), seed=0)
    sgd = lambda p: torch.optim.SGD(p.model.parameters(), lr=1.0)  # noqa: E731  (Adam's first step is sign(grad))
    grpo_step(trained, sgd(trained), dataclasses.replace(batch, samples=mine), cfg)
    grpo_step(plain, sgd(plain), batch, GRPOConfig(minibatches=1, clip_low=0.01, clip_high=0.01))
    for a, b in zip(trained.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_behaviour_weights_are_the_capped_ratio_and_1_on_padding():
    prox = torch.log(torch.tensor([[0.4, 0.9, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.2, 0.1, 0.5]]))
    mask = torch.tensor([[True, True, False]])
    assert behaviour_weights(prox, behaviour, mask, None).tolist() == [pytest.approx([2.0, 9.0, 1.0])]
    assert behaviour_weights(prox, behaviour, mask, 5.0).tolist() == [pytest.approx([2.0, 5.0, 1.0])]
