"""Budget allocators: how many rollouts each selected problem gets under a total budget."""

from __future__ import annotations


def allocate_uniform(n_prompts: int, rollouts_per_prompt: int) -> list[int]:
    """The same number of rollouts for every prompt (the GRPO default); total = n_prompts * n."""
    if rollouts_per_prompt < 1:
        raise ValueError(f"rollouts_per_prompt must be >= 1, got {rollouts_per_prompt}")
    return [rollouts_per_prompt] * n_prompts
