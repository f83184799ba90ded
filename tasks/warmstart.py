"""warmstart: a short supervised stage on its own split, so RL starts from a policy that sometimes answers.

Pure RL from random init does not learn full-answer arithmetic on this model in minutes; a few
supervised steps on the warmup split fix the output format. The held-out test split is never seen
here, so the rise in test accuracy after this stage comes from RL.

`data` chooses what the steps train on: `answers` (the default), each problem's prompt and answer;
`tool_transcripts`, each problem played through the calculator environment by a scripted assistant that calls the
calculator and states its result (data/tool_transcripts.py), trained on the assistant's tokens only
(trainer/sft.py), so a model whose template has no tools learns the call format before multi-turn GRPO.

With `train.data_parallel` > 1 the run's ranks hold the policy from the first evaluation on, and the warm start
trains it there, sharded (trainer/ranks/sft.py): no process holds the whole model.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlvr.data.tool_transcripts import synthesize_transcripts
from rlvr.environments.calculator import CalculatorOptions
from rlvr.errors import UserError
from rlvr.storage.stage import RESIDENTS, Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import TrainerState, checkpoint_built, load_policy, parameter_count, streamed_files
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.policy import Policy, make_optimizer, policy_files, policy_from_files
from rlvr.trainer.sft import sft_steps, sft_warmstart, transcript_sequences


class WarmstartConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(80, ge=0, description="0 skips the warm start (the initial policy is used as is)")
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    split: str = "warmup"
    data: Literal["answers", "solutions", "tool_transcripts"] = Field(
        "answers",
        exclude_if=lambda value: value == "answers",  # left out of dumps (so of ids) at the default: ids stay
        description=(
            "answers: prompt -> answer; solutions: prompt -> the problem's worked solution (its `solution` column, "
            "e.g. '74 + 93 = 74 + 90 + 3 = 164 + 3 = 167. The answer is 167.'); tool_transcripts: calculator "
            "episodes (data/tool_transcripts.py)"
        ),
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict,
        exclude_if=lambda value: not value,
        description="tool_transcripts: the calculator environment's options; give the run's env.options",
    )

    @field_validator("env_options")
    @classmethod
    def _calculator_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        CalculatorOptions.model_validate(value)  # a misspelt option fails here, with the key's name
        return value

    @model_validator(mode="after")
    def _options_need_transcripts(self) -> WarmstartConfig:
        """The calculator's options shape transcripts only: with other data they would be kept and do nothing."""
        if self.env_options and self.data != "tool_transcripts":
            raise ValueError(
                f"warmstart.env_options is read only with warmstart.data=tool_transcripts (data is {self.data!r})"
            )
        return self


def build(inputs: Inputs, cfg: WarmstartConfig, ctx: StageContext) -> dict[str, Built]:
    """params: `device` (the run's policy.device). A policy the run's data-parallel ranks hold trains there
    (`_on_ranks`); otherwise a private whole copy trains in this process."""
    problems = [p for p in inputs.rows("problems") if p["split"] == cfg.split]
    if not problems:
        raise ValueError(f"warm start split {cfg.split!r} has no problems")
    live = RESIDENTS.get(inputs.require_id("policy"))
    if isinstance(live, TrainerState) and live.policy.ranks is not None:
        return _on_ranks(inputs, cfg, ctx, problems)
    # A private copy: the initial policy object may be held in memory for other readers.
    device = stage_device(ctx.params.get("device"))
    policy = policy_from_files(policy_files(inputs.load("policy", partial(load_policy, device=device))), device=device)
    losses = _trained(policy, problems, cfg, ctx)
    ctx.usage.update(usage(policy.model))
    return {
        "warmstart": _losses(losses, problems, cfg, ctx),
        "checkpoints": checkpoint_built(
            ctx, policy_files(policy), parameter_count(policy), inputs.id("policy"), live=policy
        ),
    }


def _on_ranks(
    inputs: Inputs, cfg: WarmstartConfig, ctx: StageContext, problems: list[dict[str, Any]]
) -> dict[str, Built]:
    """The warm start of the policy the data-parallel ranks hold, sharded, each rank training on its share of every
    batch (trainer/ranks/sft.py): no process holds the whole model. The checkpoint is streamed from the shards, and
    the ranks keep the trained policy with its own optimizer, made when they adopted it for the RL phase
    (train.grpo's lr and weight decay) and never stepped, filed under the checkpoint's id: the RL phase takes it
    as it is."""
    state = RESIDENTS.take(inputs.require_id("policy"))  # trained in place: no longer the input policy
    policy = state.policy
    losses = _trained(policy, problems, cfg, ctx)
    ctx.usage.update(usage(policy.model))
    streamed = streamed_files(inputs.store, policy, ctx.output_ids["checkpoints"]) if inputs.store else None
    files, placed = streamed if streamed is not None else (policy_files(policy), [])  # LoRA: merged on rank 0
    checkpoint = checkpoint_built(
        ctx, files, parameter_count(policy), inputs.id("policy"), live=policy, placed=placed, optimizer=state.optimizer
    )
    return {"warmstart": _losses(losses, problems, cfg, ctx), "checkpoints": checkpoint}


def _trained(policy: Policy, problems: list[dict[str, Any]], cfg: WarmstartConfig, ctx: StageContext) -> list[float]:
    """`cfg.steps` supervised steps of `policy` with an AdamW of its own (dropped after); each step's loss."""
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=0.0)
    seed = ctx.derive_seed("warmstart")
    if cfg.data == "tool_transcripts":
        sequences = transcript_sequences(policy, synthesize_transcripts(problems, cfg.env_options, seed=seed))
        return sft_steps(policy, optimizer, sequences, steps=cfg.steps, batch_size=cfg.batch_size, seed=seed)
    target = "answer" if cfg.data == "answers" else "solution"
    missing = sum(not p.get("solution") for p in problems) if target == "solution" else 0
    if missing:
        raise UserError(
            f"warmstart.data=solutions: {missing} of the {len(problems)} {cfg.split!r} problems have no worked "
            "solution (the arithmetic and skills generators write one); use warmstart.data=answers"
        )
    examples = [(p["prompt"], p[target]) for p in problems]
    return sft_warmstart(policy, optimizer, examples, steps=cfg.steps, batch_size=cfg.batch_size, seed=seed)


def _losses(losses: list[float], problems: list[dict[str, Any]], cfg: WarmstartConfig, ctx: StageContext) -> Built:
    rows = [
        {
            "run_id": ctx.run_id,
            "step": i + 1,
            "loss": loss,
            "examples": min(cfg.batch_size, len(problems)),
            "lr": cfg.lr,
        }
        for i, loss in enumerate(losses)
    ]
    return Built(rows_to_table("warmstart", rows))


WARMSTART: Stage[WarmstartConfig] = Stage(
    name="warmstart",
    code_version="4",  # 4: transcripts' untaught tools taught with tool_prompt (as rollout 7); 3: a pad-id token
    # inside a prompt is attended to (trainer/fused_head.py)
    section="warmstart",
    config=WarmstartConfig,
    inputs=("problems", "policy"),
    outputs={"warmstart": Output("warmstart"), "checkpoints": Output("checkpoints")},
    build=build,
)
