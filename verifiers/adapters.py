"""Our verifiers as reward functions of other trainers: TRL's `reward_funcs` and verl's `compute_score`.

Both score in-process by default (one verifier instance per name, `score_safely`, so a verifier exception
is a 0.0 reward, never a crashed training step). Pass a started `VerifierPool` to `trl_reward_func` to get
the pool's hard timeouts instead. Rewards are `Score.value`: timeout, error and unparseable are 0.0.
The TRL reward routes each row by the dataset's `verifier` column when there is one, as verl routes by
`data_source`; `rlvr.data.export` writes both layouts from the problems table.

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


def _reference_values(columns: dict[str, Any], reference_column: str, count: int) -> list[Any]:
    """The references, one per completion. The default column "reference" (the problems table's) falls
    back to "answer", the column name of TRL's own examples and of this adapter before mixed datasets."""
    column = reference_column
    if column == "reference" and column not in columns and "answer" in columns:
        column = "answer"
    if column not in columns:
        available = ", ".join(sorted(k for k in columns if k not in ("completion_ids", "trainer_state"))) or "none"
        raise UserError(f"reward column {reference_column!r} is not in the dataset; columns passed: {available}")
    references = list(columns[column])
    if len(references) != count:
        raise UserError(f"{count} completions but {len(references)} values in column {column!r}")
    return references


def _row_verifier_names(columns: dict[str, Any], verifier_column: str | None, default: str, count: int) -> list[str]:
    """The verifier of each row: the dataset's verifier column when it is passed, else `default` for all."""
    if verifier_column is None or verifier_column not in columns:
        return [default] * count
    names = list(columns[verifier_column])
    if len(names) != count:
        raise UserError(f"{count} completions but {len(names)} values in column {verifier_column!r}")
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise UserError(f"row {index} has no verifier in column {verifier_column!r} (got {name!r})")
    return names


def trl_reward_func(
    verifier_name: str = "math",
    reference_column: str = "reference",
    pool: VerifierPool | None = None,
    verifier_column: str | None = "verifier",
) -> Callable[..., list[float]]:
    """A function for `GRPOTrainer(reward_funcs=[...])`: one float per completion.

    TRL calls it as `reward_func(prompts=..., completions=..., completion_ids=..., trainer_state=...,
    **dataset_columns)`, each column a list aligned with `completions`. The reference is
    `columns[reference_column]` ("reference", else "answer" when only that is passed). When the dataset
    passes `verifier_column`, each row is scored by the verifier it names, so one reward function serves
    a mixed-domain dataset (e.g. `rlvr export --format trl`); otherwise every row uses `verifier_name`.
    Pass `verifier_column=None` to force `verifier_name` on every row.

    A pool runs one verifier: with a verifier column, a row naming another verifier is a `UserError`
    (no silent in-process fallback that would lose the pool's timeouts); use one reward function per pool.
    """
    if pool is not None and pool.spec != verifier_spec(verifier_name):
        raise UserError(f"the pool runs verifier {pool.spec!r}, not {verifier_name!r}")
    verifiers: dict[str, Verifier] = {verifier_name: get_verifier(verifier_name)}

    def verifier_for(name: str) -> Verifier:
        if name not in verifiers:
            verifiers[name] = get_verifier(name)  # UserError "unknown verifier 'x'; registered: ..."
        return verifiers[name]

    def reward_func(
        prompts: list[Any] | None = None, completions: list[Any] | None = None, **columns: Any
    ) -> list[float]:
        completions = completions or []
        references = _reference_values(columns, reference_column, len(completions))
        names = _row_verifier_names(columns, verifier_column, verifier_name, len(completions))
        responses = [completion_text(c) for c in completions]
        if pool is not None:
            for name in sorted(set(names)):
                if verifier_spec(name) != pool.spec:
                    raise UserError(f"the pool runs verifier {pool.spec!r}, but a row names {name!r}")
            scores = pool.score_many(list(zip(responses, references)))
        else:
            scores = [score_safely(verifier_for(n), r, ref) for n, r, ref in zip(names, responses, references)]
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
