"""Our verifiers as reward functions of other trainers: TRL's `reward_funcs` and verl's `compute_score`.

Both score in-process by default (one verifier instance, `score_safely`, so a verifier exception is a
0.0 reward, never a crashed training step). Pass a started `VerifierPool` to `trl_reward_func` to get
the pool's hard timeouts instead. Rewards are `Score.value`: timeout, error and unparseable are 0.0.

verl data sources: a `data_source` that is a registered verifier name uses that verifier; the data
sets verl's own `default_compute_score` treats as math (GSM8K, MATH, MATH-500, DAPO, AIME, Numina)
map to our `math` verifier (`VERL_DATA_SOURCES`, plus the prefixes in `VERL_DATA_SOURCE_PREFIXES`);
anything else raises `UserError`, as verl itself does for a data source it does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlvr.errors import UserError
from rlvr.verifiers.base import Verifier
from rlvr.verifiers.pool import VerifierPool, score_safely
from rlvr.verifiers.registry import get_verifier, registered, verifier_spec

VERL_DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    "BytedTsinghua-SIA/DAPO-Math-17k": "math",
    "numina_aops_forum": "math",
    "numina_synthetic_math": "math",
    "numina_amc_aime": "math",
    "numina_synthetic_amc": "math",
    "numina_cn_k12": "math",
    "numina_olympiads": "math",
}
VERL_DATA_SOURCE_PREFIXES: dict[str, str] = {"aime": "math", "numina_": "math"}


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a string, or a conversation whose last assistant turn counts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        messages = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in messages if m.get("role") == "assistant"] or messages
        if not assistant:
            return ""
        content = assistant[-1].get("content", "")
        if isinstance(content, list):  # multimodal content parts: [{"type": "text", "text": ...}]
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else str(content)
    return str(completion)


def trl_reward_func(
    verifier_name: str = "math",
    reference_column: str = "answer",
    pool: VerifierPool | None = None,
) -> Callable[..., list[float]]:
    """A function for `GRPOTrainer(reward_funcs=[...])`: one float per completion.

    TRL calls it as `reward_func(prompts=..., completions=..., completion_ids=..., **dataset_columns)`;
    the reference is `columns[reference_column]`, a list aligned with `completions`.
    """
    if pool is not None and pool.spec != verifier_spec(verifier_name):
        raise UserError(f"the pool runs verifier {pool.spec!r}, not {verifier_name!r}")
    verifier: Verifier = get_verifier(verifier_name)

    def reward_func(
        prompts: list[Any] | None = None, completions: list[Any] | None = None, **columns: Any
    ) -> list[float]:
        completions = completions or []
        if reference_column not in columns:
            available = ", ".join(sorted(k for k in columns if k not in ("completion_ids", "trainer_state"))) or "none"
            raise UserError(f"reward column {reference_column!r} is not in the dataset; columns passed: {available}")
        references = list(columns[reference_column])
        if len(references) != len(completions):
            raise UserError(
                f"{len(completions)} completions but {len(references)} values in column {reference_column!r}"
            )
        responses = [completion_text(c) for c in completions]
        if pool is not None:
            scores = pool.score_many(list(zip(responses, references)))
        else:
            scores = [score_safely(verifier, r, ref) for r, ref in zip(responses, references)]
        return [float(score.value) for score in scores]

    reward_func.__name__ = f"{verifier_name}_reward"
    return reward_func


def verl_verifier_name(data_source: str) -> str:
    """The verifier that scores a verl `data_source` (see the module docstring)."""
    if data_source in registered():
        return data_source
    if data_source in VERL_DATA_SOURCES:
        return VERL_DATA_SOURCES[data_source]
    for prefix, name in VERL_DATA_SOURCE_PREFIXES.items():
        if data_source.startswith(prefix):
            return name
    known = ", ".join([*registered(), *VERL_DATA_SOURCES])
    raise UserError(f"no verifier for verl data source {data_source!r}; known: {known}")


_verl_verifiers: dict[str, Verifier] = {}  # data_source -> verifier; verl calls once per sample


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's reward-function signature (`custom_reward_function.name: compute_score`)."""
    if data_source not in _verl_verifiers:
        _verl_verifiers[data_source] = get_verifier(verl_verifier_name(data_source))
    return float(score_safely(_verl_verifiers[data_source], solution_str, ground_truth).value)
