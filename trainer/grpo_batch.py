"""What a GRPO step trains on: its settings (`GRPOConfig`), its rollouts (`RolloutBatch`), their advantages under the
settings (`step_advantages`, from trainer/advantages.py's functions) and the padded rows of the groups that carry a
signal (`TrainingRows`, `step_rows`). No model call: data-parallel ranks each compute the same from the same batch.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rlvr.trainer import prompts
from rlvr.trainer.advantages import (
    AdvantageScale,
    effective_ratio,
    gdpo_advantages,
    group_advantages,
    overlong_penalty,
    semantic_entropy_scale,
)
from rlvr.trainer.generation import Sample
from rlvr.trainer.grpo_loss import Aggregation
from rlvr.trainer.mismatch import Correction, CorrectionLevel
from rlvr.trainer.objectives import DiscoScore, Objective
from rlvr.trainer.policy import Policy
from rlvr.trainer.turn_credit import token_advantages, turn_returns

Overlong = Literal["none", "mask", "penalty"]


class DiscoConfig(BaseModel):
    """DisCO's settings (trainer/objectives.py `disco_loss`); the defaults are the paper's for its logL score."""

    model_config = ConfigDict(extra="forbid")

    score: DiscoScore = Field(default="logL", description="logL: token-mean log π_θ; Lratio: token-mean π_θ / π_old")
    tau: float | None = Field(
        default=10.0,
        gt=0,
        description=(
            "τ of the log-mean-exp over wrong answers (the paper: 10 for logL, 1 for Lratio); None: DisCO-b's mean"
        ),
    )
    delta: float = Field(default=1e-4, ge=0, description="δ: the KL(π_old ‖ π_θ) the penalty allows")
    beta: float = Field(default=1e3, ge=0, description="β of the squared hinge on KL above δ")


class GRPOConfig(BaseModel):
    """One RL step's optimisation settings; every default gives plain GRPO (docs/methods.md#grpo has the table).

    `lr` and `weight_decay` are for `make_optimizer` (grpo_step uses the optimizer it is given).
    `minibatches`: gradient updates per RL step, each on a contiguous slice of the step's groups, all
    against the same old logprobs; more than one reuses each generation for several updates.
    `temperature`: logits are divided by it before the log-softmax of the loss. 1.0 (default) trains
    the untempered policy even when rollouts were sampled hotter (exploration); setting it to the
    sampling temperature makes the ratio exact against the sampled distribution (TRL/verl do this).
    On the earlier addition task 1.0 did as well or better with rollouts at temperature 2.5.
    `autocast` and `gradient_checkpointing` are for large models on a GPU (`training_precision`); both run on
    the CPU too, where bf16 is slower than float32.
    `micro_batch_tokens`: gradient accumulation. Each minibatch's rows go through forward and backward in
    micro-batches of at most this many padded tokens (rows x (prompt width + completion width), the widths
    of the step's padded tensors, which is what the forward pass holds in memory); a row wider than the budget
    is a micro-batch of its own. Rows are split regardless of groups (advantages are already computed), each
    micro-batch's loss is weighted by its share of the minibatch (`loss_share`), and the minibatch still makes
    one clipped optimizer step: the update is the unsplit one up to float summation order. The no-grad passes
    (old logprobs with their entropy, reference logprobs) go through the same micro-batches, so no pass holds
    logits for more rows than one micro-batch. None (default): on a GPU, a budget from its free memory
    (`micro_batch_budget`); elsewhere one forward and backward per minibatch (the CPU's numbers do not depend on
    how much memory is free).
    """

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.2, ge=0)
    dual_clip: float | None = Field(default=None, gt=1, description="c of dual-clip PPO: A < 0 costs at most c|A|")
    ratio_cap: float | None = Field(
        default=None, description="truncate the unclipped term's ratio at this value (detached weight); > 1 + clip_high"
    )
    minibatches: int = Field(default=1, ge=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    advantage_scale: AdvantageScale = "std"
    advantage_components: dict[str, float] | None = Field(
        default=None,
        min_length=1,
        description="GDPO: reward component name -> weight; each is normalised in its group on its own",
    )
    advantage_clip: float | None = Field(default=None, gt=0, description="clamp advantages to [-c, c]")
    semantic_entropy: float | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) when off: earlier runs keep theirs
        ge=0,
        le=1,
        description=(
            "SEED-GRPO's alpha: scale each group's advantages by f(alpha x SE / log G), SE the entropy of its "
            "answers clustered by the verifier's extracted value; None: off"
        ),
    )
    semantic_entropy_weighting: Literal["linear", "exponential"] = Field(
        default="linear",
        exclude_if=lambda value: value == "linear",
        description="SEED-GRPO's f: 1 - x (linear) or exp(-x)",
    )
    aggregation: Aggregation = "seq-mean-token-mean"
    overlong: Overlong = "none"
    overlong_buffer: int | None = Field(
        default=None, ge=1, description="tokens before the max length where the penalty ramps"
    )
    temperature: float = Field(default=1.0, gt=0)
    kl_beta: float = Field(
        default=0.0, ge=0, description="β of the KL-to-reference term (k3); 0 leaves it out (no reference model)"
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "padded tokens per forward/backward (every pass). None: on CUDA floor(0.7 x (free GPU memory - gradients"
            " and optimizer moments not yet allocated) / bytes per token), bytes per token = 4 x (3V + L(10H + 4I))"
            " for vocabulary V, L layers, hidden H, MLP width I (checkpointing: 4 x (3V + LH + 10H + 4I)); on the"
            " CPU the whole minibatch at once"
        ),
    )
    autocast: Literal["none", "bf16"] = Field(
        default="none", description="bf16: the step's forward passes under torch.autocast (weights stay float32)"
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in backward instead of keeping them (less memory)"
    )
    decoupled: bool = Field(
        default=False,
        exclude_if=lambda value: value is False,  # left out of dumps (so of ids) when off
        description=(
            "for stale samples (flow.async_level > 0): clip around the policy entering the step (π_prox, one "
            "more no-grad pass) and weight each token by π_prox / π_behaviour (capped at ratio_cap when set): "
            "AReaL's decoupled PPO; off: clip around the sampling policy itself"
        ),
    )
    fused_head: bool | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # left out of dumps (so of ids) at auto
        description=(
            "apply the LM head block by block, never keeping [rows, tokens, vocabulary] logits "
            "(trainer/fused_head.py); None (auto): on CUDA for Llama/Qwen2/Qwen3/Mistral, off on the CPU"
        ),
    )

    objective: Objective = Field(
        default="grpo",
        exclude_if=lambda value: value == "grpo",  # left out of dumps (so of ids) at the default
        description=(
            "the policy loss (trainer/objectives.py): grpo (the clipped token surrogate), gspo (one clipped ratio a "
            "sequence; the paper clips at 3e-4/4e-4), cispo (every token's gradient, its weight clipped above at "
            "1 + clip_high and detached) or disco (right answers' scores against wrong ones', under a KL hinge)"
        ),
    )
    disco: DiscoConfig = Field(
        default_factory=lambda: DiscoConfig(),
        exclude_if=lambda value: value == DiscoConfig(),
        description="DisCO's score, τ, δ and β (objective=disco)",
    )
    correction: Correction = Field(
        default="none",
        exclude_if=lambda value: value == "none",
        description=(
            "when rollouts carry their sampler's log-probs (flow.async_level, another engine): clip around the "
            "trainer's own π_old and weight each token by w = π_trainer / π_sampler, truncated (tis), with tokens "
            "outside the bounds rejected (mis) or zeroed (icepop) (trainer/mismatch.py)"
        ),
    )
    correction_level: CorrectionLevel = Field(
        default="token",
        exclude_if=lambda value: value == "token",
        description="token: a weight a token; sequence: one a sequence, the product of its tokens'",
    )
    correction_bounds: tuple[float, float] | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="(low, high) of the weight; None: tis (-, 2), mis (0.5, 2), icepop (0.5, 5)",
    )
    fp32_head: bool = Field(
        default=False,
        exclude_if=lambda value: value is False,
        description="the policy's log-probs with the LM head in float32 under bf16 autocast (the fused head too)",
    )
    turn_credit: Literal["trajectory", "return_to_go"] = Field(
        default="trajectory",
        exclude_if=lambda value: value == "trajectory",  # left out of dumps (so of ids) at the default
        description=(
            "an environment's episodes: every sampled token gets its trajectory's advantage (trajectory), or each "
            "assistant turn the group advantage of the reward still to come from it (return_to_go; "
            "trainer/turn_credit.py, docs/training.md)"
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        if self.turn_credit != "trajectory" and (self.advantage_components or self.semantic_entropy is not None):
            raise ValueError("turn_credit=return_to_go works on the reward alone, not with GDPO or SEED-GRPO")
        if self.ratio_cap is not None and self.ratio_cap <= 1.0 + self.clip_high:
            raise ValueError(f"ratio_cap must exceed 1 + clip_high = {1.0 + self.clip_high}")
        if self.overlong == "penalty" and self.overlong_buffer is None:
            raise ValueError('overlong="penalty" needs overlong_buffer (tokens of the linear ramp)')
        if self.objective in ("gspo", "disco") and self.turn_credit != "trajectory":
            raise ValueError(f"objective={self.objective} scores whole sequences: it needs turn_credit=trajectory")
        if self.objective == "disco" and self.micro_batch_tokens is not None:
            raise ValueError(
                "objective=disco couples a group's rows and the minibatch's KL: each minibatch goes through one pass, "
                "so micro_batch_tokens cannot be set (use more minibatches for less memory)"
            )
        if self.correction != "none" and self.decoupled:
            raise ValueError(
                "decoupled is the tis correction with ratio_cap as its bound: set correction or decoupled, not both"
            )
        if self.correction_bounds is not None and not 0 <= self.correction_bounds[0] < self.correction_bounds[1]:
            raise ValueError(f"correction_bounds {list(self.correction_bounds)}: need 0 <= low < high")
        if self.objective == "disco" and self.correction != "none":
            raise ValueError("objective=disco has no per-token weight for a mismatch correction: set correction=none")
        if self.objective == "disco" and self.decoupled:
            raise ValueError("objective=disco has no per-token weight for decoupled PPO: turn decoupled off")
        if self.objective != "grpo" and (self.dual_clip is not None or self.ratio_cap is not None):
            raise ValueError(f"dual_clip and ratio_cap belong to the grpo objective, not {self.objective}")
        return self

    @property
    def needs_max_length(self) -> bool:
        """Whether a step needs the rollouts' max_new_tokens (the token-sum constant, the penalty's L_max)."""
        return self.aggregation == "token-sum" or self.overlong == "penalty"


@dataclass
class RolloutBatch:
    """The rollouts of one RL step: `samples[k].prompt_index` indexes `prompts` (= the group), and
    `rewards[k]` is the reward of `samples[k]`; `components[k]` its reward components (GDPO) and
    `max_new_tokens` the sampling limit of one completion (one turn of an episode: the overlong penalty's L_max);
    `max_sampled_tokens`, for an environment's episodes, how many tokens one episode may sample in all (token-sum's
    constant; one-turn rollouts: `max_new_tokens`)."""

    prompts: list[str]
    samples: list[Sample]
    rewards: list[float]
    kl_weights: list[float] | None = None  # per prompt (group): the factor on β for its samples
    components: list[dict[str, float]] | None = None
    max_new_tokens: int | None = None
    answers: list[str | None] | None = None  # per sample: the verifier's extracted answer (SEED-GRPO)
    # Per sample, for an environment's episodes (None: a one-turn rollout): the opening's token ids, which the
    # loss conditions on instead of the tokenized prompt, and the loss mask over completion_ids (0 on the
    # environment's tokens: tool output, a user's follow-up).
    prompt_token_ids: list[list[int] | None] | None = None
    loss_masks: list[list[int] | None] | None = None
    # Per sample, its assistant turns: where each starts in completion_ids and its reward from the environment
    # (None: none given); `turn_credit="return_to_go"` reads them. None: one turn from token 0, without a reward.
    turn_starts: list[list[int] | None] | None = None
    turn_rewards: list[list[float | None] | None] | None = None
    reward_errors: int = 0  # the step's rollouts left out because their verdict failed (status error)
    max_sampled_tokens: int | None = None
    rollout_ids: list[str] | None = None  # per sample: the rollout it is (what the train stage records as trained)

    @property
    def token_sum_length(self) -> int | None:
        """Token-sum's per-sample constant: the most tokens one rollout may sample (environment tokens aside)."""
        return self.max_sampled_tokens or self.max_new_tokens


def _padded(rows: list[list[int]], pad_id: int, side: Literal["left", "right"]) -> Tensor:
    width = max(len(row) for row in rows)
    if side == "left":
        return torch.tensor([[pad_id] * (width - len(row)) + row for row in rows], dtype=torch.long)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long)


@dataclass
class TrainingRows:
    """The samples of the groups that carry signal, as padded tensors (one row per sample)."""

    prompt_ids: Tensor  # [R, P] left-padded
    completion_ids: Tensor  # [R, T] right-padded
    mask: Tensor  # [R, T] True on real completion tokens
    advantages: Tensor  # [R], or [R, T] one a token (`turn_credit`)
    groups: Tensor  # [R] group (prompt) index of each row
    active_groups: Tensor  # the groups with a non-zero advantage
    kl_weights: Tensor  # [R] the factor on β of each row (1 unless the batch gives weights)
    old_logp: Tensor | None = None  # [R, T] the sampling policy's log-probs, when the samples carry them (stale)
    behaviour_weight: Tensor | None = None  # [R, T] π_prox / π_behaviour per token (decoupled PPO), else None


def batch_stats(rewards: Tensor, group_index: Tensor) -> dict[str, float]:
    """The metrics of a step before any update (the update metrics start at 0)."""
    return {
        "loss": 0.0,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "ref_kl": 0.0,
        "entropy": 0.0,
        "grad_norm": 0.0,
        "updates": 0.0,
        "mean_reward": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward_std": float(rewards.std(correction=0)) if rewards.numel() else 0.0,
        "effective_ratio": effective_ratio(rewards, group_index),
    }


def component_matrix(components: list[dict[str, float]], weights: dict[str, float]) -> tuple[Tensor, Tensor]:
    """The named reward components of every sample [N, K] and their weights [K].

    A sample without a component scores 0 on it (a verdict that errored has no parts and a 0 reward);
    a name that no sample has is a configuration mistake (a typo would otherwise train on zeros).
    """
    names = list(weights)
    missing = [name for name in names if not any(name in parts for parts in components)]
    if missing:
        seen = sorted({name for parts in components for name in parts})
        raise ValueError(f"advantage_components {missing} are in no reward; the rewards have {seen}")
    values = torch.tensor([[parts.get(name, 0.0) for name in names] for parts in components], dtype=torch.float64)
    return values, torch.tensor([weights[name] for name in names], dtype=torch.float64)


def step_advantages(batch: RolloutBatch, rewards: Tensor, group_index: Tensor, cfg: GRPOConfig) -> Tensor:
    """Every sample's advantage under `cfg`: the overlong penalty joins the reward (as one more component
    of weight 1 under GDPO), then group / batch / GDPO normalisation, then the advantage clip. [N], or [N, L]
    (one a completion token) under `turn_credit="return_to_go"`."""
    penalty = None
    if cfg.overlong == "penalty":
        assert batch.max_new_tokens is not None and cfg.overlong_buffer is not None  # checked by grpo_step
        penalty = overlong_penalty(overlong_lengths(batch), batch.max_new_tokens, cfg.overlong_buffer)
    if cfg.advantage_components is not None:
        if batch.components is None or len(batch.components) != len(batch.samples):
            raise ValueError("advantage_components needs the reward components of every sample")
        values, weights = component_matrix(batch.components, cfg.advantage_components)
        if penalty is not None:
            values = torch.cat([values, penalty.unsqueeze(1).to(values.dtype)], dim=1)
            weights = torch.cat([weights, torch.ones(1, dtype=weights.dtype)])
        advantages = gdpo_advantages(values, group_index, weights, scale=cfg.advantage_scale)
    elif cfg.turn_credit == "return_to_go":
        scores = rewards if penalty is None else rewards + penalty
        advantages = episode_turn_advantages(batch, scores, group_index, cfg.advantage_scale)
    else:
        advantages = group_advantages(
            rewards if penalty is None else rewards + penalty, group_index, scale=cfg.advantage_scale
        )
    if cfg.semantic_entropy is not None:
        if batch.answers is None or len(batch.answers) != len(batch.samples):
            raise ValueError("semantic_entropy needs every sample's extracted answer (RolloutBatch.answers)")
        scale = semantic_entropy_scale(batch.answers, group_index, cfg.semantic_entropy, cfg.semantic_entropy_weighting)
        advantages = advantages * scale
    if cfg.advantage_clip is not None:
        advantages = advantages.clamp(-cfg.advantage_clip, cfg.advantage_clip)
    return advantages


def overlong_lengths(batch: RolloutBatch) -> Tensor:
    """[N] the length each sample's overlong penalty reads: a one-turn rollout's completion; an environment's
    episode's longest assistant turn in sampled tokens (each turn samples at most max_new_tokens; the environment's
    tokens between turns are not the model's and never count)."""
    masks = batch.loss_masks or [None] * len(batch.samples)
    starts = batch.turn_starts or [None] * len(batch.samples)
    lengths = []
    for sample, mask, turn_starts in zip(batch.samples, masks, starts):
        if mask is None:
            lengths.append(sample.n_tokens)
            continue
        bounds = [*(turn_starts or [0]), len(mask)]
        lengths.append(max(sum(mask[a:b]) for a, b in zip(bounds, bounds[1:])))
    return torch.tensor(lengths)


def episode_turn_advantages(batch: RolloutBatch, scores: Tensor, group_index: Tensor, scale: AdvantageScale) -> Tensor:
    """[N, L] each completion token's advantage under `turn_credit="return_to_go"` (trainer/turn_credit.py): per
    assistant turn, the group advantage of the reward still to come from it."""
    n = len(batch.samples)
    starts = [s or [0] for s in (batch.turn_starts or [None] * n)]
    given = batch.turn_rewards or [None] * n
    rewards = [list(r or [])[: len(s)] + [None] * (len(s) - len(r or [])) for r, s in zip(given, starts)]
    returns = turn_returns(scores, rewards)
    per_turn = torch.stack(
        [group_advantages(returns[:, t], group_index, scale=scale) for t in range(returns.shape[1])], dim=1
    )
    return token_advantages(per_turn, starts, [len(s.completion_ids) for s in batch.samples])


def training_rows(
    policy: Policy, batch: RolloutBatch, advantages: Tensor, group_index: Tensor, trainable: Tensor | None = None
) -> TrainingRows | None:
    """The rows of the groups whose advantages are not all zero, or None when there is none.

    `trainable` [N] (default all) leaves samples out of the loss, e.g. truncated ones under
    `overlong="mask"`; they still counted in their group's mean and std (the advantages are given).
    """
    keep = torch.ones_like(group_index, dtype=torch.bool) if trainable is None else trainable
    signal = advantages != 0 if advantages.dim() == 1 else (advantages != 0).any(dim=1)
    active_groups = torch.unique(group_index[signal & keep])
    if active_groups.numel() == 0:
        return None
    rows = (torch.isin(group_index, active_groups) & keep).nonzero().squeeze(1).tolist()
    pad_id = policy.tokenizer.pad_token_id
    prompt_ids = _padded(_row_prompt_ids(policy, batch, rows), pad_id, "left")
    completion_ids = _padded([batch.samples[k].completion_ids for k in rows], pad_id, "right")
    lengths = torch.tensor([batch.samples[k].n_tokens for k in rows])
    mask = torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if batch.loss_masks is not None:
        mask &= _padded([_loss_mask(batch, k) for k in rows], 0, "right").bool()[:, : mask.shape[1]]
    per_group = batch.kl_weights or [1.0] * len(batch.prompts)
    kl_weights = torch.tensor([per_group[batch.samples[k].prompt_index] for k in rows], dtype=torch.float32)
    row_advantages = advantages[rows] if advantages.dim() == 1 else advantages[rows][:, : mask.shape[1]]
    tensors = (prompt_ids, completion_ids, mask, row_advantages, group_index[rows], active_groups, kl_weights)
    device = next(policy.model.parameters()).device  # built on the CPU; the model may sit on a GPU
    training = TrainingRows(*(t.to(device) for t in tensors))
    if all(batch.samples[k].logprobs is not None for k in rows):
        stored = [list(batch.samples[k].logprobs or []) for k in rows]
        training.old_logp = torch.tensor([row + [0.0] * (mask.shape[1] - len(row)) for row in stored]).to(device)
    return training


def _row_prompt_ids(policy: Policy, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
    """Each row's prompt tokens: its episode's opening when it has one, else its group's prompt tokenized."""
    given = batch.prompt_token_ids or [None] * len(batch.samples)
    tokenized = prompts.prompt_ids(policy.tokenizer, batch.prompts)
    return [given[k] or tokenized[batch.samples[k].prompt_index] for k in rows]


def _loss_mask(batch: RolloutBatch, k: int) -> list[int]:
    """Sample k's loss mask over its completion tokens (all 1 for a one-turn rollout)."""
    assert batch.loss_masks is not None
    mask = batch.loss_masks[k]
    n_tokens = len(batch.samples[k].completion_ids)
    if mask is None:
        return [1] * n_tokens
    if len(mask) != n_tokens:
        raise ValueError(f"sample {k}: loss mask of {len(mask)} tokens for {n_tokens} completion tokens")
    return list(mask)


def step_rows(
    policy: Policy, batch: RolloutBatch, cfg: GRPOConfig, reference: Policy | None
) -> tuple[dict[str, float], TrainingRows | None]:
    """A step's first half on the whole batch: its checks, its batch stats, and the rows that carry signal
    (advantages as `step_advantages` gives them, truncated samples out under overlong="mask"; None when no
    group carries signal). No model call: data-parallel ranks each compute the same from the same batch."""
    if cfg.kl_beta > 0 and reference is None:
        raise ValueError("kl_beta > 0 needs the reference policy")
    if len(batch.samples) != len(batch.rewards):
        raise ValueError(f"{len(batch.samples)} samples but {len(batch.rewards)} rewards")
    if cfg.needs_max_length and batch.max_new_tokens is None:
        raise ValueError("aggregation 'token-sum' and overlong 'penalty' need the batch's max_new_tokens")
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    group_index = torch.tensor([s.prompt_index for s in batch.samples], dtype=torch.long)
    stats = batch_stats(rewards, group_index)
    if not batch.samples:
        return stats, None
    advantages = step_advantages(batch, rewards, group_index, cfg)
    trainable = None
    if cfg.overlong == "mask":
        trainable = torch.tensor([s.finish_reason != "length" for s in batch.samples], dtype=torch.bool)
    return stats, training_rows(policy, batch, advantages, group_index, trainable)
