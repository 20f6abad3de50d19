"""The reference coordinator's spot checks (docs/verification.md): a fraction of finished jobs that carry a
proof are verified again on another connected node, and each producing node's verdicts are tallied.

A verify job is the original request (its plaintext, for a sealed job, sealed again to the verifier) with the
claimed output ids and the opened proof in `verify`; its JobDone carries a signed Verdict. A job with no other
node to check it, or without a proof, counts as unchecked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .pb import provider_pb2 as pb


@dataclass
class Tally:
    """One producing node's record."""

    checked: int = 0
    passed: int = 0
    failed: int = 0
    unchecked: int = 0  # picked, but no other node could check it, or it carried no proof
    errors: int = 0  # the verify job itself failed (a JobError on the verifier)
    failures: list[dict] = field(default_factory=list)  # the failed verdicts, with their job ids

    def as_dict(self) -> dict:
        return {"checked": self.checked, "passed": self.passed, "failed": self.failed, "unchecked": self.unchecked,
                "errors": self.errors}


@dataclass(frozen=True)
class Pending:
    producer: str  # node id
    job_id: str


VERIFY_PREFIX = "verify-"


class SpotChecks:
    def __init__(self, fraction: float, seed: int | None = None):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("the verify fraction is a share of jobs, 0 to 1")
        self.fraction = fraction
        self._rng = random.Random(seed)
        self.tally: dict[str, Tally] = {}
        self.verifiers: set[str] | None = None  # node ids trusted to check others; None: any connected node
        self.pending: dict[str, Pending] = {}  # verify job id -> what it checks

    def after(self, coord, session, job_id: str, frame: pb.ProviderFrame) -> None:
        """On `coord` (a ReferenceCoordinator), a recorded outcome from `session`: a verify job's answer is
        tallied; a finished job picked for a spot check is sent to another node."""
        if job_id in self.pending:
            self.answered(frame)
            return
        if len(coord.outcomes[job_id]) > 1 or frame.WhichOneof("frame") != "job_done" or not self.pick(job_id):
            return
        proof = proof_of(coord, frame.job_done)
        original = coord.plain_requests.get(job_id) or coord.requests.get(job_id)
        checker = self.checker(session.node_id, coord.sessions)
        if not proof or not proof.commitment or original is None or checker is None:
            self.unchecked(session.node_id)
            return
        request = self.verify_request(original, coord.completion(job_id)[1], proof)
        self.sent(request.job_id, session.node_id, job_id)
        (coord.dispatch_sealed if job_id in coord.plain_requests else coord.dispatch)(checker, request)

    def pick(self, job_id: str) -> bool:
        return not job_id.startswith(VERIFY_PREFIX) and self.fraction > 0 and self._rng.random() < self.fraction

    def verify_request(self, original: pb.JobRequest, output_ids: list[int], proof: pb.Proof) -> pb.JobRequest:
        req = pb.JobRequest()
        req.CopyFrom(original)
        req.job_id = VERIFY_PREFIX + original.job_id
        req.ClearField("sealed")
        req.verify.output_ids.extend(output_ids)
        req.verify.proof.CopyFrom(proof)
        return req

    def checker(self, producer: str, sessions: dict) -> object | None:
        """A connected node other than the producer, at random; None if there is none."""
        others = [s for node_id, s in sorted(sessions.items())
                  if node_id != producer and (self.verifiers is None or node_id in self.verifiers)]
        return self._rng.choice(others) if others else None

    def sent(self, verify_job_id: str, producer: str, job_id: str) -> None:
        self.pending[verify_job_id] = Pending(producer, job_id)

    def unchecked(self, producer: str) -> None:
        self.tally.setdefault(producer, Tally()).unchecked += 1

    def answered(self, frame: pb.ProviderFrame) -> None:
        """A verify job's outcome: its verdict counts for the node that made the claim."""
        kind = frame.WhichOneof("frame")
        outcome = getattr(frame, kind)
        pending = self.pending.pop(outcome.job_id, None)
        if pending is None:
            return
        t = self.tally.setdefault(pending.producer, Tally())
        if kind == "job_error":
            t.errors += 1
            return
        v = outcome.verdict
        t.checked += 1
        if v.passed:
            t.passed += 1
        else:
            t.failed += 1
            t.failures.append({"job_id": pending.job_id, "reason": v.reason,
                               "first_failure": v.first_failure if v.HasField("first_failure") else None})


def proof_of(coord, done: pb.JobDone) -> pb.Proof | None:
    """The outcome's proof (empty if none), opened for a sealed job this coordinator sent (SealingError if it
    does not open); None for one sealed to another sender."""
    c = done.completion
    if not c.sealed_proof:
        return c.proof
    keys = coord._keys(done.job_id, c.seal_salt)
    return keys.open_proof(done.job_id, c.sealed_proof) if keys is not None else None
