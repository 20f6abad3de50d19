"""The group's wire: MLX's own distributed group (ring over TCP, or JACCL over Thunderbolt RDMA), joined under a
timeout, and what the node sends over it besides the model's own collectives: rank 0's plan for each step, and
a check that every rank produced the same tokens.

MLX's ring carries bytes unauthenticated, so what rank 0 sends is sealed: JSON (never objects by name: nothing a
rank receives becomes code), numbered so that no message can be replayed or reordered, under a MAC keyed by the
group's secret (provider.group.secret). A message that fails any of it ends the group.

MLX's collectives have no timeout and no broadcast: a broadcast is an all_sum the followers feed zeros, and a
rank that stalls is found by the watchdog (provider.group.member.Watchdog), not here. Every call here is a collective:
all ranks make the same calls in the same order, from one thread (the engine's, or the follower's loop).
"""

from __future__ import annotations

import json
import os

from ..engine.collective import GroupLost
from .plan import PlanError, StepPlan, decode_plan, encode_plan
from .secret import TAG_BYTES, GroupKey
from .spec import GroupSpec

MAGIC = b"PGM1"  # provider group message, version 1
MAX_MESSAGE_BYTES = 256 << 20  # a plan of many long prompts; a length past it is refused before any allocation


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


def seal(key: GroupKey, counter: int, kind: str, body: dict) -> bytes:
    """A message as it travels: MAGIC, its number, its kind, its JSON, and their MAC under the group's secret."""
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    head = MAGIC + counter.to_bytes(8, "little") + bytes([len(kind)]) + kind.encode()
    return head + data + key.tag("message", counter, kind, data)


def unseal(key: GroupKey, expected: int, kind: str, message: bytes) -> dict:
    """The JSON object of a sealed message, if it is rank 0's `expected`-th and of `kind`; else GroupLost."""
    head = len(MAGIC) + 9 + len(kind)
    if len(message) < head + TAG_BYTES or not message.startswith(MAGIC):
        raise GroupLost("a message on the group's wire is not the group's: the group stops")
    counter = int.from_bytes(message[4:12], "little")
    data, tag = message[head:-TAG_BYTES], message[-TAG_BYTES:]
    if message[12] != len(kind) or message[13:head] != kind.encode() \
            or not key.check(tag, "message", counter, kind, data):
        raise GroupLost(f"a {kind} message on the group's wire is not proven by the group's secret (forged or "
                        f"altered on the way): the group stops")
    if counter != expected:
        raise GroupLost(f"a {kind} message on the group's wire came out of order (number {counter}, expected "
                        f"{expected}: replayed or reordered): the group stops")
    try:
        body = json.loads(data, parse_constant=_refuse_constant)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise GroupLost(f"a {kind} message is not a JSON object: the group stops")
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class Link:
    """Rank 0's messages to every rank, and agreement checks, over the group's collectives.

    Each runs after everything MLX has in flight (`_settled`): a step leaves its next forward running
    asynchronously on mlx-lm's generation stream, and collectives on two streams would pair up across ranks in
    whatever order each rank's streams reach them."""

    def __init__(self, group, key: GroupKey):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.key = key
        self.messages = 0  # rank 0's messages so far, the same count on every rank: each names its number
        self.doorbell = None  # provider.group.doorbell, once joined: followers sleep between plans

    def send_plan(self, plan: StepPlan) -> None:
        """Rank 0: wake every follower, then share `plan`."""
        if self.doorbell is not None:
            self.doorbell.ring()
        self.share("plan", encode_plan(plan))

    def next_plan(self, vocab_size: int) -> StepPlan:
        """A follower: sleep until rank 0 rings, then take its plan, checked against the model's vocabulary."""
        if self.doorbell is not None:
            self.doorbell.wait()
        try:
            return decode_plan(self.share("plan"), vocab_size)
        except PlanError as e:
            raise GroupLost(f"rank 0's plan does not parse ({e}): the group stops") from None

    def share_port(self, port: int | None = None) -> int:
        """Rank 0's wake-up port, on every rank."""
        got = self.share("port", {"port": port})["port"]
        if type(got) is not int or not 0 < got < 65536:
            raise GroupLost("rank 0's wake-up port is not a port: the group stops")
        return got

    def share(self, kind: str, body: dict | None = None) -> dict:
        """Rank 0's JSON object `body`, sealed (`seal`), on every rank (the others pass nothing and check what
        comes): MLX's ring authenticates nothing, and in a group of three or more any rank can add to the sum,
        so only the seal says the bytes are rank 0's."""
        number, self.messages = self.messages, self.messages + 1
        received = self.transfer(seal(self.key, number, kind, body) if self.rank == 0 else b"", kind)
        return body if self.rank == 0 else unseal(self.key, number, kind, received)

    def transfer(self, data: bytes, kind: str = "message") -> bytes:
        """Rank 0's bytes, on every rank, as they came: two collectives, their length, then the bytes."""
        import mlx.core as mx

        stream = _settled()
        if len(data) > MAX_MESSAGE_BYTES:
            raise GroupLost(f"a {kind} message of {len(data)} bytes is past the group's limit of {MAX_MESSAGE_BYTES}")
        size = mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=self.group, stream=stream).item()
        if not 0 < size <= MAX_MESSAGE_BYTES:  # checked before the buffer is made: the length is not sealed
            raise GroupLost(f"a {kind} message of {size} bytes announced on the group's wire: the group stops")
        payload = mx.array(memoryview(data), dtype=mx.uint8) if self.rank == 0 else mx.zeros(size, dtype=mx.uint8)
        received = mx.distributed.all_sum(payload, group=self.group, stream=stream)
        mx.eval(received)
        return data if self.rank == 0 else bytes(memoryview(received))

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
