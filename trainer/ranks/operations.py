"""What every data-parallel rank does for rank 0's requests (trainer/ranks/launch.py announces them, serve.py's loop
answers them on the other ranks): what a rank holds (`RankState`), the sharded policy built from rank 0's whole one
(`build_sharded`), and each rank's share of a sampling, episodes or greedy request (under fsdp in lockstep rounds, a
unit gathered at a time; `decoding`) with row-seeded sampling so that the tokens do not depend on the rank count;
rank 0 gathers every share.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rlvr.environments.base import EnvConfig
from rlvr.trainer.distributed import idle_pass
from rlvr.trainer.episodes import Budgets, Trajectory, play_episodes, trajectory_from_dict
from rlvr.trainer.generation import Cache, Sample, greedy, lockstep_for, sample
from rlvr.trainer.lora import SETTINGS_FILE, LoraSettings, add_lora
from rlvr.trainer.policy import MODEL_BUILD_LOCK, Policy, load_tokenizer, make_optimizer, set_threads
from rlvr.trainer.ranks.transport import gather_bytes
from rlvr.trainer.rlpr import ReferenceProbability, reference_probabilities_share
from rlvr.trainer.sharding import DecodeWeights, Sharding, load_whole, resharded, shard, whole_weights
from rlvr.verifiers.rlpr import ReferenceText


@dataclass
class RankState:
    """One rank's part of the group's objects."""

    device: torch.device
    sharding: Sharding
    threads: int
    decode: DecodeWeights = "units"  # train.decode_weights, sent with each decoding request
    policy: Policy | None = None
    optimizer: torch.optim.Optimizer | None = None
    reference: Policy | None = None
    static: dict[str, bytes] = field(default_factory=dict)  # the policy's config and tokenizer files
    sampled: list[int] = field(default_factory=list)  # on rank 0: the samples each rank drew in the last operation


def skeleton(static: dict[str, bytes], dtype: torch.dtype, threads: int) -> Policy:
    """The policy's model without weights (on the meta device) and its tokenizer, from its static files."""
    set_threads(threads)
    with tempfile.TemporaryDirectory(prefix="rlvr-ranks-") as tmp:
        for name, data in static.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        with MODEL_BUILD_LOCK:
            config = AutoConfig.from_pretrained(tmp)
            tokenizer = load_tokenizer(tmp)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if (Path(tmp) / "generation_config.json").is_file():
                model.generation_config = GenerationConfig.from_pretrained(tmp)
    if SETTINGS_FILE in static:
        add_lora(model, LoraSettings.model_validate(json.loads(static[SETTINGS_FILE])), seed=0)
    return Policy(model=model, tokenizer=tokenizer, source="ranks")


def _restore_buffers(model: torch.nn.Module, whole: dict[str, torch.Tensor], device: torch.device) -> None:
    """Buffers that are not in a state dict (rotary frequencies) are computed at build time, which the meta
    device skipped: rank 0 sends its own (`whole`, its plain model's) to every rank."""
    kept = set(model.state_dict())
    for name, buffer in sorted(model.named_buffers()):
        if name in kept:
            continue
        value = whole[name].to(device) if dist.get_rank() == 0 else torch.empty_like(buffer, device=device)
        dist.broadcast(value, src=0)
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = value


def build_sharded(
    state: RankState,
    static: dict[str, bytes],
    dtype: torch.dtype,
    whole: torch.nn.Module | None,
    optimizer_state: dict[str, Any] | None,
    lr: float | None,
    weight_decay: float,
    trainable: bool,
) -> tuple[Policy, torch.optim.Optimizer | None]:
    """Every rank: the model built empty, sharded, and filled with rank 0's weights (`whole`, rank 0 only),
    and, when `trainable`, an optimizer over its shards with rank 0's state (`optimizer_state`, FSDP's full form,
    None: fresh). The policy is in eval mode, as every policy is outside a training pass."""
    policy = skeleton(static, dtype, state.threads)
    model = policy.model
    shard(model, state.sharding, state.device)
    model.to_empty(device=state.device)
    weights = whole.state_dict() if whole is not None else {}
    buffers = dict(whole.named_buffers()) if whole is not None else {}
    if not trainable:
        model.requires_grad_(False)
    optimizer = make_optimizer(policy, lr or 1e-3, weight_decay) if trainable else None
    present = torch.tensor([optimizer_state is not None], device=state.device)
    dist.broadcast(present, src=0)
    load_whole(model, optimizer, weights, (optimizer_state or {}) if bool(present.item()) else None)
    _restore_buffers(model, buffers, state.device)
    model.tie_weights()
    return ready(policy), optimizer


def ready(policy: Policy) -> Policy:
    """What `policy._prepare` does for a loaded model, but the cast (the weights are already in their dtype)."""
    tokenizer = policy.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if policy.model.generation_config.pad_token_id is None:
        policy.model.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.model.eval()
    return policy


def plain_policy(
    static: dict[str, bytes], weights: dict[str, torch.Tensor], like: Policy, dtype: torch.dtype
) -> Policy:
    """A one-process policy around whole weights (no copy) from the static files, with `like`'s buffers."""
    plain = skeleton(static, dtype, torch.get_num_threads())
    plain.model.load_state_dict(weights, assign=True, strict=False)
    for name, buffer in like.model.named_buffers():
        if name not in weights:
            owner, _, leaf = name.rpartition(".")
            (plain.model.get_submodule(owner) if owner else plain.model)._buffers[leaf] = buffer.cpu()
    plain.model.tie_weights()
    missing = [name for name, p in plain.model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"gathered weights miss {missing[:3]}")
    return ready(Policy(plain.model, plain.tokenizer, like.source))


def shares(counts: Sequence[int], world_size: int) -> list[list[int]]:
    """The prompt indices each rank decodes: contiguous runs of about equal numbers of rows (samples)."""
    total = sum(counts)
    owned: list[list[int]] = [[] for _ in range(world_size)]
    before = 0
    for index, count in enumerate(counts):
        middle = before + count / 2
        owned[min(world_size - 1, int(middle * world_size / max(total, 1)))].append(index)
        before += count
    return owned


@contextmanager
def decoding(state: RankState, cache: Cache) -> Iterator[None]:
    """Every rank decodes its share inside. Under fsdp in lockstep rounds, each forward gathering one unit at a
    time (trainer/lockstep_decoding.py), so that no rank holds the whole weights; the rank drains the others'
    rounds once its own share is done. From the whole weights (`whole_weights`: every unit gathered once, then no
    collective) when they are whole already (replicate), when `train.decode_weights=whole` asks (faster), and for
    `rollout.cache=graph`, which replays its captured token step and cannot gather."""
    assert state.policy is not None
    policy = state.policy
    if state.sharding != "fsdp" or state.decode == "whole" or cache == "graph":
        with whole_weights(policy.model):
            yield
        return
    policy.lockstep = lockstep_for(policy)
    try:
        with torch.no_grad(), resharded(policy.model):
            yield
            policy.lockstep.drain()
    finally:
        policy.lockstep = None


def sample_share(
    state: RankState, prompts: list[str], counts: list[int], settings: dict[str, Any], keys: list[int]
) -> list[Sample]:
    """This rank's share of a sampling operation (`decoding`); on rank 0 every rank's samples
    in the one-process order (by prompt, then sample), on the others an empty list."""
    assert state.policy is not None
    mine = shares(counts, dist.get_world_size())[dist.get_rank()]
    found: list[Sample] = []
    with decoding(state, settings.get("cache", "shared_prompt")):
        if mine:
            share_prompts, share_counts = [prompts[i] for i in mine], [counts[i] for i in mine]
            drawn = sample(state.policy, share_prompts, share_counts, row_keys=[keys[i] for i in mine], **settings)
            found = [dataclasses.replace(s, prompt_index=mine[s.prompt_index]) for s in drawn]
    parts = gather_bytes(json.dumps([dataclasses.asdict(s) for s in found]).encode(), state.device)
    by_rank = [[Sample(**raw) for raw in json.loads(part)] for part in parts]
    state.sampled = [len(samples) for samples in by_rank]
    return sorted((s for samples in by_rank for s in samples), key=lambda s: (s.prompt_index, s.sample_index))


def episodes_share(state: RankState, request: dict[str, Any]) -> list[Trajectory]:
    """This rank's share of an episodes operation (whole tasks: a group's episodes stay on one rank), played with
    its own environments (`decoding`: its turns in rounds with the other ranks' under fsdp); on rank 0 every rank's
    trajectories in the one-process order, on the others none."""
    assert state.policy is not None
    counts = request["counts"]
    mine = shares(counts, dist.get_world_size())[dist.get_rank()]
    found: list[Trajectory] = []
    with decoding(state, request["settings"].get("cache", "shared_prompt")):
        if mine:
            played = play_episodes(
                state.policy,
                EnvConfig.model_validate(request["env"]),
                [request["tasks"][i] for i in mine],
                [counts[i] for i in mine],
                budgets=Budgets(**request["budgets"]),
                settings=request["settings"],
                row_keys=[request["keys"][i] for i in mine],
            )
            found = [dataclasses.replace(t, prompt_index=mine[t.prompt_index]) for t in played]
    parts = gather_bytes(json.dumps([dataclasses.asdict(t) for t in found]).encode(), state.device)
    by_rank = [[trajectory_from_dict(raw) for raw in json.loads(part)] for part in parts]
    state.sampled = [len(trajectories) for trajectories in by_rank]
    return sorted((t for part in by_rank for t in part), key=lambda t: (t.prompt_index, t.sample_index))


def rlpr_share(state: RankState, request: dict[str, Any]) -> list[ReferenceProbability]:
    """This rank's micro-batches of an RLPR scoring operation (`rlpr.reference_probabilities`), every rank running
    as many forwards (idle ones where it has no batch left), each gathering the units one at a time; on rank 0 every
    text's term in order, on the others none."""
    assert state.policy is not None
    texts = [ReferenceText(**raw) for raw in request["texts"]]
    settings = (request["temperature"], request["micro_batch_tokens"], request["end_cap"])
    model, pad_id = state.policy.model, state.policy.tokenizer.pad_token_id

    def idle() -> None:
        idle_pass(model, pad_id, state.device)

    with torch.no_grad(), resharded(model):  # each forward gathers one unit at a time: no rank holds the whole
        mine = reference_probabilities_share(
            state.policy, texts, *settings, dist.get_rank(), dist.get_world_size(), idle
        )
    encoded = json.dumps([[i, dataclasses.asdict(term)] for i, term in mine.items()]).encode()
    parts = gather_bytes(encoded, state.device)
    found = {int(i): ReferenceProbability(**term) for part in parts for i, term in json.loads(part)}
    return [found[i] for i in range(len(texts))] if parts else []


def greedy_share(state: RankState, prompts: list[str], settings: dict[str, Any]) -> list[str]:
    """This rank's share of a greedy operation; on rank 0 every prompt's completion in order."""
    assert state.policy is not None
    mine = shares([1] * len(prompts), dist.get_world_size())[dist.get_rank()]
    texts: list[str] = []
    with decoding(state, settings.get("cache", "shared_prompt")):
        if mine:
            texts = greedy(state.policy, [prompts[i] for i in mine], **settings)
    parts = gather_bytes(json.dumps(list(zip(mine, texts))).encode(), state.device)
    ordered = {int(index): text for part in parts for index, text in json.loads(part)}
    return [ordered[index] for index in range(len(prompts))] if parts else []
