"""What one policy update is made of: the step's rollouts grouped into a GRPO batch (from the train stage's
inputs), and the update itself, in this process or across data-parallel ranks. The train stage runs it,
and a policy whose weights were not stored is rebuilt by running it again (trainer/checkpoints.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from rlvr.storage.stage import Inputs
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, grpo_step
from rlvr.trainer.policy import Policy
from rlvr.verifiers.outcomes import is_error


def rollout_batch(
    rollouts: list[dict[str, Any]],
    score_of: Mapping[str, float],
    components_of: Mapping[str, dict[str, float]] | None = None,
) -> RolloutBatch:
    """Group the step's rollouts by batch slot (one GRPO group per slot); with `components_of`, each sample's
    reward components too (GDPO normalises them separately)."""
    slots = sorted({r["slot"] for r in rollouts})
    index_of = {slot: i for i, slot in enumerate(slots)}
    prompts = [""] * len(slots)
    samples, rewards = [], []
    ordered = sorted(rollouts, key=lambda r: (r["slot"], r["sample_index"]))
    for r in ordered:
        i = index_of[r["slot"]]
        prompts[i] = r["prompt"]
        samples.append(
            Sample(
                prompt_index=i,
                sample_index=r["sample_index"],
                completion_ids=list(r["completion_ids"]),
                text=r["response"],
                n_tokens=r["n_tokens"],
                finish_reason=r["finish_reason"],
                logprobs=None if r.get("logprobs") is None else list(r["logprobs"]),
            )
        )
        rewards.append(score_of[r["rollout_id"]])
    components = None if components_of is None else [components_of[r["rollout_id"]] for r in ordered]
    batch = RolloutBatch(prompts=prompts, samples=samples, rewards=rewards, components=components)
    batch.rollout_ids = [r["rollout_id"] for r in ordered]
    if any(r.get("loss_mask") is not None for r in ordered):  # an environment's episodes
        batch.loss_masks = [None if r.get("loss_mask") is None else list(r["loss_mask"]) for r in ordered]
        batch.prompt_token_ids = [None if r.get("prompt_ids") is None else list(r["prompt_ids"]) for r in ordered]
        batch.turn_starts = [None if r.get("turn_starts") is None else list(r["turn_starts"]) for r in ordered]
        batch.turn_rewards = [None if r.get("turn_rewards") is None else list(r["turn_rewards"]) for r in ordered]
    return batch


def reward_components(inputs: Inputs) -> dict[str, dict[str, float]]:
    """rollout_id -> its reward components, parsed from the `rewards` artifact's JSON `components` column."""
    table = inputs.table("rewards", ["rollout_id", "components"]).to_pydict()
    return {rid: json.loads(text or "{}") for rid, text in zip(table["rollout_id"], table["components"])}


def rollout_max_new_tokens(inputs: Inputs) -> int:
    """The rollouts' sampling limit, from the rollout stage's config recorded in each rollouts manifest (the
    largest when refill rounds differ): token-sum's constant and the overlong penalty's L_max."""
    if inputs.store is None:
        raise ValueError("the rollouts' max_new_tokens is read from their manifests; these inputs have no store")
    limits: list[int] = []
    for aid in inputs.ids.get("rollouts", ()):
        limit = inputs.store.manifest(aid).config.get("max_new_tokens")
        if not isinstance(limit, int):
            raise ValueError(f"rollouts {aid} do not record max_new_tokens (the rollout stage's config)")
        limits.append(limit)
    if not limits:
        raise ValueError("input 'rollouts' is missing")
    return max(limits)


def episode_sampled_tokens(inputs: Inputs) -> int | None:
    """For an environment's episodes, the most tokens one may sample in all (token-sum's constant): env.max_tokens,
    or max_turns x max_new_tokens when that is less, from the rollout stage's config in each rollouts manifest (the
    largest over refill rounds); None for one-turn rollouts."""
    assert inputs.store is not None  # rollout_max_new_tokens has checked it
    caps = []
    for aid in inputs.ids.get("rollouts", ()):
        config = inputs.store.manifest(aid).config
        env = config.get("env")
        if isinstance(env, dict) and env.get("type", "one_turn") != "one_turn":
            caps.append(min(int(env["max_tokens"]), int(env["max_turns"]) * int(config["max_new_tokens"])))
    return max(caps) if caps else None


def update_policy(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    grpo: GRPOConfig,
    reference: Policy | None,
) -> dict[str, float]:
    """One GRPO step, updating `policy` and `optimizer` in place: in this process, or, for a policy sharded over
    data-parallel ranks (`policy.ranks`, trainer/ranks/launch.py; `optimizer` is then rank 0's part), on every rank."""
    if policy.ranks is not None:
        return dict(policy.ranks.update(batch, grpo, reference))
    return grpo_step(policy, optimizer, batch, grpo, reference)


def step_batch(inputs: Inputs, grpo: GRPOConfig) -> RolloutBatch:
    """The step's rollouts with their rewards: only the groups the filter kept (with dynamic sampling), their
    reward components (GDPO), the rollouts' token limit (overlong shaping), CLPO's KL weights and the
    verifier's extracted answers (SEED-GRPO)."""
    verdicts = inputs.table("rewards", ["rollout_id", "score", "status", "verifier"]).to_pylist()
    score_of = {v["rollout_id"]: v["score"] for v in verdicts}
    # a failed verdict (a judge's call, an environment that crashed or hung) is no reward at all: never trained on
    # as the 0 it carries (verifiers/outcomes.py)
    failed = {v["rollout_id"] for v in verdicts if is_error(v["status"])}
    rollouts = [r for r in inputs.rows("rollouts") if r["rollout_id"] not in failed]
    if inputs.ids.get("groups"):  # groups the filter judged train only if kept (CLPO's same-step rewrites it never saw)
        judged = {r["slot"]: r["kept"] for r in inputs.rows("groups", ["slot", "kept"])}
        rollouts = [r for r in rollouts if judged.get(r["slot"], True)]
    components_of = reward_components(inputs) if grpo.advantage_components is not None else None
    batch = rollout_batch(rollouts, score_of, components_of)
    batch.reward_errors = len(failed)
    if grpo.needs_max_length:
        batch.max_new_tokens = rollout_max_new_tokens(inputs)
        batch.max_sampled_tokens = episode_sampled_tokens(inputs)
    if inputs.ids.get("restructured"):
        weight_of = dict(zip(*inputs.table("restructured", ["slot", "kl_weight"]).to_pydict().values()))
        batch.kl_weights = [weight_of.get(slot, 1.0) for slot in sorted({r["slot"] for r in rollouts})]
    if grpo.semantic_entropy is not None:
        extracted_of = dict(zip(*inputs.table("rewards", ["rollout_id", "extracted"]).to_pydict().values()))
        ordered = sorted(rollouts, key=lambda r: (r["slot"], r["sample_index"]))  # rollout_batch's order
        batch.answers = [extracted_of[r["rollout_id"]] for r in ordered]
    return batch
