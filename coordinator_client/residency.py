"""The coordinator's say in what stays loaded: WarmModel and ReleaseModel frames, each answered by one
ModelResidency, and every resident model as heartbeats report it (docs/protocol.md, "Residency")."""

from __future__ import annotations

import asyncio

from provider import logs
from provider.jobs import JobError
from provider.node import Node
from provider.status import ModelStatus
from provider.types import Cause

from .convert import CAUSE_TO_PB
from .pb import provider_pb2 as pb

log = logs.get("coordinator")
MAX_PENDING = 64  # warms and releases under way at once; past it a frame is refused (OVERLOADED), not queued
MAX_MODEL_NAME = 256


def model_residency(m: ModelStatus, request_id: int = 0, state: str | None = None) -> pb.ModelResidency:
    return pb.ModelResidency(
        request_id=request_id, model=m.id, state=state or ("not_loaded" if m.state == "available" else m.state),
        pinned=m.pinned, active_jobs=m.active_jobs,
        unload_at_ms=int(m.unload_at * 1000) if m.unload_at is not None else 0,
        keep_alive_s=-1.0 if m.keep_alive_s is None else m.keep_alive_s)


def residency_of(models: tuple[ModelStatus, ...]) -> list[pb.ModelResidency]:
    """What a heartbeat says of the models loaded or loading."""
    return [model_residency(m) for m in models if m.state != "available"]


class ResidencyFrames:
    """Answers the coordinator's WarmModel and ReleaseModel frames, each from a task of its own: a load takes
    seconds, and the session keeps reading meanwhile. A second warm of a model already warming is answered at once
    (`loading`), so a flood of frames holds at most MAX_PENDING tasks."""

    def __init__(self, node: Node):
        self.node = node
        self._warming: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def on_warm(self, frame: pb.WarmModel, outbox) -> None:
        model_id = self._accepted(frame.model, frame.request_id, outbox)
        if model_id is None:
            return
        if model_id in self._warming:
            outbox.put_nowait(pb.ProviderFrame(model_residency=pb.ModelResidency(
                request_id=frame.request_id, model=model_id, state="loading")))
            return
        self._warming.add(model_id)
        self._spawn(self._warm(model_id, frame, outbox))

    def on_release(self, frame: pb.ReleaseModel, outbox) -> None:
        model_id = self._accepted(frame.model, frame.request_id, outbox)
        if model_id is not None:
            self._spawn(self._release(model_id, frame.request_id, outbox))

    async def _warm(self, model_id: str, frame: pb.WarmModel, outbox) -> None:
        try:
            answer = model_residency(await self.node.load_model(model_id, frame.keep_alive or None), frame.request_id)
        except JobError as e:
            answer = _refused(model_id, frame.request_id, e)
        finally:
            self._warming.discard(model_id)
        log.info("coordinator_warm", model=model_id, state=answer.state, error=answer.error_message[:200])
        outbox.put_nowait(pb.ProviderFrame(model_residency=answer))

    async def _release(self, model_id: str, request_id: int, outbox) -> None:
        try:
            state = await self.node.unload_model(model_id)
            answer = model_residency(self.node.model_status(model_id), request_id, state)
        except JobError as e:
            answer = _refused(model_id, request_id, e)
        log.info("coordinator_release", model=model_id, state=answer.state)
        outbox.put_nowait(pb.ProviderFrame(model_residency=answer))

    def _accepted(self, model: str, request_id: int, outbox) -> str | None:
        """The served id the frame names; None once it is answered as refused: a name that is no model here, or
        too many frames under way."""
        try:
            if len(self._tasks) >= MAX_PENDING:
                raise JobError(Cause.OVERLOADED, f"{MAX_PENDING} warms and releases are already under way; send it "
                               "again later")
            if len(model) > MAX_MODEL_NAME:
                raise JobError(Cause.INVALID_REQUEST, f"a model name has at most {MAX_MODEL_NAME} characters")
            return self.node.resolve_model(model)
        except JobError as e:
            outbox.put_nowait(pb.ProviderFrame(model_residency=_refused(model, request_id, e)))
            return None

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work, name="residency")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _refused(model: str, request_id: int, e: JobError) -> pb.ModelResidency:
    return pb.ModelResidency(request_id=request_id, model=model[:MAX_MODEL_NAME], state="refused",
                             error_cause=CAUSE_TO_PB.get(e.cause, pb.ERROR_CAUSE_INTERNAL), error_message=e.message)
