"""Cache-aware routing (docs/protocol.md#cache-aware-routing): which conversations' prefixes a node holds,
told to its coordinator without the prompts, and the reference coordinator's choice of node by them.

A job's prefix chain is one hash per message (or one for a raw prompt): message i's covers the model, the
tenant and every message up to i, keyed by the coordinator's routing key (Welcome.routing_key), cut to 64
bits. The coordinator computes it from a job's messages as the node does; another coordinator, or anyone
without the key, cannot tell two nodes' prompts apart. After a job the node holds the chain of its messages
and of them plus its answer (what the next turn starts with), and its heartbeats list the newest it holds.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from provider.jobs import Job

MAX_HELD = 1024  # hashes a heartbeat carries: the newest
CONFIRMED_TOKENS = 1  # a routed hit is confirmed when the outcome reused at least this many prompt tokens
STRIKES, QUARANTINE_S = 3, 600.0  # unconfirmed claims in a row before a node's claims are ignored, and for how long


def prefix_chain(key: bytes, model: str, tenant: str, messages: list[dict] | None, prompt: str | None = None
                 ) -> list[int]:
    """The 64-bit keyed hash of each message prefix (a raw prompt is one message). A message with anything
    but text ends the chain: images are not hashed."""
    h = hmac.new(key, b"provider.route\0" + model.encode() + b"\0" + tenant.encode(), hashlib.sha256).digest()
    out = []
    for m in messages if messages is not None else [{"role": "", "content": prompt or ""}]:
        content = m.get("content")
        if not isinstance(content, str):
            break
        h = hmac.new(key, h + json.dumps([m.get("role", ""), content]).encode(), hashlib.sha256).digest()
        out.append(int.from_bytes(h[:8], "little"))
    return out


class HeldPrefixes:
    """The node's side: the prefixes its finished jobs left in its prefix cache, newest first, bounded. Each
    hash remembers the jobs that left it; it is told only while the node still serves one of them
    (`newest(holds)`: an evicted or unloaded prefix is no longer claimed, so an honest node's claims are
    confirmed)."""

    JOBS_PER_HASH = 8  # a system prompt's hash is left by every conversation: its newest jobs are enough

    def __init__(self) -> None:
        self.key = b""  # the session's routing key; empty: nothing is recorded or told
        self._held: collections.OrderedDict[int, list[tuple[str, str]]] = collections.OrderedDict()

    def record(self, model: str, tenant: str, job: Job, answer: str, served_by: str = "") -> None:
        """After `job` (sent for `model` and `tenant` as its request named them; `served_by` the model id that
        ran it) answered `answer`."""
        if not self.key or job.prompt_ids is not None:
            return
        if job.messages is None:  # a raw prompt: found again only whole
            chain = prefix_chain(self.key, model, tenant, None, job.prompt)
        else:  # every prefix of the conversation, its answer included (what the next turn starts with)
            chain = prefix_chain(self.key, model, tenant, [*job.messages, {"role": "assistant", "content": answer}])
        for h in chain:
            jobs = self._held.pop(h, [])
            self._held[h] = [*jobs[-(self.JOBS_PER_HASH - 1):], (served_by or model, job.id)]
        while len(self._held) > MAX_HELD:
            self._held.popitem(last=False)

    def newest(self, holds: Callable[[str, str], bool] | None = None) -> list[int]:
        """The hashes still held, newest first; `holds(model id, job id)` says whether a job's prefix is still
        served (None: all are). Those no longer held are forgotten."""
        if holds is not None:
            for h in list(self._held):
                jobs = [j for j in self._held[h] if holds(*j)]
                if jobs:
                    self._held[h] = jobs
                else:
                    del self._held[h]
        return list(reversed(self._held))


@dataclass
class NodeRoute:
    held: set[int] = field(default_factory=set)
    load: int = 0  # jobs routed to it and not finished
    strikes: int = 0
    quarantined_until: float = 0.0
    claimed: dict[str, int] = field(default_factory=dict)  # job id -> messages it claimed to hold


class Router:
    """The reference coordinator's choice: the connected node holding the longest prefix of the job's chain,
    less a message per job it is running; a node whose claimed hits are not confirmed in their outcomes
    (`STRIKES` in a row) has its claims ignored for `QUARANTINE_S`."""

    def __init__(self, key: bytes, load_weight: float = 1.0, cache_aware: bool = True, seed: int | None = None):
        self.key, self.load_weight, self.cache_aware = key, load_weight, cache_aware
        self.nodes: dict[str, NodeRoute] = {}
        self.quarantines = 0
        self._random = random.Random(seed)  # ties (nothing held, equal load) go to a node drawn at random

    def heard(self, node_id: str, hashes) -> None:
        self.nodes.setdefault(node_id, NodeRoute()).held = set(hashes)

    def pick(self, candidates: list[str], chain: list[int], job_id: str) -> str:
        now, best = time.monotonic(), None
        for node_id in self._random.sample(candidates, len(candidates)):
            r = self.nodes.setdefault(node_id, NodeRoute())
            trusted = self.cache_aware and r.quarantined_until <= now
            held = max((i + 1 for i, h in enumerate(chain) if h in r.held), default=0) if trusted else 0
            score = held - self.load_weight * r.load
            if best is None or score > best[0]:
                best = (score, node_id, held)
        _, node_id, held = best
        r = self.nodes[node_id]
        r.load += 1
        if held:
            r.claimed[job_id] = held
        return node_id

    def finished(self, node_id: str, job_id: str, cached_prompt_tokens: int) -> None:
        r = self.nodes.setdefault(node_id, NodeRoute())
        r.load = max(0, r.load - 1)
        if r.claimed.pop(job_id, 0):
            if cached_prompt_tokens >= CONFIRMED_TOKENS:
                r.strikes = 0
            else:
                r.strikes += 1
                if r.strikes >= STRIKES:
                    r.strikes, r.quarantined_until = 0, time.monotonic() + QUARANTINE_S
                    self.quarantines += 1


def dispatch_routed(coord, request, candidates: list | None = None):
    """Send `request` to the session the router picks among `candidates` (default: every connected node); that
    session. The job's chain is computed from its messages or prompt, as the node computes what it holds."""
    sessions = {s.node_id: s for s in (candidates or coord.sessions.values())}
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages] \
        if request.WhichOneof("input") == "chat" else None
    prompt = request.prompt if request.WhichOneof("input") == "prompt" else None
    chain = prefix_chain(coord.router.key, request.model, request.cache_scope, messages, prompt) \
        if messages is not None or prompt is not None else []
    session = sessions[coord.router.pick(list(sessions), chain, request.job_id)]
    coord.dispatch(session, request)
    return session
