"""`rlvr plan`: each stage's peak memory per rank, counted before any work on the run's real model.

The model is built from its config on the meta device (no weights, no GPU) and, with N > 1 ranks, sharded by
the run's own `sharding.shard` over a fake process group of N ranks in this one process (torch's `fake`
backend: collectives do nothing, shapes are real). What a rank holds is then counted, not derived:

- weights, gradients and AdamW's two moments: the bytes of this rank's shards (a DTensor by its local part);
- the largest gathered unit: a decoder layer's or the root's (embeddings, final norm, LM head) whole weights in
  the dtype the units compute in (bf16 on a GPU over float32 weights, as FSDP2's mixed precision gathers them),
  and in a backward the root's whole gradient beside the reduce-scatter input FSDP2 copies it into;
- activations of one micro-batch: the tensors autograd saves in a forward of the real model on the meta device
  (counted through `saved_tensors_hooks`, parameters left out), with and without gradient checkpointing, plus the
  logits the loss keeps and their gradient;
- a decoding stage's key/value cache and one token step's logits, from the model's shape and the stage's rows.

Which stage holds what is the code's as it stands (docs/scale-out.md): with ranks, no stage holds the whole model
but the initial checkpoint of a model that is built (the tiny one, LoRA) or taken from an earlier run's checkpoint
(on rank 0); a model directory's is copied a tensor at a time. The process's own memory (the interpreter with
torch and transformers) is measured in this process on the CPU; on a GPU it is an assumed allowance for the CUDA
context and the caching allocator (`CUDA_ALLOWANCE`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

from rlvr.errors import UserError
from rlvr.trainer.fused_head import FUSABLE
from rlvr.trainer.sharding import Sharding, decoder_layers, local, shard
from rlvr.trainer.vocab_blocks import block_positions

CUDA_ALLOWANCE = 3 * 10**9  # bytes a GPU rank spends outside tensors: CUDA context, NCCL and cuBLAS buffers,
# the caching allocator's fragmentation (assumed, as in docs/scale-out.md; never measured here)
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
INITIAL = "the whole model built or loaded, its checkpoint streamed a tensor at a time"
COPIED = "the model directory's weights copied into the checkpoint a tensor at a time"


@dataclass(frozen=True)
class Workload:
    """The shapes the stages work on, from a run config (`workload_of`)."""

    prompt_tokens: int  # a prompt's tokens (padded length of a batch's prompts)
    rollout_rows: int  # rollouts a step (select.batch_size x allocate.n)
    rollout_tokens: int  # rollout.max_new_tokens
    eval_rows: int | None  # held-out problems an evaluation decodes (None: unknown before synthesis)
    eval_tokens: int
    difficulty_rows: int  # difficulty.shard_size x difficulty.k: one shard's rollouts, decoded in one batch
    difficulty_tokens: int
    minibatches: int
    micro_batch_tokens: int | None
    checkpointing: bool
    kl_reference: bool
    warmstart_steps: int
    fused_head: bool
    rollout_graph: bool = False  # rollout.cache=graph: rollouts decode from whole weights even under fsdp
    decode_weights: str = "units"  # train.decode_weights
    copied_start: bool = False  # the first checkpoint is copied (a model directory, an earlier checkpoint), not built


@dataclass
class Stage:
    """One stage's peak on one rank: bytes by term."""

    stage: str
    rank: str  # "0", "1..N-1", or "0 (one process)"
    terms: dict[str, int]
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class MemoryPlan:
    model: str
    parameters: int
    ranks: int
    sharding: str
    device: str
    stages: list[Stage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def peak(self, rank: str) -> Stage:
        """The stage with the largest total on `rank`."""
        return max((s for s in self.stages if s.rank == rank), key=lambda s: s.total)

    def rank_names(self) -> list[str]:
        return list(dict.fromkeys(s.rank for s in self.stages))


# --- the model's config and its meta-device build ----------------------------------------------------------------


def model_config(policy: Any, override: Path | None = None) -> Any:
    """The transformers config of `policy.model` (or of the config.json `override` names), read without
    weights: the built-in tiny model's, a model directory's, a hub id in the local cache, or a GGUF model's (its
    dequantised directory, made once as a run would)."""
    import transformers

    from rlvr.trainer.gguf_models import dequantised_directory
    from rlvr.trainer.policy import check_policy_source
    from rlvr.trainer.tiny_model import tiny_config

    if override is not None:
        if not override.is_file():
            raise UserError(f"--model-config {str(override)!r} is not a file; give a model's config.json")
        return transformers.AutoConfig.from_pretrained(str(override))
    if policy.model == "tiny":
        return tiny_config(policy.tiny)
    try:
        source = check_policy_source(policy)
    except UserError as missing:
        raise UserError(f"{missing}; or give the model's config.json with --model-config") from None
    if source.endswith(".gguf"):
        source = str(dequantised_directory(Path(source)))
    return transformers.AutoConfig.from_pretrained(source, local_files_only=True)


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `config` on the meta device, its parameters in `dtype`, in training mode."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    return model


def shape_of(config: Any) -> dict[str, int]:
    """Layers, key/value heads, head width and vocabulary: what a key/value cache and logits are sized by."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    return {
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "vocab": text.vocab_size,
        "hidden": text.hidden_size,
    }


# --- counting ------------------------------------------------------------------------------------------------


def tensor_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Bytes of the local parts of `tensors`, each in its own dtype or in `dtype`."""
    return sum(local(t).numel() * (DTYPE_BYTES[dtype] if dtype else local(t).element_size()) for t in tensors)


def unit_bytes(model: torch.nn.Module, compute: torch.dtype) -> tuple[int, int]:
    """(largest decoder layer, the root) whole, in the dtype units compute in, counted before sharding."""
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    layer = max(tensor_bytes(list(m.parameters()), compute) for m in layers)
    root = tensor_bytes([p for p in model.parameters() if id(p) not in in_layers], compute)
    return layer, root


@contextmanager
def fake_group(ranks: int) -> Iterator[None]:
    """A process group of `ranks` ranks in this process alone (torch's fake backend): sharding runs, collectives
    are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("a memory plan is made in a process without a torch.distributed group; run it on its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


def state_bytes(model: torch.nn.Module, ranks: int, sharding: Sharding) -> dict[str, int]:
    """What one rank holds of the training state, counted on its shards (rank 0's, the largest: FSDP2 pads every
    rank's shard of a parameter to the same size)."""
    if ranks > 1:
        with fake_group(ranks):
            shard(model, sharding, torch.device("cpu"))
            weights = tensor_bytes(list(model.parameters()))
    else:
        weights = tensor_bytes(list(model.parameters()))
    return {"weights": weights, "gradients": weights, "optimizer": 2 * weights}


def saved_bytes(model: torch.nn.Module, rows: int, length: int, keep: int) -> int:
    """Bytes autograd saves (parameters aside) in one forward of `model` (meta) over `rows` x `length` tokens
    keeping the logits of the last `keep` positions, as the loss's forward asks (trainer/logprobs.py). The attention
    mask is given whole (4D), as the meta device cannot run transformers' checks of a 2D one."""
    kept = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in kept:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        model(
            input_ids=torch.zeros(rows, length, device="meta", dtype=torch.long),
            attention_mask=torch.ones(rows, 1, length, length, device="meta", dtype=torch.bool),
            position_ids=torch.zeros(rows, length, device="meta", dtype=torch.long),
            use_cache=False,
            logits_to_keep=keep,
        )
    return sum(saved.values())


def activation_bytes(model: torch.nn.Module, rows: int, work: Workload, compute: torch.dtype, device: str) -> int:
    """One micro-batch's forward and backward: what autograd saves (with checkpointing, each layer's input and one
    layer recomputed in the backward), the completion positions' logits the loss keeps, their gradient, and the
    loss's float32 blocks (a few at a time)."""
    length, keep = work.prompt_tokens + work.rollout_tokens, work.rollout_tokens + 1
    whole = saved_bytes(model, rows, length, keep)
    saved = whole
    if work.checkpointing:
        from rlvr.trainer.grpo import set_activation_checkpointing

        set_activation_checkpointing(model, True)
        try:
            saved = saved_bytes(model, rows, length, keep)
        finally:
            set_activation_checkpointing(model, False)
        saved += (whole - saved) // len(decoder_layers(model))  # the layer its backward recomputes
    config: Any = model.config
    text = config.get_text_config()
    vocab, hidden = text.vocab_size, text.hidden_size
    # the logits the loss keeps and their gradient; the fused head keeps none, but sums the head's gradient in float32
    logits = vocab * hidden * 4 if work.fused_head else 2 * rows * keep * vocab * DTYPE_BYTES[compute]
    blocks = 3 * block_positions(vocab, device) * vocab * 4
    return saved + logits + blocks


def kv_cache_bytes(shape: dict[str, int], rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for `rows` x `tokens` positions, and one token step's float32 logits."""
    per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]
    return rows * tokens * per_token + 2 * rows * shape["vocab"] * 4


def per_rank(rows: int, ranks: int) -> int:
    return math.ceil(rows / ranks)


# --- the plan ------------------------------------------------------------------------------------------------


def workload_of(cfg: Any, prompt_tokens: int, fused_head: bool = False) -> Workload:
    """A run config's shapes. Held-out rows are known before synthesis only when every source gives its `count`
    (or `synthesize.size` is set)."""
    synth = cfg.synthesize
    counts: list[int | None] = [getattr(source, "count", None) for source in synth.sources]
    known = [count for count in counts if count is not None]
    raw = synth.size if synth.size is not None else (sum(known) if len(known) == len(counts) else None)
    grpo = cfg.train.grpo
    return Workload(
        prompt_tokens=prompt_tokens,
        rollout_rows=cfg.select.batch_size * cfg.allocate.n,
        rollout_tokens=cfg.rollout.max_new_tokens,
        eval_rows=None if raw is None else max(1, round(raw * synth.test_fraction)),
        eval_tokens=cfg.evaluate.max_new_tokens,
        difficulty_rows=cfg.difficulty.shard_size * cfg.difficulty.k,
        difficulty_tokens=cfg.difficulty.max_new_tokens,
        minibatches=grpo.minibatches,
        micro_batch_tokens=grpo.micro_batch_tokens,
        checkpointing=grpo.gradient_checkpointing,
        kl_reference=grpo.kl_beta > 0,
        warmstart_steps=cfg.warmstart.steps,
        fused_head=fused_head,
        rollout_graph=getattr(cfg.rollout, "cache", None) == "graph",
        decode_weights=cfg.train.decode_weights,
        copied_start=cfg.policy.lora is None and (cfg.policy.model != "tiny" or cfg.policy.checkpoint is not None),
    )


def micro_rows(work: Workload, ranks: int) -> int:
    """Rows of one micro-batch on one rank: `micro_batch_tokens` worth of whole rows, else the rank's share of a
    minibatch."""
    share = per_rank(math.ceil(work.rollout_rows / work.minibatches), ranks)
    if work.micro_batch_tokens is None:
        return share
    return max(1, min(share, work.micro_batch_tokens // (work.prompt_tokens + work.rollout_tokens)))


def process_bytes() -> int:
    """This process's resident memory (Linux), the CPU ranks' floor: the interpreter with torch and transformers."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def process_floors(device: str, run_modules: Callable[[], object] | None) -> dict[str, int]:
    """What a process holds before any model: on the CPU this one's resident memory once it has imported what a
    rank imports (`floor`), then once `run_modules` has imported what the run's process imports (`floor_run`: the
    flows, a layer above this one, name them); on a GPU `CUDA_ALLOWANCE`."""
    if device == "cuda":
        return {"floor": CUDA_ALLOWANCE, "floor_run": CUDA_ALLOWANCE}
    import_module("rlvr.trainer.ranks.launch")  # what a rank process imports

    rank = process_bytes()
    if run_modules is not None:
        run_modules()
    return {"floor": rank, "floor_run": max(rank, process_bytes())}


@dataclass(frozen=True)
class Counted:
    """What the stages are assembled from."""

    whole: int  # the whole model's weights in their dtype
    shards: dict[str, int]  # one rank's weights, gradients, optimizer
    layer: int  # the largest decoder layer gathered, in the compute dtype
    root: int  # the root unit gathered
    reduce: int  # the root's gradient whole and FSDP2's reduce-scatter input beside it, when the backward reduces it
    activations: int  # one micro-batch
    whole_compute: int  # the whole model in the compute dtype (decoding from gathered weights)
    largest_tensor: int  # the largest parameter whole, in its dtype (a streamed checkpoint gathers one at a time)
    floor: int  # a rank's process itself
    floor_run: int  # the run's process (rank 0): the flow's modules (Prefect, DuckDB, the store) too


def make_plan(
    cfg: Any,
    ranks: int,
    device: str,
    prompt_tokens: int = 128,
    model_config_path: Path | None = None,
    run_modules: Callable[[], object] | None = None,
) -> MemoryPlan:
    """Each stage's peak memory per rank for run config `cfg` at `ranks` ranks on a `device` ("cpu" or "cuda").
    `run_modules` imports what the run's own process imports (on the CPU its memory is measured after)."""
    from rlvr.trainer.devices import WEIGHTS_DTYPES

    if cfg.policy.lora is not None:
        raise UserError("rlvr plan does not plan LoRA runs yet (their trainable state is the adapters alone)")
    sharding: Sharding = cfg.train.sharding
    dtype = WEIGHTS_DTYPES[cfg.policy.dtype]
    mixed = device == "cuda" and dtype == torch.float32 and (ranks > 1 or cfg.train.grpo.autocast == "bf16")
    compute = torch.bfloat16 if mixed else dtype
    config = model_config(cfg.policy, model_config_path)
    fused = cfg.train.grpo.fused_head  # None: on CUDA for the architectures the fused head supports
    if fused is None:
        fused = device == "cuda" and bool(set(getattr(config, "architectures", None) or ()) & FUSABLE)
    work = workload_of(cfg, prompt_tokens, fused)
    model = meta_model(config, dtype)
    whole = tensor_bytes(list(model.parameters()))
    layer, root = unit_bytes(model, compute)
    activations = activation_bytes(meta_model(config, compute), micro_rows(work, ranks), work, compute, device)
    counted = Counted(
        whole=whole,
        shards=state_bytes(model, ranks, sharding),
        layer=layer,
        root=root,
        reduce=root // DTYPE_BYTES[compute] * (DTYPE_BYTES[compute] + DTYPE_BYTES[torch.float32 if mixed else dtype]),
        activations=activations,
        whole_compute=whole * DTYPE_BYTES[compute] // DTYPE_BYTES[dtype],
        largest_tensor=max(p.numel() * p.element_size() for p in model.parameters()),
        **process_floors(device, run_modules),
    )
    plan = MemoryPlan(
        model=str(model_config_path or cfg.policy.model),
        parameters=sum(p.numel() for p in model.parameters()),
        ranks=ranks,
        sharding=sharding if ranks > 1 else "one process",
        device=device,
    )
    shape = shape_of(config)
    if ranks == 1:
        plan.stages = _one_process(counted, work, shape, compute)
    else:
        plan.stages = _on_ranks(counted, work, shape, compute, ranks, sharding)
    if work.eval_rows is None:
        plan.notes.append("held-out rows unknown before synthesis (a source without `count`): evaluations not planned")
    plan.notes.append(
        f"prompts of {prompt_tokens} tokens (--prompt-tokens); one micro-batch: {micro_rows(work, ranks)} rows"
    )
    return plan


def _decoding(work: Workload, shape: dict[str, int], compute: torch.dtype, ranks: int) -> dict[str, int]:
    """Key/value caches of the decoding stages at `ranks` ranks (each its share of the rows)."""
    found = {
        "difficulty": kv_cache_bytes(
            shape, per_rank(work.difficulty_rows, ranks), work.prompt_tokens + work.difficulty_tokens, compute
        ),
        "rollout": kv_cache_bytes(
            shape, per_rank(work.rollout_rows, ranks), work.prompt_tokens + work.rollout_tokens, compute
        ),
    }
    if work.eval_rows is not None:
        found["evaluate"] = kv_cache_bytes(
            shape, per_rank(work.eval_rows, ranks), work.prompt_tokens + work.eval_tokens, compute
        )
    return found


def _one_process(c: Counted, work: Workload, shape: dict[str, int], compute: torch.dtype) -> list[Stage]:
    """N = 1: the whole model in the run's process for every stage; the optimizer's moments stay from the first
    update on."""
    w, moments, floor = c.whole, 2 * c.whole, {"process": c.floor_run}
    reference = {"KL reference": w} if work.kl_reference else {}
    kv = _decoding(work, shape, compute, 1)
    rank = "0 (one process)"
    stages = [Stage("initialize", rank, {"weights": w, "file chunk": c.largest_tensor, **floor}, INITIAL)]
    if work.warmstart_steps:
        stages.append(
            Stage(
                "warm start",
                rank,
                {"weights": w, "gradients": w, "optimizer": moments, "activations": c.activations, **floor},
            )
        )
    stages.append(Stage("difficulty", rank, {"weights": w, "KV cache": kv["difficulty"], **floor}))
    if "evaluate" in kv:
        stages.append(
            Stage("evaluate", rank, {"weights": w, "optimizer": moments, "KV cache": kv["evaluate"], **floor})
        )
    stages += [
        Stage("rollout", rank, {"weights": w, "optimizer": moments, **reference, "KV cache": kv["rollout"], **floor}),
        Stage(
            "update",
            rank,
            {"weights": w, "gradients": w, "optimizer": moments, **reference, "activations": c.activations, **floor},
        ),
        Stage(
            "checkpoint",
            rank,
            {"weights": w, "optimizer": moments, "file chunk": c.largest_tensor, **floor},
            "streamed from the live policy a tensor at a time",
        ),
    ]
    return stages


def _before_adoption(c: Counted, work: Workload) -> list[Stage]:
    """Rank 0's initial checkpoint (tasks/initialize.py): a model directory's weights copied a tensor at a time
    (trainer/directory_weights.py) or an earlier checkpoint's in chunks, or, for a model that is built (the tiny
    one, LoRA's adapters), the whole model. The ranks adopt the policy from that file right after, before the first
    evaluation and the warm start."""
    floor = {"process": c.floor_run}
    if work.copied_start:
        return [Stage("initialize", "0", {"file chunk": c.largest_tensor, **floor}, COPIED)]
    return [Stage("initialize", "0", {"weights": c.whole, "file chunk": c.largest_tensor, **floor}, INITIAL)]


def _on_ranks(
    c: Counted,
    work: Workload,
    shape: dict[str, int],
    compute: torch.dtype,
    ranks: int,
    sharding: Sharding,
) -> list[Stage]:
    """N > 1 as the code runs it: the initial checkpoint on rank 0 (`_before_adoption`); then every rank reads its
    slices of the stored policy, and each stage is each rank's share (the warm start: its shards, their gradients,
    the SFT optimizer's moments over them, the gathered units and one micro-batch's activations, as the update; the RL
    optimizer is made then but holds nothing before the first update). Under fsdp decoding gathers a unit at a
    time (trainer/lockstep_decoding.py), but rollout.cache=graph and replicate gather the whole weights once
    (`whole_weights`); a checkpoint is streamed from the shards a tensor at a time."""
    s = c.shards
    held = {"weights": s["weights"], "optimizer": s["optimizer"]}
    reference = {"KL reference": s["weights"]} if work.kl_reference else {}
    # FSDP2 gathers a unit into buffers of its own under replicate too (a shard of size 1)
    gathered = {"gathered units": c.root + 2 * c.layer}
    # FSDP2 copies a unit's whole gradients into a reduce-scatter input of their size before it frees them: the
    # largest, the root's, counted twice while the backward reduces it (torch's `foreach_reduce`)
    reducing = {"gradient reduction": c.reduce}
    whole = {"gathered weights": c.whole_compute}
    decoding = gathered if sharding == "fsdp" and work.decode_weights == "units" else whole
    rollout_decoding = whole if work.rollout_graph else decoding
    kv = _decoding(work, shape, compute, ranks)
    stages = _before_adoption(c, work)
    others = "1" if ranks == 2 else f"1..{ranks - 1}"
    for rank in ("0", others):
        floor = {"process": c.floor_run if rank == "0" else c.floor}
        adopting = {"weights": s["weights"], **floor}
        stages.append(Stage("adopt", rank, adopting, "each rank reads its slices of the stored file"))
        fresh = {"weights": s["weights"], **decoding, **floor}  # no optimizer moments before the first update
        if "evaluate" in kv:
            stages.append(Stage("evaluate (first)", rank, {**fresh, "KV cache": kv["evaluate"]}))
        if work.warmstart_steps:
            sft = {"weights": s["weights"], "gradients": s["gradients"], "SFT optimizer": s["optimizer"], **gathered}
            sft |= reducing
            note = "its checkpoint streamed from the shards"
            stages.append(Stage("warm start", rank, {**sft, "activations": c.activations, **floor}, note))
        stages.append(Stage("difficulty", rank, {**fresh, "KV cache": kv["difficulty"]}))
        training = {**held, "gradients": s["gradients"], **reference, **gathered, **reducing}
        training["activations"] = c.activations
        rolling = {**held, **reference, **rollout_decoding, "KV cache": kv["rollout"], **floor}
        stages.append(Stage("rollout", rank, rolling))
        stages.append(Stage("update", rank, {**training, **floor}))
        if "evaluate" in kv:
            stages.append(Stage("evaluate (later)", rank, {**held, **decoding, "KV cache": kv["evaluate"], **floor}))
        streamed = {**held, "gathered tensor": c.largest_tensor, **floor}
        stages.append(Stage("checkpoint", rank, streamed, "streamed from the shards a tensor at a time"))
    return stages
