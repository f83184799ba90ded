"""The columns of every artifact kind: the contract between stages and the shape of each DuckDB view.

Writers are checked against these schemas, and a view over a kind with no committed artifact yet is
an empty table with these columns, so a query never fails only because a stage has not run.
Kinds not listed here are allowed (extensions add their own) and are typed by their data.
"""

from __future__ import annotations

import pyarrow as pa

_s = pa.string()
_i = pa.int64()
_f = pa.float64()

SCHEMAS: dict[str, pa.Schema] = {
    "config": pa.schema([("run_id", _s), ("seed", _i), ("config_json", _s)]),
    "problems": pa.schema(
        [
            ("problem_id", _s),
            ("run_id", _s),
            ("split", _s),
            ("domain", _s),
            ("category", _s),
            ("prompt", _s),
            ("reference", _s),
            ("answer", _s),
            ("verifier", _s),
            ("source", _s),
            ("generator", _s),
            ("generator_version", _s),
            ("params", _s),
            ("seed", _i),
            ("source_index", _i),
            ("parent_problem_id", _s),
            ("derivation", _s),
            ("difficulty_label", _s),
            ("solution", _s),  # a reference solution (worked steps), when the source has one: GHPO's hints
        ]
    ),
    "quarantine": pa.schema(
        [
            ("run_id", _s),
            ("stage", _s),
            ("source", _s),
            ("source_index", _i),
            ("failed_check", _s),
            ("reason", _s),
            ("row_json", _s),
        ]
    ),
    # Rows of the data stage merged into an earlier problem: exact (same normalised text) or near (MinHash).
    "duplicates": pa.schema(
        [
            ("run_id", _s),
            ("problem_id", _s),
            ("duplicate_of", _s),
            ("similarity", _f),
            ("kind", _s),
            ("source", _s),
            ("source_index", _i),
        ]
    ),
    "warmstart": pa.schema([("run_id", _s), ("step", _i), ("loss", _f), ("examples", _i), ("lr", _f)]),
    "difficulty": pa.schema(
        [
            ("run_id", _s),
            ("problem_id", _s),
            ("policy_id", _s),
            ("k", _i),
            ("successes", _i),
            ("pass_rate", _f),
            ("beta_alpha", _f),
            ("beta_beta", _f),
            ("posterior_mean", _f),
            ("bin", _i),
        ]
    ),
    "selections": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("slot", _i),
            ("problem_id", _s),
            ("arm", _s),
            ("probability", _f),
            ("strategy", _s),
            ("hint_ratio", _f),  # GHPO: the share of the problem's solution shown as a hint (0: none)
        ]
    ),
    "allocations": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("slot", _i),
            ("problem_id", _s),
            ("n_rollouts", _i),
            ("p_hat", _f),
            ("p_hat_source", _s),
            ("buffer_count", _i),
            ("case", _s),
            ("value", _f),
            ("fallback", pa.bool_()),
            ("allocator", _s),
        ]
    ),
    # Dynamic sampling: one row per group of a step (every round), and whether it trains.
    "filtered_groups": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("round", _i),
            ("slot", _i),
            ("problem_id", _s),
            ("rollouts", _i),
            ("mean_reward", _f),
            ("kept", pa.bool_()),
            ("reason", _s),
        ]
    ),
    # CLPO: one row per group of a step: its online difficulty, and the rewrite it got, if any.
    "restructured": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("slot", _i),
            ("problem_id", _s),
            ("accuracy", _f),
            ("label", _s),
            ("kl_weight", _f),
            ("mode", _s),
            ("rewrite_prompt", _s),
            ("rewrite_answer", _s),
            ("rewrite_accuracy", _f),
            ("kept", pa.bool_()),
            ("reason", _s),
        ]
    ),
    # One row per arm per step, written by the curriculum update; a strategy may add its own columns.
    "curriculum_state": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("strategy", _s),
            ("arm", _s),
            ("pool_size", _i),
            ("q_before", _f),
            ("probability", _f),
            ("pulls", _i),
            ("reward", _f),
            ("q_after", _f),
        ]
    ),
    "rollouts": pa.schema(
        [
            ("rollout_id", _s),
            ("run_id", _s),
            ("step", _i),
            ("slot", _i),
            ("problem_id", _s),
            ("sample_index", _i),
            ("prompt", _s),
            ("response", _s),
            ("completion_ids", pa.list_(_i)),
            ("n_tokens", _i),
            ("finish_reason", _s),
            ("policy_id", _s),
            ("staleness", _i),  # the step that trains on it minus the step whose policy sampled it (0: in sync)
            ("logprobs", pa.list_(pa.float32())),  # the sampling policy's, per token (stored with flow.async_level)
            ("hint_ratio", _f),  # GHPO: the share of the solution the prompt showed (0: none; `prompt` includes it)
            # Episodes of an environment (env.type): null on a one-turn rollout of the default, which trains on
            # every completion token after the prompt's own tokenization.
            ("prompt_ids", pa.list_(_i)),  # the opening (messages and tools) as the model read it
            ("loss_mask", pa.list_(pa.int8())),  # 1 on sampled tokens, 0 on the environment's (tool output ...)
            ("n_turns", _i),  # assistant turns
            ("stop_reason", _s),  # done, max_turns, token_budget, tool_timeout, error
            ("env", _s),  # environment name and version, "name@version"
            ("env_reward", _f),  # the environment's own reward (sum over turns), when it gives one
            ("env_verdict", _s),  # its verdict as JSON (status, extracted, reason, components), when it gives one
            ("turn_starts", pa.list_(_i)),  # where each assistant turn starts in completion_ids
            ("turn_rewards", pa.list_(_f)),  # each assistant turn's reward from the environment (null: none)
        ]
    ),
    "turns": pa.schema(
        [
            ("rollout_id", _s),
            ("run_id", _s),
            ("step", _i),
            ("problem_id", _s),
            ("turn", _i),  # 0, 1, ... in the trajectory, assistant and environment turns alike
            ("role", _s),  # assistant, tool, user
            ("token_start", _i),  # the turn's span in the rollout's completion_ids, end exclusive
            ("token_end", _i),
            ("text", _s),  # the assistant's decoded turn, or the environment message's content
            ("tool_names", pa.list_(_s)),  # the calls answered on this turn, in order
            ("tool_arguments", pa.list_(_s)),
            ("tool_outputs", pa.list_(_s)),
            ("tool_statuses", pa.list_(_s)),  # ok, error, timeout, malformed
            ("reward", _f),
            ("seconds", _f),
            ("stop_reason", _s),  # on the trajectory's last turn: why it ended
        ]
    ),
    "rewards": pa.schema(
        [
            ("rollout_id", _s),
            ("run_id", _s),
            ("step", _i),
            ("problem_id", _s),
            ("verifier", _s),
            ("verifier_version", _s),
            ("score", _f),
            ("status", _s),
            ("extracted", _s),
            ("reason", _s),
            ("components", _s),
            ("cache_hit", pa.bool_()),
            # a model-given reward's (the judge's): seconds the call took (0 from the cache), and where it came from
            # as JSON (endpoint, model, template_sha; RLPR's: the policy and its probabilities); null for a verifier's
            ("latency_s", _f),
            ("provenance", _s),
        ]
    ),
    # RLPR's debiasing terms (label.reward=rlpr): the policy's mean per-token probability of a problem's reference
    # right after its prompt, with no reasoning, once per (problem, policy) (tasks/rlpr.py)
    "rlpr_debias": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("problem_id", _s),
            ("policy_id", _s),
            ("probability", _f),
            ("n_tokens", _i),
        ]
    ),
    "reward_cache": pa.schema(
        [
            ("verifier", _s),
            ("verifier_version", _s),
            ("response_hash", _s),
            ("reference_hash", _s),
            ("score", _f),
            ("status", _s),
            ("extracted", _s),
            ("reason", _s),
            ("components", _s),
        ]
    ),
    "relabel_flips": pa.schema(
        [
            ("rollout_id", _s),
            ("run_id", _s),
            ("step", _i),
            ("old_verifier_version", _s),
            ("new_verifier_version", _s),
            ("old_score", _f),
            ("new_score", _f),
            ("old_status", _s),
            ("new_status", _s),
        ]
    ),
    "train_steps": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("policy_id", _s),
            ("loss", _f),
            ("mean_reward", _f),
            ("reward_std", _f),
            ("effective_ratio", _f),
            ("groups", _i),
            ("rollouts", _i),
            ("reward_errors", _i),  # rollouts left out: a model's verdict on them failed (status error)
            ("clip_fraction", _f),
            ("kl", _f),
            ("ref_kl", _f),
            ("entropy", _f),
            ("grad_norm", _f),
            ("lr", _f),
            ("updates", _i),
            ("compute_seconds", _f),
            ("device", _s),
            ("peak_memory_bytes", _i),
            # rollouts carrying their sampler's log-probs (async, train.grpo.correction): |log π_sampler - log
            # π_trainer| mean and max over the sampled tokens, the k3 KL(sampler ‖ trainer), the share of tokens a
            # correction truncated, rejected or zeroed (else null)
            ("mismatch_mean", _f),
            ("mismatch_max", _f),
            ("mismatch_kl", _f),
            ("corrected_share", _f),
        ]
    ),
    "train_state": pa.schema([("run_id", _s), ("step", _i), ("optimizer_steps", _i), ("n_params", _i)]),
    "evals": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("phase", _s),
            ("split", _s),
            ("policy_id", _s),
            ("accuracy", _f),
            ("correct", _i),
            ("n", _i),
            # evaluate.samples = k > 0: k sampled answers a problem, mean@k and its Wilson 95% interval (else null)
            ("samples", _i),
            ("sampled_correct", _i),
            ("mean_at_k", _f),
            ("mean_at_k_low", _f),
            ("mean_at_k_high", _f),
        ]
    ),
    "checkpoints": pa.schema(
        [
            ("run_id", _s),
            ("step", _i),
            ("artifact_id", _s),
            ("stage", _s),
            ("policy_id", _s),
            ("n_params", _i),
        ]
    ),
    "firings": pa.schema(
        [
            ("schedule", _s),
            ("run_id", _s),
            ("scheduled_at", _s),
            ("outcome", _s),
            ("reason", _s),
            ("start_checkpoint", _s),
            ("blocked_by", _s),
            ("flow_run_id", _s),
            ("recorded_at", _s),
        ]
    ),
}

SCHEMAS["relabeled_rewards"] = SCHEMAS["rewards"]

# Kinds whose rows may carry columns beyond the declared ones (each strategy audits its own way);
# the declared columns always come first with their declared types.
OPEN_KINDS = frozenset({"curriculum_state"})


def schema_for(kind: str) -> pa.Schema | None:
    """The declared schema of `kind`, or None for kinds that declare none."""
    return SCHEMAS.get(kind)
