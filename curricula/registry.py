"""Which selection strategies and budget allocators exist.

A strategy (or allocator) is one module: a config class (a `SelectConfig` / `AllocateConfig` subclass
with a `type: Literal[...]` field) and the class that does the work. Registering the pair here, or from
any other module with `STRATEGIES.register` / `ALLOCATORS.register`, makes `--set select.type=NAME`
(`allocate.type=NAME`) choose it (see rlvr/plugins.py).
"""

from __future__ import annotations

from rlvr.curricula.base import AllocateConfig, BudgetAllocator, SelectConfig, SelectionStrategy
from rlvr.curricula.dads import DadsConfig, DadsStrategy
from rlvr.curricula.knapsack import KnapsackAllocator, KnapsackConfig
from rlvr.curricula.prioritized import PrioritizedConfig, PrioritizedStrategy
from rlvr.curricula.sec import SecConfig, SecStrategy
from rlvr.curricula.uniform import UniformConfig, UniformStrategy
from rlvr.curricula.uniform_budget import UniformBudget, UniformBudgetConfig
from rlvr.curricula.vas import VasConfig, VasStrategy
from rlvr.plugins import TypedRegistry

STRATEGIES: TypedRegistry[SelectionStrategy] = TypedRegistry(
    "selection strategy", SelectConfig, SelectionStrategy, group="rlvr.strategies"
)
ALLOCATORS: TypedRegistry[BudgetAllocator] = TypedRegistry(
    "budget allocator", AllocateConfig, BudgetAllocator, group="rlvr.allocators"
)


def make_strategy(cfg: SelectConfig) -> SelectionStrategy:
    """A fresh strategy for `cfg` (its state is loaded by the caller)."""
    return STRATEGIES.make(cfg)


def make_allocator(cfg: AllocateConfig) -> BudgetAllocator:
    return ALLOCATORS.make(cfg)


STRATEGIES.register(UniformConfig, UniformStrategy)
ALLOCATORS.register(UniformBudgetConfig, UniformBudget)
STRATEGIES.register(SecConfig, SecStrategy)
STRATEGIES.register(PrioritizedConfig, PrioritizedStrategy)
STRATEGIES.register(VasConfig, VasStrategy)
STRATEGIES.register(DadsConfig, DadsStrategy)
ALLOCATORS.register(KnapsackConfig, KnapsackAllocator)
