"""Per-problem outcome buffers: each problem's most recent outcomes, and the success-rate estimate
Knapsack RL allocates on (docs/methods.md#outcome-buffers: the last 16 outcomes, valid once it holds 8).

Plain data, no I/O: the allocate stage fills it from the run's rewards (incrementally, or rebuilt by a
query over the rewards view in a fresh process) and asks it for estimates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rlvr.curricula.base import Estimate

BUFFER_LENGTH = 16
MIN_OUTCOMES = 8


class OutcomeBuffers:
    """The last `length` outcomes of every problem seen; an estimate needs at least `minimum` of them."""

    def __init__(self, length: int = BUFFER_LENGTH, minimum: int = MIN_OUTCOMES) -> None:
        if not 1 <= minimum <= length:
            raise ValueError(f"need 1 <= minimum <= length, got minimum {minimum} and length {length}")
        self.length = length
        self.minimum = minimum
        self._outcomes: dict[str, deque[float]] = {}

    def add(self, problem_id: str, outcomes: Iterable[float]) -> None:
        """Append outcomes (oldest first); only the newest `length` are kept."""
        buffer = self._outcomes.setdefault(problem_id, deque(maxlen=self.length))
        buffer.extend(float(o) for o in outcomes)

    def outcomes(self, problem_id: str) -> list[float]:
        return list(self._outcomes.get(problem_id, ()))

    def estimate(self, problem_id: str) -> Estimate | None:
        """The buffer's mean success when it holds at least `minimum` outcomes, else None."""
        buffer = self._outcomes.get(problem_id)
        if buffer is None or len(buffer) < self.minimum:
            return None
        return Estimate(sum(buffer) / len(buffer), count=len(buffer), source="buffer")

    def copy(self) -> OutcomeBuffers:
        twin = OutcomeBuffers(self.length, self.minimum)
        twin._outcomes = {pid: deque(buffer, maxlen=self.length) for pid, buffer in self._outcomes.items()}
        return twin

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutcomeBuffers) and {k: list(v) for k, v in self._outcomes.items()} == {
            k: list(v) for k, v in other._outcomes.items()
        }
