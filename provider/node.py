"""The node: the one engine and its models, with an asyncio face for the front ends.

`Node.run(job)` is the single job path the local HTTP API and the coordinator
session both use: submit a Job, iterate its Events until a terminal one.
Closing the stream early (client gone, coordinator lost) cancels the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import uuid
from typing import AsyncIterator, Callable

from . import logs
from .engine.scheduler import Engine
from .jobs import TERMINAL, Event, Job, JobError
from .memory.budget import GiB, Budget, decide_budget, pin_mlx_limits, system_facts
from .models import store
from .models.manager import ModelManager
from .prompts import PromptPreparer
from .settings import ModelSpec, Settings
from .speculation import SpeculationConfig

log = logs.get("node")


class JobStream:
    """Async iterator over one job's events; `aclose()` cancels the job if it is still running."""

    def __init__(self, engine: Engine, job: Job, prepare: Callable[[Job], concurrent.futures.Future]):
        self.job = job
        self._engine = engine
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._finished = False
        loop = asyncio.get_running_loop()
        engine.submit(job, lambda ev: loop.call_soon_threadsafe(self._queue.put_nowait, ev), prepare)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if isinstance(ev, TERMINAL):
            self._finished = True
        return ev

    def drain_ready(self) -> list[Event]:
        """Events already delivered, without waiting (lets front ends coalesce token chunks)."""
        out: list[Event] = []
        while not self._finished and not self._queue.empty():
            ev = self._queue.get_nowait()
            out.append(ev)
            if isinstance(ev, TERMINAL):
                self._finished = True
        return out

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine.cancel(self.job.id)

    async def __aenter__(self) -> "JobStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _failed_future(e: Exception) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(e)
    return future


def decide_node_budget(settings: Settings) -> Budget:
    return decide_budget(system_facts(), fraction=settings.memory_fraction,
                         reserve_bytes=int(settings.memory_reserve_gb * GiB),
                         override_bytes=int(settings.memory_budget_gb * GiB))


def build_models(settings: Settings, primary: list[ModelSpec] = (), budget: Budget | None = None) -> ModelManager:
    """The model manager for these settings: `primary` first (the default), then everything discovered."""
    models = store.discover(settings, list(primary))
    return ModelManager(
        models,
        budget or decide_node_budget(settings),
        max_resident=settings.max_resident_models,
        idle_timeout=settings.idle_timeout_s,
        kv_reserve_tokens=settings.kv_reserve_tokens,
        prefill_step=settings.prefill_step_size,
        speculation=SpeculationConfig.of(settings),
    )


class Node:
    def __init__(self, settings: Settings, models: ModelManager):
        self.settings = settings
        self.models = models
        self.engine = Engine(
            models,
            max_concurrent=settings.max_concurrent_jobs,
            max_queued=settings.max_queued_jobs,
            prefill_step_size=settings.prefill_step_size,
        )
        self.prompts = PromptPreparer(models.checkpoint)

    def start(self) -> None:
        pin_mlx_limits(self.models.budget)
        self.engine.start()
        log.info("node_started", models=self.models.ids(), default_model=self.models.default_id)

    def run(self, job: Job) -> JobStream:
        """Submit a job; its prompt is checked against its model and tokenized off the engine thread."""
        try:
            job = dataclasses.replace(job, model=self.models.canonical_id(job.model))
        except JobError as e:
            return JobStream(self.engine, job, lambda _, error=e: _failed_future(error))
        return JobStream(self.engine, job, self.prompts.prepare)

    @property
    def healthy(self) -> bool:
        return self.engine.failure is None

    async def stop(self, grace_s: float = 10.0) -> None:
        await asyncio.to_thread(self.engine.stop, grace_s)
        self.prompts.close()
        self.models.close()
        log.info("node_stopped")

    @staticmethod
    def new_job_id(prefix: str = "job") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"
