"""rlpr_debias: RLPR's debiasing terms of the whole pool with the policy RL started from (`label.reward=rlpr`,
`label.rlpr.debias_with=start`, the default), as RLPR's code computes them once before training
(`compute_promptgt2scoreA`): r_noreason, the policy's mean per-token probability of each problem's reference right
after its prompt. One run per pool and policy; every step's `rlpr` stage reads it, so each term is computed once.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from rlvr.storage.stage import Built, Inputs, Output, Stage, StageContext, rows_to_table
from rlvr.trainer.checkpoints import load_policy, sampler_policy
from rlvr.trainer.devices import stage_device, usage
from rlvr.trainer.rlpr import debias_rows, rlpr_identity
from rlvr.verifiers.cache import VerifierConfig


def build(inputs: Inputs, cfg: VerifierConfig, ctx: StageContext) -> Built:
    """params: `splits` (the splits selection draws from, select.splits), `device`, and `beside_trainer` under
    flow.async_level."""
    splits = set(ctx.params["splits"])
    pool = sorted(
        (p for p in inputs.rows("problems", ["problem_id", "split", "prompt", "reference"]) if p["split"] in splits),
        key=lambda p: p["problem_id"],
    )
    loader = sampler_policy if ctx.params.get("beside_trainer") else load_policy
    policy = inputs.load("policy", partial(loader, device=stage_device(ctx.params.get("device"))))
    rows: list[dict[str, Any]] = debias_rows(policy, inputs.require_id("policy"), pool, cfg.rlpr, ctx.run_id, None)
    ctx.usage.update(usage(policy.model))
    return Built(rows_to_table("rlpr_debias", rows))


RLPR_DEBIAS: Stage[VerifierConfig] = Stage(
    name="rlpr_debias",
    code_version="1",
    section="label",
    config=VerifierConfig,
    inputs=("problems", "policy"),
    outputs={"rlpr_debias": Output("rlpr_debias")},
    build=build,
    identity=rlpr_identity,
)
