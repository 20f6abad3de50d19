"""Hostile input for a node group's own wire, for the fuzz campaign (tools/scripts/fuzz_campaign.py): lines at
the rendezvous and the wake-up port while honest ranks meet there, and sealed messages (bytes and JSON) at the
follower's side of a plan and of a round's drafts. Plain sockets and the real parsing code; no MLX.

What must hold: the honest ranks still meet and connect, every hostile case ends in a typed refusal (GroupLost,
PlanError or a logged refusal), no exception escapes, nothing waits past its bound."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from hypothesis import HealthCheck, given, seed as hseed, settings, strategies as st

from provider.engine.collective import GroupLost
from provider.group.doorbell import accept_followers, dial_leader
from provider.group.link import seal, unseal
from provider.group.plan import PlanError, decode_plan, encode_plan
from provider.group.rendezvous import meet
from .group import loopback_specs

VOCAB = 512
MEET_BOUND_S = 60.0


@dataclass
class GroupTally:
    cases: int = 0
    refused: int = 0  # typed refusals (GroupLost / PlanError)
    accepted: int = 0  # hostile JSON that was still a well-formed plan (then it is one a request could make)
    crashes: list[str] = field(default_factory=list)  # anything else that escaped
    hangs: int = 0
    meetings: int = 0  # honest rendezvous and wake-up connections completed beside the attack
    error_logs: int = 0  # log events at error or above, or with a traceback


def _lines():
    """Lines a stranger might send: bytes, near-misses of the handshake's patterns, well-formed but unproven."""
    hexes = lambda n: st.text("0123456789abcdefABCDEF²", min_size=n - 2, max_size=n + 2)  # noqa: E731
    crafted = st.builds(lambda r, a, b: f"provider-group/2 {r} {a} {b}\n".encode(),
                        st.one_of(st.integers(-5, 200).map(str), st.text(max_size=4)), hexes(32), hexes(64))
    answers = st.builds(lambda t: f"k {t}\n".encode(), hexes(64))
    return st.one_of(st.binary(max_size=400), crafted, answers,
                     st.text(max_size=200).map(lambda s: ("provider-group/2 " + s + "\n").encode()))


def _run(n: int, seed: int, strategy, check) -> None:
    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case):
        check(case)

    one()


def _send(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            conn.sendall(data)
            conn.settimeout(0.2)
            try:
                conn.recv(400)
            except OSError:
                pass
    except OSError:
        pass


def _in_thread(t: GroupTally, what: str, work) -> threading.Thread:
    def run() -> None:
        try:
            work()
            t.meetings += 1
        except BaseException as e:  # an honest rank must not fail beside the attack
            t.crashes.append(f"{what}: {type(e).__name__}: {e}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def rendezvous_phase(n: int, seed: int, t: GroupTally, root: Path) -> None:
    """Each rank in turn listens alone while `n` hostile lines arrive; then the other comes and they meet."""
    for first in (0, 1):
        specs = loopback_specs(root / f"rendezvous{first}")
        waiting = _in_thread(t, f"rank {first} meeting", lambda: meet(specs[first], MEET_BOUND_S))
        time.sleep(0.2)

        def hostile(line: bytes) -> None:
            t.cases += 1
            _send(specs[first].hosts[first][0], line)

        _run(n, seed + first, _lines(), hostile)
        other = _in_thread(t, f"rank {1 - first} meeting", lambda: meet(specs[1 - first], MEET_BOUND_S))
        for thread in (waiting, other):
            thread.join(MEET_BOUND_S + 10)
            t.hangs += thread.is_alive()


def doorbell_phase(n: int, seed: int, t: GroupTally, root: Path) -> None:
    """Rank 0's wake-up port takes `n` hostile lines, then the real worker dials and must be the one taken."""
    specs = loopback_specs(root / "doorbell")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    peers: list = []
    leader = _in_thread(t, "rank 0's wake-up port",
                        lambda: peers.extend(accept_followers(server, specs[0], time.monotonic() + 600)))

    def hostile(line: bytes) -> None:
        t.cases += 1
        _send(f"127.0.0.1:{port}", line)

    _run(n, seed, _lines(), hostile)
    worker = _in_thread(t, "the worker's wake-up connection", lambda: dial_leader(specs[1], "127.0.0.1", port, 30))
    for thread in (leader, worker):
        thread.join(60)
        t.hangs += thread.is_alive()
    server.close()
    for conn in peers:
        conn.close()


def plan_phase(n: int, seed: int, t: GroupTally, root: Path) -> None:
    """Sealed messages as a follower takes them: a good plan's bytes damaged at random, and hostile JSON sealed
    under the right key (what a rank holding the secret could send)."""
    from tools.harness.plans import a_plan

    key = loopback_specs(root / "plans")[0].key
    good = seal(key, 5, "plan", encode_plan(a_plan()))
    rng = random.Random(seed)  # where hostile JSON is grafted

    def damaged(case: int) -> None:
        t.cases += 1
        data, rng = bytearray(good), random.Random(case)
        for _ in range(rng.randrange(1, 9)):
            op = rng.randrange(3)
            i = rng.randrange(len(data))
            if op == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[i:i + rng.randrange(1, 64)]
            else:
                data[i:i] = rng.randbytes(rng.randrange(1, 64))
        _expect_refusal(t, lambda: decode_plan(unseal(key, 5, "plan", bytes(data)), VOCAB), must_refuse=True)

    def hostile_json(body) -> None:
        t.cases += 1
        plan = json.loads(json.dumps(encode_plan(a_plan())))
        _graft(plan, body, rng)
        _expect_refusal(t, lambda: decode_plan(unseal(key, 9, "plan", seal(key, 9, "plan", plan)), VOCAB))

    _run(n, seed, st.integers(0, 1 << 64), damaged)
    _run(n, seed + 7, _JSON_VALUES, hostile_json)


_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
                            st.text(max_size=20), lambda c: st.lists(c, max_size=4) |
                            st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


def drafts_phase(n: int, seed: int, t: GroupTally, root: Path) -> None:
    """Rank 0's drafts for a round (provider.group.drafts), sealed under the right key, with hostile JSON grafted
    in: each is a round of 2 rows of 3 ids below the vocabulary, or GroupLost."""
    from provider.group.drafts import drafts_of

    key = loopback_specs(root / "drafts")[0].key
    rng = random.Random(seed)

    def hostile_json(body) -> None:
        t.cases += 1
        drafts = {"k": 3, "drafts": [[1, 2, 3], [4, 5, 6]]}
        _graft(drafts, body, rng)
        sealed = unseal(key, 3, "drafts", seal(key, 3, "drafts", drafts))
        _expect_refusal(t, lambda: _fits(drafts_of(sealed, 2, 3, VOCAB), t))

    _run(n, seed + 11, _JSON_VALUES, hostile_json)


def _fits(drafts, t: GroupTally) -> None:
    if len(drafts) != 2 or any(len(d) != 3 or not all(type(i) is int and 0 <= i < VOCAB for i in d) for d in drafts):
        t.crashes.append(f"drafts that do not fit the round were taken: {drafts!r}"[:300])


def _graft(node, value, rng: random.Random) -> None:
    """Put `value` in place of one of the plan's fields, chosen at random at any depth."""
    while True:
        keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return
        k = rng.choice(keys)
        if isinstance(node[k], (dict, list)) and node[k] and rng.random() < 0.7:
            node = node[k]
            continue
        node[k] = value
        return


def _expect_refusal(t: GroupTally, work, must_refuse: bool = False) -> None:
    try:
        work()
        t.accepted += 1
        if must_refuse:
            t.crashes.append("a damaged sealed plan was accepted")
    except (GroupLost, PlanError):
        t.refused += 1
    except Exception as e:  # anything else would end a follower with a traceback
        t.crashes.append(f"{type(e).__name__}: {e}"[:300])


def group_campaign(n: int, seed: int, root: Path) -> GroupTally:
    t = GroupTally()
    with structlog.testing.capture_logs() as logged:
        rendezvous_phase(n, seed, t, root)
        doorbell_phase(n, seed, t, root)
        plan_phase(n, seed, t, root)
        drafts_phase(n, seed, t, root)
    t.error_logs = sum(e.get("log_level") in ("error", "critical") or "exc_info" in e for e in logged)
    return t
