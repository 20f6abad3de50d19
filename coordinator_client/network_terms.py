"""What the network fixes in every job before a node sees it (docs/protocol.md, "What a coordinator fixes"), so
the work can be checked from the request alone (docs/verification.md)."""

from __future__ import annotations

import secrets

from provider.jobs import GREEDY_BELOW

from .pb import provider_pb2 as pb

NETWORK_MAX_TOKENS = 1024  # what a job that names none gets (the nodes' own default)


def network_terms(request: pb.JobRequest) -> None:
    """What the network fixes in every job before a node sees it (docs/protocol.md): a seed of its own for a sampled
    job that has none, so every sampled token is the seeded draw a verifier replays (the user still gets a random
    output), and an explicit max_tokens, so a claim's length is checked against what was asked, not against a
    node's default. A sealed request's terms were fixed in its body before it was sealed."""
    if request.HasField("sealed"):
        return
    s = request.sampling
    sampled = not s.HasField("temperature") or s.temperature >= GREEDY_BELOW
    if sampled and not s.HasField("seed"):
        s.seed = secrets.randbits(63)
    if not request.max_tokens:
        request.max_tokens = NETWORK_MAX_TOKENS
