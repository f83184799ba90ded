"""Decoding by every data-parallel rank over a model sharded unit by unit (`train.sharding=fsdp`), no rank holding
the whole weights: each forward gathers one unit at a time, a collective, so every rank must run as many forwards
as the others, whatever its own share of the prompts asks.

The ranks decode in rounds. A rank with a batch to decode opens a round (`open_round`): one small all-reduce tells
every rank whether anyone decodes, whether anyone computes a shared-prompt prefill first, and the longest
completion asked. Then each rank runs `generate` with `synced_gpus=True`, which keeps the ranks' token steps
together (a rank whose rows have all ended runs forwards on until every rank's have). A rank whose share is done,
or was empty, joins the others' rounds with an idle prefill and an idle one-token generate (`drain`) until a round
finds nobody decoding. Multi-turn episodes, whose ranks decode different numbers of turns, fit the same rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Round:
    """What the ranks agreed on for one round: whether any rank prefills a shared-prompt cache (each rank that
    does not runs an idle forward then), and the most new tokens any rank asked for (what a static cache is sized
    by, as a rank's forwards may run on to it)."""

    prefills: bool
    new_tokens: int


@dataclass
class Lockstep:
    """One decoding operation's rounds on this rank. `idle_forward` runs one forward of the model on a one-token
    row; `idle_generate` one synced `generate` of one new token on it (trainer/generation.py gives both)."""

    device: torch.device
    idle_forward: Callable[[], None]
    idle_generate: Callable[[], None]

    def _agree(self, decodes: bool, prefills: bool, new_tokens: int) -> tuple[bool, Round]:
        flags = torch.tensor([int(decodes), int(prefills), new_tokens], dtype=torch.long, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), Round(prefills=bool(flags[1].item()), new_tokens=int(flags[2].item()))

    def open_round(self, prefills: bool, new_tokens: int) -> Round:
        """This rank decodes a batch: the round every rank then runs (call `generate` with `synced_gpus=True`)."""
        _, agreed = self._agree(True, prefills, new_tokens)
        return agreed

    def drain(self) -> None:
        """Join the other ranks' rounds with idle passes until no rank decodes. Every rank calls it once its own
        share is decoded; they all leave at the same round."""
        while True:
            anyone, agreed = self._agree(False, False, 0)
            if not anyone:
                return
            if agreed.prefills:
                self.idle_forward()
            self.idle_generate()
