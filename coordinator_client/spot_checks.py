"""The reference coordinator's spot checks (docs/verification.md): a fraction of finished jobs that carry a
proof are verified again on another connected node, and each producing node's verdicts are tallied.

A verify job is the original request (its plaintext, for a sealed job, sealed again to the verifier) with the
claimed output ids and the opened proof in `verify`, under a deadline of its own; its JobDone carries a signed
Verdict. The verifier is never the producer, nor a node on the producer's address (its sibling, as far as a
coordinator can tell). A job picked from a node that registered as committing but answered without a proof
fails its check: leaving the proof out must not be a way round the check. A job with no other node to check it
counts as unchecked. Each verdict that counts is told to its producer, if connected (SpotCheckResult).
"""

from __future__ import annotations

import ipaddress
import random
import time
from dataclasses import dataclass, field

from provider.proofs.verdicts import looser

from .convert import tolerance_from_pb, tolerance_to_pb
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
    checker: str | None = None  # the node id it was sent to: the only one whose answer counts


VERIFY_PREFIX = "verify-"
DEFAULT_VERIFY_FRACTION = 0.05  # the reference coordinator's default: every node is checked, cheaply (economics: docs)
VERIFY_DEADLINE_S = 600  # a verify job's own: the producer's deadline is not the check's
NO_PROOF = "no proof from a node that registered as committing"


class SpotChecks:
    def __init__(self, fraction: float, seed: int | None = None, deadline_s: float = VERIFY_DEADLINE_S):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("the verify fraction is a share of jobs, 0 to 1")
        self.fraction = fraction
        self.deadline_s = deadline_s
        self._rng = random.Random(seed)
        self.tally: dict[str, Tally] = {}
        self.verifiers: set[str] | None = None  # node ids trusted to check others; None: any connected node
        self.pending: dict[str, Pending] = {}  # verify job id -> what it checks

    def after(self, coord, session, job_id: str, frame: pb.ProviderFrame) -> None:
        """On `coord` (a ReferenceCoordinator), a recorded outcome from `session`: a verify job's answer is
        tallied; a finished job picked for a spot check is sent to another node."""
        if job_id in self.pending:
            if (verdict := self.answered(frame, session)) is not None:
                tell(coord, *verdict)
            return
        if len(coord.outcomes[job_id]) > 1 or frame.WhichOneof("frame") != "job_done" \
                or job_id.startswith(VERIFY_PREFIX) or frame.job_done.finish_reason == "cancelled":
            return  # a cancelled job (by the coordinator, or a drain) is no finished work to pay for or check
        proof = proof_of(coord, frame.job_done)
        if proof is None:  # sealed by another sender: not ours to open, nor to check
            self.unchecked(session.node_id)
            return
        if not proof.commitment and session.registration.verification.commits:
            # seen without a check: every such outcome counts
            tell(coord, session.node_id, self.failed(session.node_id, job_id, NO_PROOF))
            return
        if not self.pick(job_id):
            return
        original = coord.plain_requests.get(job_id) or coord.requests.get(job_id)
        checker = self.checker(session, coord.sessions)
        if not proof or not proof.commitment or original is None or checker is None:
            self.unchecked(session.node_id)
            return
        request = self.verify_request(original, coord.completion(job_id)[1], proof,
                                      verify_tolerance(session.registration, checker.registration))
        self.sent(request.job_id, session.node_id, job_id, checker.node_id)
        (coord.dispatch_sealed if job_id in coord.plain_requests else coord.dispatch)(checker, request)

    def pick(self, job_id: str) -> bool:
        return not job_id.startswith(VERIFY_PREFIX) and self.fraction > 0 and self._rng.random() < self.fraction

    def verify_request(self, original: pb.JobRequest, output_ids: list[int], proof: pb.Proof,
                       tolerance: pb.Tolerance | None = None) -> pb.JobRequest:
        req = pb.JobRequest()
        req.CopyFrom(original)
        req.job_id = VERIFY_PREFIX + original.job_id
        req.deadline_ms = int((time.time() + self.deadline_s) * 1000)  # its own: not the producer's to spend
        req.ClearField("sealed")
        req.verify.output_ids.extend(output_ids)
        req.verify.proof.CopyFrom(proof)
        if tolerance is not None:
            req.verify.tolerance.CopyFrom(tolerance)
        return req

    def checker(self, producer, sessions: dict) -> object | None:
        """A connected node other than the producer (a session) and its siblings, at random; None if there is none."""
        others = [s for node_id, s in sorted(sessions.items())
                  if node_id != producer.node_id and not siblings(producer, s)
                  and (self.verifiers is None or node_id in self.verifiers)]
        return self._rng.choice(others) if others else None

    def sent(self, verify_job_id: str, producer: str, job_id: str, checker: str | None = None) -> None:
        self.pending[verify_job_id] = Pending(producer, job_id, checker)

    def unchecked(self, producer: str) -> None:
        self.tally.setdefault(producer, Tally()).unchecked += 1

    def failed(self, producer: str, job_id: str, reason: str, first_failure: int | None = None) -> pb.SpotCheckResult:
        t = self.tally.setdefault(producer, Tally())
        t.checked += 1
        t.failed += 1
        t.failures.append({"job_id": job_id, "reason": reason, "first_failure": first_failure})
        return pb.SpotCheckResult(job_id=job_id, passed=False, reason=reason, first_failure=first_failure)

    def answered(self, frame: pb.ProviderFrame, session=None) -> tuple[str, pb.SpotCheckResult] | None:
        """A verify job's outcome: its verdict counts for the node that made the claim. Only the checker it was sent
        to answers it (another node's frame for that id, the producer's first of all, is ignored). A claim the
        checker refuses as invalid (a proof or output ids no node would send) fails: an error must not be a way
        round the check. Returns (the producer, the verdict to tell it) when one counted."""
        kind = frame.WhichOneof("frame")
        outcome = getattr(frame, kind)
        pending = self.pending.get(outcome.job_id)
        if pending is None or (pending.checker is not None and session is not None
                               and session.node_id != pending.checker):
            return None
        del self.pending[outcome.job_id]
        t = self.tally.setdefault(pending.producer, Tally())
        if kind == "job_error":
            if outcome.cause == pb.ERROR_CAUSE_INVALID_REQUEST:
                return pending.producer, self.failed(pending.producer, pending.job_id,
                                                     f"the claim is invalid: {outcome.message}", 0)
            t.errors += 1
            return None
        v = outcome.verdict
        if not v.passed:
            return pending.producer, self.failed(pending.producer, pending.job_id, v.reason,
                                                 v.first_failure if v.HasField("first_failure") else None)
        t.checked += 1
        t.passed += 1
        return pending.producer, pb.SpotCheckResult(job_id=pending.job_id, passed=True)


def tell(coord, producer: str, result: pb.SpotCheckResult) -> None:
    """The producer hears each verdict on its own work, if it is connected (informational: the tally here is what
    counts)."""
    session = coord.sessions.get(producer)
    if session is not None:
        session.outgoing.put_nowait(pb.CoordinatorFrame(spot_check_result=result))


def proof_of(coord, done: pb.JobDone) -> pb.Proof | None:
    """The outcome's proof (empty if none), opened for a sealed job this coordinator sent (SealingError if it
    does not open); None for one sealed to another sender."""
    c = done.completion
    if not c.sealed_proof:
        return c.proof
    keys = coord._keys(done.job_id, c.seal_salt)
    return keys.open_proof(done.job_id, c.sealed_proof) if keys is not None else None


def siblings(a, b) -> bool:
    """Whether two sessions are, as far as a coordinator can tell, one operator's: the same key (one node id) or
    the same public address. Loopback is not an address two operators could share but every local test node
    has, so it tells nothing."""
    if a.node_id == b.node_id:
        return True
    ha, hb = host_of(getattr(a, "peer", "")), host_of(getattr(b, "peer", ""))
    return ha is not None and ha == hb and not ha.is_loopback


def host_of(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a gRPC peer string ("ipv4:203.0.113.5:40000", "ipv6:[2001:db8::1]:40000"); None if it has none."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def verify_tolerance(producer: pb.Registration, verifier: pb.Registration) -> pb.Tolerance | None:
    """The looser of the two nodes' registered tolerances (what each one's backend needs to pass honest work);
    None when either registered none (the verifier then applies its own). The verifier holds it to the loosest
    profile it knows."""
    if not producer.verification.HasField("tolerance") or not verifier.verification.HasField("tolerance"):
        return None
    both = looser(tolerance_from_pb(producer.verification.tolerance), tolerance_from_pb(verifier.verification.tolerance))
    return tolerance_to_pb(both)
