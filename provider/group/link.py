"""The group's wire: MLX's own distributed group (ring over TCP, or JACCL over Thunderbolt RDMA), joined under a
timeout, and what the node sends over it besides the model's own collectives: rank 0's plan for each step, and
a check that every rank produced the same tokens.

MLX's collectives have no timeout and no broadcast: a broadcast is an all_sum the followers feed zeros, and a
rank that stalls is found by the watchdog (provider.group.watchdog), not here. Every call here is a collective:
all ranks make the same calls in the same order, from one thread (the engine's, or the follower's loop).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from .spec import GroupSpec


class GroupLost(RuntimeError):
    """A rank is gone, stalled or out of step: the group cannot go on. Every rank exits for its supervisor."""


def collective_failure(e: BaseException) -> bool:
    """A failure of the group's wire (a peer gone, a connection lost), not of one job."""
    return isinstance(e, GroupLost) or (isinstance(e, RuntimeError) and str(e).startswith(("[ring]", "[jaccl]",
                                                                                            "[distributed]")))


def join(spec: GroupSpec, timeout_s: float):
    """This process's place in the group (an mx.distributed Group), once every rank has connected. MLX reads its
    backend's environment when the group is first made, so it is set here; `strict` makes a wrong environment an
    error rather than a group of one.

    MLX's init waits for its peers without limit and holding the interpreter's lock, so no Python timeout can end
    it: on the ring the ranks first meet in plain sockets under `timeout_s` (provider.group.rendezvous), which
    names any rank that does not answer; a rank lost between that and MLX's init is ended by faulthandler's
    timer, which needs no lock."""
    import faulthandler
    import sys

    import mlx.core as mx

    from .rendezvous import RendezvousError, meet

    os.environ["MLX_HOSTFILE"] = str(spec.hostfile)
    os.environ["MLX_RANK"] = str(spec.rank)
    if not mx.distributed.is_available(spec.backend):
        raise GroupLost(f"MLX here has no {spec.backend} backend (available: "
                        f"{', '.join(b for b in ('ring', 'jaccl', 'mpi') if mx.distributed.is_available(b)) or 'none'})")
    if spec.backend == "ring":
        try:
            meet(spec, timeout_s)
        except RendezvousError as e:
            raise GroupLost(str(e)) from None
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        group = mx.distributed.init(strict=True, backend=spec.backend)
    except Exception as e:
        raise GroupLost(f"rank {spec.rank} could not join the group in {spec.hostfile}: {e}") from None
    finally:
        faulthandler.cancel_dump_traceback_later()
    if group.size() != spec.size or group.rank() != spec.rank:
        raise GroupLost(f"MLX made a group of {group.size()} with this process as rank {group.rank()}, but "
                        f"{spec.hostfile} names {spec.size} ranks and this is rank {spec.rank}")
    return group


class Link:
    """Rank 0's messages to every rank, and agreement checks, over the group's collectives.

    Each runs after everything MLX has in flight (`_settled`): a step leaves its next forward running
    asynchronously on mlx-lm's generation stream, and collectives on two streams would pair up across ranks in
    whatever order each rank's streams reach them."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.doorbell = None  # provider.group.doorbell, once joined: followers sleep between plans

    def send_plan(self, plan: Any) -> None:
        """Rank 0: wake every follower, then share `plan`."""
        if self.doorbell is not None:
            self.doorbell.ring()
        self.share(plan)

    def next_plan(self) -> Any:
        """A follower: sleep until rank 0 rings, then take its plan."""
        if self.doorbell is not None:
            self.doorbell.wait()
        return self.share()

    def share(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (the others pass nothing). Two collectives: its length, then its bytes."""
        import mlx.core as mx

        stream = _settled()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        size = mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=self.group, stream=stream).item()
        payload = mx.array(memoryview(data), dtype=mx.uint8) if self.rank == 0 else mx.zeros(size, dtype=mx.uint8)
        received = mx.distributed.all_sum(payload, group=self.group, stream=stream)
        if self.rank == 0:
            mx.eval(received)
            return obj
        return _load(bytes(memoryview(received)))

    def agree(self, values: list[int]) -> bool:
        """Whether every rank passed the same values (one all_gather)."""
        import mlx.core as mx

        stream = _settled()
        mine = mx.array(values, dtype=mx.int32)
        every = mx.distributed.all_gather(mine, group=self.group, stream=stream).reshape(self.size, -1)
        return bool(mx.all(every == every[0]).item())

    def gather(self, value: int) -> list[int]:
        """Every rank's `value`, by rank."""
        import mlx.core as mx

        return mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=self.group,
                                         stream=_settled()).tolist()


def _settled():
    """Wait for this thread's work on the default and generation streams; return the generation stream, where
    the link's own collectives then run, in order with the model's."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)
    return generation_stream


_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool", "complex",
             "slice", "range", "bytearray"}


class _Unpickler(pickle.Unpickler):
    """Plans come from rank 0, but over a port anyone on the network can reach: only the node's own types and
    plain containers are made, never a function."""

    def find_class(self, module: str, name: str):
        if (module == "builtins" and name in _BUILTINS) or (module == "copyreg" and name == "__newobj__"):
            return super().find_class(module, name)
        if module == "provider" or module.startswith("provider."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"a group plan may not hold {module}.{name}")


def _load(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()
