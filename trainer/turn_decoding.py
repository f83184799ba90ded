"""How one turn of the rollout loop (trainer/episodes.py) decodes: every running episode's token-id row in, at most
its budget of sampled ids out, each row drawn with its key. On the policy in this process (`PolicyDecoding`: one
`continue_rows` call, the one implementation of continuing token rows on the policy, which the transformers engine's
`continue_rows` is too) or through a rollout engine that keeps its own weights (`EngineDecoding`: vLLM, a server).
A grouped first turn (`TurnDecoding.groups`) draws each task's episodes as one prompt's group, as the engine samples
a batch of prompts, so the one-turn default draws the tokens `generation.sample` draws.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from rlvr.environments.base import Opening
from rlvr.trainer.engine_base import RolloutEngine, SamplingParams
from rlvr.trainer.generation import Cache, Precision, TokenLogprobs, _generate_ids
from rlvr.trainer.policy import Policy
from rlvr.trainer.rng import seeded_rng
from rlvr.trainer.row_sampling import RowSampler, mix64

__all__ = ["Draw", "EngineDecoding", "PolicyDecoding", "TurnDecoding", "continue_rows", "engine_seed"]


@dataclass(frozen=True)
class Draw:
    """One row's sampled ids (ending with the eos when it stopped), their log-probs when recorded, and, from an engine
    that gives them with a group draw, its text of the ids and why they ended (else the loop decodes the ids with the
    policy's tokenizer and reads the ending from the eos)."""

    ids: list[int]
    logprobs: list[float] | None = None
    text: str | None = None
    finish_reason: Literal["stop", "length"] | None = None


class TurnDecoding(Protocol):
    """How a turn decodes. `turn`: each running episode's row (its whole conversation as token ids) in, at most its
    budget of sampled ids out, each row drawn with its key. `groups`: the first turn of a grouped call
    (`run_episodes` without row keys): task i's `counts[i]` running episodes share its opening (`openings[i]`, its
    ids the rows'), drawn as the engine samples a batch of prompts. Log-probs come with the ids when
    `records_logprobs`."""

    @property
    def records_logprobs(self) -> bool: ...

    def turn(self, rows: list[list[int]], keys: list[int], budgets: list[int]) -> list[Draw]: ...

    def groups(
        self, rows: list[list[int]], openings: list[Opening | None], counts: list[int], budget: int
    ) -> list[Draw]: ...


def continue_rows(
    policy: Policy,
    rows: Sequence[Sequence[int]],
    budgets: Sequence[int],
    *,
    temperature: float,
    top_p: float,
    keys: Sequence[int] | None,
    seed: int = 0,
    cache: Cache = "shared_prompt",
    precision: Precision = "auto",
    logprob_temperature: float | None = None,
) -> tuple[list[list[int]], list[list[float]] | None]:
    """At most `budgets[i]` new tokens after each token-id row (its whole context), all rows in one batch, cut after
    the first eos, and with `logprob_temperature` their log-probs under the raw logits at that temperature
    (`TokenLogprobs`; else None): the one implementation of continuing token rows on the policy, which the loop's
    turns and the transformers engine's `continue_rows` both are.

    `keys`: row i draws with key `keys[i]` (trainer/row_sampling.py: the same tokens in any batch that holds it);
    None: every row draws from one torch stream seeded with `seed`, as `generation.sample` draws a batch of prompts
    (rollout.seeding=batch), so a row's tokens depend on the rows beside it. Temperature 0: greedy, whatever the keys.
    """
    if not rows:
        return [], None
    recorder = None if logprob_temperature is None else TokenLogprobs(logprob_temperature)
    whole, longest = [list(row) for row in rows], max(budgets)
    if temperature == 0:
        ids, logprobs = _generate_ids(policy, whole, longest, cache, precision, recorder, None, do_sample=False)
    elif keys is None:
        with seeded_rng(seed, policy.model.device):
            ids, logprobs = _generate_ids(
                policy, whole, longest, cache, precision, recorder,
                do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
            )  # fmt: skip
    else:
        drawn = RowSampler(temperature, top_p, list(keys))
        ids, logprobs = _generate_ids(policy, whole, longest, cache, precision, recorder, drawn, do_sample=False)
    cut = [row[:budget] for row, budget in zip(ids, budgets)]
    return cut, [lp[:budget] for lp, budget in zip(logprobs, budgets)] if logprobs else None


@dataclass(frozen=True)
class PolicyDecoding:
    """Turns decoded on the policy in this process (the transformers engine) by `continue_rows`: a keyed turn
    row-seeded by the turn keys, a grouped first turn from one torch stream seeded with `seed`; with
    `logprob_temperature`, the sampled tokens' log-probs recorded as they are drawn (`TokenLogprobs`)."""

    policy: Policy
    temperature: float
    top_p: float
    seed: int
    cache: Cache
    precision: Precision
    logprob_temperature: float | None

    @property
    def records_logprobs(self) -> bool:
        return self.logprob_temperature is not None

    def turn(self, rows: list[list[int]], keys: list[int], budgets: list[int]) -> list[Draw]:
        return self._draw(rows, keys, budgets)

    def groups(
        self, rows: list[list[int]], openings: list[Opening | None], counts: list[int], budget: int
    ) -> list[Draw]:
        return self._draw(rows, None, [budget] * len(rows))

    def _draw(self, rows: list[list[int]], keys: list[int] | None, budgets: list[int]) -> list[Draw]:
        ids, logprobs = continue_rows(
            self.policy, rows, budgets, temperature=self.temperature, top_p=self.top_p, keys=keys, seed=self.seed,
            cache=self.cache, precision=self.precision, logprob_temperature=self.logprob_temperature,
        )  # fmt: skip
        return [Draw(row, None if logprobs is None else logprobs[i]) for i, row in enumerate(ids)]


@dataclass(frozen=True)
class EngineDecoding:
    """Turns decoded by a rollout engine that keeps its own weights (vLLM in this process, a server elsewhere): a keyed
    turn is one `continue_rows` call, each row with a seed made from its turn key; a grouped first turn is one
    `generate` call, the engine's own draw of `counts[i]` samples of each opening (one request a group), each opening
    sent as a chat prompt (its messages), which every engine renders to the opening's ids (trainer/prompts.py).
    With `logprob_temperature`, a grouped turn asks the engine for its tokens' log-probs (`SamplingParams`); an
    engine gives them only at temperature 1 (vLLM's and a server's are of the raw logits), and a keyed turn never,
    so an episode that has a turn without them carries none (the rollout stage computes the sampling policy's)."""

    engine: RolloutEngine
    temperature: float
    top_p: float
    seed: int
    logprob_temperature: float | None = None

    @property
    def records_logprobs(self) -> bool:
        return self.logprob_temperature is not None

    def turn(self, rows: list[list[int]], keys: list[int], budgets: list[int]) -> list[Draw]:
        seeds = [engine_seed(key) for key in keys]
        continued = self.engine.continue_rows(rows, budgets, self.temperature, self.top_p, seeds)
        return [Draw(ids[:budget]) for (ids, _), budget in zip(continued, budgets)]

    def groups(
        self, rows: list[list[int]], openings: list[Opening | None], counts: list[int], budget: int
    ) -> list[Draw]:
        first = 0
        for count in counts:  # a group is one prompt: its episodes opened alike
            if any(row != rows[first] for row in rows[first : first + count]):
                raise ValueError("a grouped first turn (row_keys=None) needs a task's episodes to open alike")
            first += count
        prompts = [_as_prompt(opening) if count else "" for opening, count in zip(openings, counts)]
        sampling = SamplingParams(budget, self.temperature, self.top_p, self.seed, self.logprob_temperature)
        return [
            Draw(
                s.completion_ids[:budget], None if s.logprobs is None else s.logprobs[:budget], s.text, s.finish_reason
            )
            for s in self.engine.generate(prompts, counts, sampling)
        ]


def _as_prompt(opening: Opening | None) -> str:
    """An opening as the chat prompt an engine's `generate` takes: its messages' JSON (rlvr/chat.py), which reads as
    the opening does; an opening with tools has no such prompt."""
    if opening is None or opening.tools:
        raise ValueError("a grouped first turn (row_keys=None) sends each opening as a prompt, without tools")
    return json.dumps(opening.messages)


def engine_seed(key: int) -> int:
    """The seed an engine draws a row's turn with: its turn key (a signed 64-bit int) mixed down to 31 bits, so that
    a server whose seed is a 32-bit int takes it too (vLLM's takes any int64)."""
    return mix64(key) >> 33
