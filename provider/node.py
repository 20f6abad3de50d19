"""The node: the one engine and its models, with an asyncio face for the front ends.

`Node.run(job)` is the single job path the local HTTP API and the coordinator
session both use: submit a Job, iterate its events until a terminal one (a
JobStream, provider/job_stream.py); closing the stream early cancels the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import platform
import threading
import uuid
from typing import Callable

from . import logs
from .engine import profile
from .engine.running import Running
from .engine.prefix_disk import DiskTier
from .engine.scheduler import Engine
from .group.lockstep import LeaderRunning
from .group.member import EXIT_GROUP_LOST, Membership, Watchdog
from .jobs import Job, JobError, check_vocabulary
from .job_stream import JobStream
from .keep_alive import parse_keep_alive
from .types import Cause, ModelId
from .machine import decide_node_budget, longest_prefill_read, node_step_tokens
from .memory.budget import Budget, freeze_startup_heap, pin_mlx_limits, system_facts
from .models import store
from .models.catalog import Catalog
from .models.residency import Residency
from .prompts import PromptPreparer, encode_prompt, for_model
from .settings import ModelSpec, Settings
from .speculation import SpeculationConfig
from .verification.verifier import read_claim
from .metrics import Metrics
from .status import GroupStatus, ModelStatus, NodeStatus, Platform

log = logs.get("node")


def _failed_future(e: Exception) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(e)
    return future


def build_models(settings: Settings, primary: list[ModelSpec] = (), budget: Budget | None = None,
                 group: Membership | None = None) -> Residency:
    """The resident set for these settings, over a catalog of `primary` first (the default), then everything
    discovered; in a node group, of the one model every rank loads, under the smallest rank's budget."""
    found = store.discover(settings, list(primary))
    return Residency(
        Catalog(found if group is None else found[:1]),
        budget or (group.budget() if group is not None else decide_node_budget(settings)),
        group=group.link.group if group is not None else None, group_split=settings.group_split,
        max_resident=settings.max_resident_models, idle_timeout=settings.idle_timeout_s,
        kv_reserve_tokens=settings.kv_reserve_tokens, prefill_step=longest_prefill_read(settings),
        speculation=SpeculationConfig.of(settings), kv_bits=settings.kv_bits, kv_group_size=settings.kv_group_size)


class Node:
    """The one facade front ends use: `run`, `cancel`, `resolve_model`, `preload`, `drain`, `status`."""

    def __init__(self, settings: Settings, models: Residency, group: Membership | None = None):
        self.settings = settings
        self.models = models
        self.group = group
        running = functools.partial(Running, commit=settings.committing, read_claim=read_claim)
        if group is not None:  # rank 0 of a node group: its batches lead the other ranks' (docs/group.md)
            self._watchdog = Watchdog(settings.group_step_timeout_s, self._group_stalled)
            self._group_ready = threading.Event()
            running = functools.partial(LeaderRunning, group.link, self._watchdog.beat, self._group_ready,
                                        commit=settings.committing, read_claim=read_claim)
        self.prefix_disk = None if group is not None or settings.prefix_disk_gb <= 0 else DiskTier.configured(
            settings.prefix_disk_dir, settings.prefix_disk_gb, settings.prefix_disk_write_gb_per_hour)
        self.engine = Engine(
            models,
            max_concurrent=settings.max_concurrent_jobs,
            max_queued=settings.max_queued_jobs,
            step_tokens=node_step_tokens(settings),
            # Each rank would trim its own prefix cache by its own bytes: off in a group, the steps must match.
            prefix_cache_bytes=int(settings.prefix_cache_gb * (1 << 30)) if group is None else 0,
            running=running,
            prefix_disk=self.prefix_disk,
        )
        self.catalog = models.catalog
        self.loading = False  # the daemon listens while its default model loads: health says `loading`
        models.profiler = profile.Profiler()
        self.prompts = PromptPreparer(self.catalog.tokenizer_files)
        self.metrics = Metrics(self.status)
        self.engine.on_job_done.append(self.metrics.job_ended)
        facts = system_facts()  # what does not change while the process runs
        self._platform_memory = facts.total_memory
        self._platform = Platform(backend=facts.backend, device=facts.device, machine=platform.machine(),
                                  os=f"{platform.system()} {platform.release()}", cpu_cores=os.cpu_count() or 0)

    def start(self) -> None:
        pin_mlx_limits(self.models.budget)
        freeze_startup_heap()
        self.engine.start()
        log.info("node_started", models=self.catalog.ids(), default_model=self.catalog.default_id)

    # --- what front ends may ask ------------------------------------------------------

    def resolve_model(self, name: str | None) -> ModelId:
        """A requested model name (id, source, or empty for the default) as a served id; JobError if none."""
        return self.catalog.canonical_id(name)

    def model_ids(self) -> list[str]:
        return self.catalog.ids()

    def hash_models(self) -> None:  # every model's manifest hash (blocking: the first time reads every file)
        self.catalog.hash_all()

    def model_hash(self, model_id: str) -> str:
        """The manifest hash last computed for a served model, or ""."""
        return self.catalog.known_hash(model_id)

    def check_pin(self, name: str | None, pinned: str) -> str:
        """The served id of `name` if its files hash to `pinned` now; JobError(WEIGHTS_MISMATCH) otherwise,
        before anything is loaded. Blocking (stats every file; hashes those that changed)."""
        model_id = self.resolve_model(name)
        try:
            actual = self.catalog.manifest_hash(model_id)
        except OSError as e:
            raise JobError(Cause.WEIGHTS_MISMATCH, f"{model_id}'s files cannot be read to check the pin: {e}") from None
        if not actual:
            raise JobError(Cause.WEIGHTS_MISMATCH, f"{model_id} is not on this node's disk yet, so it cannot be "
                           "checked against the pin; send the job unpinned, or after the node advertises its hash")
        if actual != pinned:
            raise JobError(Cause.WEIGHTS_MISMATCH, f"{model_id} here has manifest hash {actual}, not the pinned "
                           f"{pinned}; pin the hash this node registered, or send the job elsewhere")
        return model_id

    async def preload(self, model_id: str | None = None) -> str:
        """Load (and warm up) a model, the default one unless named, before saying the node can serve."""
        model_id = self.resolve_model(model_id)
        loaded = self.models.request(model_id)
        if isinstance(loaded, concurrent.futures.Future):
            await asyncio.wrap_future(loaded)
        return model_id

    def pinned_ids(self) -> list[str]:
        """Models the operator pinned: loaded at start, never unloaded."""
        return [mid for mid in self.catalog.ids() if self.catalog.stored(mid).pin]

    async def load_model(self, name: str | None, keep_alive: object = None) -> ModelStatus:
        """Load a model ahead of work (the CLI, the local API, the coordinator's warm frame), joining a load under
        way, and keep it as `keep_alive` says (keep_alive.py; not given: the settings'). JobError if it cannot."""
        model_id = self.resolve_model(name)
        seconds = parse_keep_alive(keep_alive)

        def load():
            loaded = self.models.request(model_id)
            self.models.keep(model_id, seconds, reset=True)
            return loaded

        loaded = await asyncio.wrap_future(self.engine.call(load))
        if isinstance(loaded, concurrent.futures.Future):
            await asyncio.wrap_future(loaded)
        return self.model_status(model_id)

    async def unload_model(self, name: str | None) -> str:
        """Unload a model and give its memory back: `unloaded`, `unloading` (once its jobs end) or `not_loaded`;
        JobError for a pinned one. A job that asks for it afterwards loads it again."""
        model_id = self.resolve_model(name)
        return await asyncio.wrap_future(self.engine.call(lambda: self.models.unload(model_id)))

    def model_status(self, model_id: str) -> ModelStatus:
        return next(m for m in self.models.statuses() if m.id == model_id)

    def holds_prefix(self, model_id: str, job_id: str) -> bool:
        """Any thread: whether the prefix job `job_id` of `model_id` left is still served (routing's claims)."""
        cache, disk = self.engine.prefix_cache(model_id), self.prefix_disk
        return (cache is not None and cache.holds(job_id)) or (disk is not None and disk.holds(job_id))

    def group_ready(self) -> None:
        """Every rank holds the model (preload returned): rank 0's steps start leading the others'."""
        self._group_ready.set()
        self._watchdog.arm()

    def _group_stalled(self, why: str) -> None:
        """The engine thread waits inside a collective that a stalled rank will never join: end every job now,
        turn unhealthy, and exit shortly for the supervisor (the thread cannot be stopped)."""
        self.engine.abandon(why)
        threading.Timer(3.0, os._exit, (EXIT_GROUP_LOST,)).start()

    def cancel(self, job_id: str) -> None:
        self.engine.cancel(job_id)

    def drain(self) -> None:
        """Accept no new jobs; in-flight and queued ones run to the end."""
        self.engine.drain()

    def book_responses(self, n: int) -> None:
        """Any thread: the bytes the local API's stored responses hold, booked in the memory ledger."""
        self.models.responses_bytes = n

    def on_engine_failure(self, callback: Callable[[str], None]) -> None:
        """`callback(why)` runs once, on the engine thread, if the engine loop dies."""
        self.engine.on_failure = callback

    def status(self) -> NodeStatus:
        engine = self.engine
        stats = engine.stats
        health = "unhealthy" if engine.failure is not None else "draining" if engine.draining else \
            "loading" if self.loading else "ok"
        return NodeStatus(
            health=health, failure=engine.failure, default_model=self.catalog.default_id,
            models=tuple(self.models.statuses()), memory=self.models.memory_status(self._platform_memory),
            active_jobs=stats.active, queued_jobs=stats.queued, max_concurrent_jobs=self.settings.max_concurrent_jobs,
            counters=stats.counters(),
            platform=self._platform, last_tick=engine.last_tick,
            queue=stats.queue(), group=self._group_status(), commits=self.settings.committing,
            prefix_disk=self.prefix_disk.status() if self.prefix_disk is not None else None)

    def _group_status(self) -> GroupStatus | None:
        g = self.group
        return None if g is None else GroupStatus(ranks=g.spec.size, backend=g.spec.backend, memory_bytes=g.memory,
                                                  budget_bytes=g.budgets)

    async def tokenize(self, job: Job, add_special_tokens: bool = True) -> tuple[list[int], int]:
        """The token ids a job's prompt encodes to (templated, as a completion would see them; a raw prompt
        without BOS if not `add_special_tokens`), and its model's context length."""
        job = for_model(job, self.resolve_model(job.model))
        m = await asyncio.to_thread(self.prompts.tokenizer, job.model)
        m.check_size(job)  # before any templating or encoding, as a job's prompt is
        # Images are expanded to their soft tokens (which takes decoding them), offered tools rendered in the model's
        # format: as the job would see them.
        if job.images or job.videos or job.rules.calls_tools:
            return list((await asyncio.wrap_future(self.prompts.prepare(job))).prompt), m.context_length

        def encode() -> list[int]:
            with m.lock:
                if job.prompt is not None and not add_special_tokens:
                    return list(m.tokenizer.encode(job.prompt, add_special_tokens=False))
                return encode_prompt(job, m.tokenizer)

        return await asyncio.to_thread(encode), m.context_length

    async def tokenizer_info(self, model: str) -> dict:
        """What a harness needs of the tokenizer to use /tokenize in its place (vLLM's /tokenizer_info)."""
        tok = (await asyncio.to_thread(self.prompts.tokenizer, self.resolve_model(model))).tokenizer
        return {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": None}

    async def detokenize(self, model: str, ids: list[int]) -> str:
        """`ids` as text under `model`'s tokenizer; JobError for an id outside its vocabulary."""
        m = await asyncio.to_thread(self.prompts.tokenizer, self.resolve_model(model))
        check_vocabulary("tokens", ids, m.vocab_size)

        def decode() -> str:
            with m.lock:
                return m.tokenizer.decode(ids)

        return await asyncio.to_thread(decode)

    def run(self, job: Job) -> JobStream:
        """Submit a job; its prompt is checked against its model and tokenized off the engine thread."""
        try:
            job = for_model(job, self.resolve_model(job.model))
        except JobError as e:
            return JobStream(self.engine, job, lambda _, error=e: _failed_future(error))
        return JobStream(self.engine, job, self._prepare)

    def _prepare(self, job: Job) -> concurrent.futures.Future:
        """The job's prompt, made off the engine thread; once made, what the disk tier holds of it is read ahead."""
        future = self.prompts.prepare(job)
        if self.prefix_disk is not None:
            def read_ahead(f: concurrent.futures.Future) -> None:
                prefix = self.engine.prefix_cache(job.model)
                if prefix is not None and not f.cancelled() and f.exception() is None:
                    prefix.prefetch(list(f.result().prompt), job.prefix_scope)
            future.add_done_callback(read_ahead)
        return future

    @property
    def healthy(self) -> bool:
        return self.engine.failure is None

    @property
    def draining(self) -> bool:
        return self.engine.draining

    async def stop(self, grace_s: float = 10.0, finish_measuring: bool = False) -> None:
        await asyncio.to_thread(self.engine.stop, grace_s)
        if self.prefix_disk is not None:
            await asyncio.to_thread(self.prefix_disk.close)  # the entries queued for writing are written
        self.prompts.close()
        await asyncio.to_thread(self.models.close, finish_measuring)  # off the loop: a Ctrl-C may end the wait
        log.info("node_stopped")

    @staticmethod
    def new_job_id(prefix: str = "job") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}"
