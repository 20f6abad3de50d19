"""Test helpers that drive real parts: the CLI in a subprocess, the node in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

from provider.jobs import Done, Error, Job, SamplingParams, Tokens
from provider.memory.budget import Budget
from provider.models.catalog import Catalog
from provider.models.residency import Residency
from provider.models.store import StoredModel
from provider.node import Node
from provider.settings import Settings
from provider.speculation import SpeculationConfig
from tools.daemon import LocalServer  # noqa: F401 (tests import it from here)


def make_manager(models: dict[str, Path], budget_bytes: int = 4 << 30, drafters: dict[str, Path] | None = None,
                 **kw) -> Residency:
    drafters = drafters or {}
    stored = [StoredModel(k, str(v), v if v.is_dir() else None, "configured",
                          drafter=str(drafters[k]) if k in drafters else None) for k, v in models.items()]
    return Residency(Catalog(stored, allow_download=False), Budget(budget_bytes, 0, "test"), **kw)


def make_node(models: dict[str, Path], budget_bytes: int = 4 << 30, manager_kw: dict | None = None,
              **settings) -> Node:
    s = Settings(**settings)  # the one place the speculation policy and k are set
    node = Node(s, make_manager(models, budget_bytes, speculation=SpeculationConfig.of(s), **(manager_kw or {})))
    node.start()
    return node


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(node: Node, job: Job):
    """Run a job to its end; return (token ids, text, terminal event, all events)."""
    ids, text, events = [], [], []
    async with node.run(job) as stream:
        async for ev in stream:
            events.append(ev)
            if isinstance(ev, Tokens):
                ids.extend(ev.token_ids)
                text.append(ev.text)
    end = events[-1]
    assert isinstance(end, (Done, Error))
    return ids, "".join(text), end, events


def run(coro):
    return asyncio.run(coro)
