"""What this machine makes of the settings, below the node so that every process kind can ask: the memory
budget, and the engine's step size. Both the node and a group's worker rank (provider.group.follower) use them."""

from __future__ import annotations

from .engine.prefill_plan import longest_read, step_tokens
from .memory.budget import GiB, Budget, decide_budget, system_facts
from .settings import Settings


def decide_node_budget(settings: Settings) -> Budget:
    return decide_budget(system_facts(), fraction=settings.memory_fraction,
                         reserve_bytes=int(settings.memory_reserve_gb * GiB),
                         override_bytes=int(settings.memory_budget_gb * GiB))


def node_step_tokens(settings: Settings) -> int:
    """Tokens per engine step (prefill_plan): the configured prefill_step_size, or the device's default."""
    return step_tokens(settings.prefill_step_size, system_facts().backend)


def longest_prefill_read(settings: Settings) -> int:
    """The most prompt tokens one row reads in a step: what a model's footprint holds prefill scratch for."""
    return longest_read(node_step_tokens(settings))
