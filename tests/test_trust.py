"""Trust and the wire, against the reference coordinator on loopback with real MLX generation: pins, exact
at-least-once delivery, ProtocolError, Reject, sealed jobs (with golden vectors) and signed results."""

import asyncio
import hashlib
import hmac
import json
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from coordinator_client.identity import Identity
from coordinator_client.outcomes import token_digest
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.sealing import SealingKey, seal_job
from coordinator_client.session import CoordinatorSession
from provider.models import manifest
from provider.settings import Settings
from tests.helpers import make_node, run, until
from tools.harness.nodes import FAST_RECONNECT, harness, job

VECTORS = Path(__file__).parent / "vectors" / "sealing.json"


def _models(fixtures_dir):
    return {"g": fixtures_dir / "gemma4-tiny"}


def test_registration_carries_manifest_hashes_and_a_sealing_key(fixtures_dir, tmp_path):
    async def main():
        drafters = {"g": fixtures_dir / "gemma4-tiny-assistant"}
        async with harness(_models(fixtures_dir), tmp_path, manager_kw={"drafters": drafters}) as (coord, _, _s):
            reg = (await coord.wait_for_node()).registration
            (info,) = reg.models
            assert info.sha256 == manifest.model_hash(manifest.manifest(fixtures_dir / "gemma4-tiny"))
            assert info.drafter_sha256 == manifest.model_hash(manifest.manifest(drafters["g"]))
            assert len(reg.sealing_key) == 32

    run(main())


def test_a_pin_that_does_not_match_is_refused_and_nothing_is_loaded(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, _):
            s = await coord.wait_for_node()
            good = s.registration.models[0].sha256
            coord.dispatch(s, job("wrong", "g", model_sha256="0" * 64))
            coord.dispatch(s, job("garbled", "g", model_sha256="zz"))
            coord.dispatch(s, job("default", "", model_sha256="f" * 64))  # empty model: the default, pinned too
            for jid, cause in (("wrong", pb.ERROR_CAUSE_WEIGHTS_MISMATCH), ("garbled", pb.ERROR_CAUSE_INVALID_REQUEST),
                               ("default", pb.ERROR_CAUSE_WEIGHTS_MISMATCH)):
                err = (await coord.outcome(jid)).job_error
                assert err.cause == cause, (jid, err)
            assert good in (await coord.outcome("wrong")).job_error.message  # says which hash it has
            assert node.models.loads_started == 0 and not node.status().resident
            # Paths are never resolved from the wire: only names this node serves.
            for jid, name in (("dots", "../g"), ("abs", str(fixtures_dir / "qwen3-tiny")), ("etc", "/etc")):
                coord.dispatch(s, job(jid, name))
                assert (await coord.outcome(jid)).job_error.cause == pb.ERROR_CAUSE_UNKNOWN_MODEL
            assert node.models.loads_started == 0
            coord.dispatch(s, job("right", "g", model_sha256=good, max_tokens=4))
            done = (await coord.outcome("right")).job_done
            assert done.finish_reason == "length" and done.model_sha256 == good

    run(main())


def test_outcomes_carry_count_and_digest_and_are_signed(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, _, _s):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("one", "g", max_tokens=12))
            done = (await coord.outcome("one")).job_done
            c = done.completion
            assert c.chunks == len(coord.chunks["one"]) and c.token_ids_sha256 == token_digest(coord.token_ids("one"))
            assert not c.text and not c.token_ids  # the chunks carried them on this session
            assert coord.completion("one") == (coord.text("one"), coord.token_ids("one"))
            assert len(done.signature) == 64 and coord.check_result(s, done) is None and not coord.bad_results
            # The reference coordinator refuses a result whose signature or signed fields were altered.
            for field, tamper in (("signature", lambda d: setattr(d, "signature", bytes(64))),
                                  ("digest", lambda d: setattr(d.completion, "token_ids_sha256", bytes(32))),
                                  ("usage", lambda d: setattr(d.usage, "completion_tokens", 999)),
                                  ("model", lambda d: setattr(d, "model_sha256", "1" * 64))):
                forged = pb.JobDone()
                forged.CopyFrom(done)
                tamper(forged)
                assert "signature" in coord.check_result(s, forged), field
            # Signed but not what arrived: a digest over other tokens is caught against the chunks.
            short = pb.JobDone()
            short.CopyFrom(done)
            coord.chunks["one"].pop()
            assert "chunks arrived" in coord.check_result(s, short)

    run(main())


def test_a_coordinator_killed_mid_stream_rebuilds_the_whole_completion(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200, ack_outcomes=False)
        await coord.start()
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("cut", "g", max_tokens=4000, prompt="The cache " * 3))
            await until(lambda: len(coord.token_ids("cut")) >= 3, "the long job never streamed")
            coord.dispatch(s, job("whole", "g", max_tokens=6))
            await coord.outcome("whole")
            await coord.kill()  # mid-stream for "cut"; "whole" finished but was never acknowledged
            seen = coord.token_ids("cut")
            coord.chunks.clear()  # what a coordinator that lost its chunk store would have
            coord.outcomes.clear()
            await coord.start()
            await coord.wait_for_node(after=s.session_id)
            await until(lambda: len(coord.outcomes) == 2 or coord.bad_results, "the outcomes were not resent")
            assert not coord.bad_results, coord.bad_results  # a result that cannot be rebuilt is refused
            for jid in ("cut", "whole"):
                (frame,) = coord.outcomes[jid]
                text, ids = coord.completion(jid)  # from the re-sent outcome alone, checked against its digest
                assert ids and text
                if jid == "cut":
                    err = frame.job_error
                    assert err.cause == pb.ERROR_CAUSE_COORDINATOR_LOST and ids[:len(seen)] == seen
                    assert err.completion.chunks >= len(seen) and len(ids) >= len(seen)
                else:
                    assert frame.job_done.completion.chunks > 0 and len(ids) == frame.job_done.usage.completion_tokens
            assert not coord.bad_results and session.stats.outcomes_resent == 2

    run(main())


def test_a_garbage_or_out_of_order_frame_gets_protocol_error_and_the_next_job_succeeds(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, _, session):
            s = await coord.wait_for_node()
            coord.send(s, b"\xff\xff\xff garbled \x00\x01")
            coord.send(s, pb.CoordinatorFrame(welcome=pb.Welcome(session_id="again")))
            coord.send(s, pb.CoordinatorFrame())  # no case at all
            await until(lambda: len(coord.protocol_errors) >= 3, lambda: f"protocol errors: {coord.protocol_errors}")
            garbled, welcome, empty = coord.protocol_errors
            assert "did not decode" in garbled.reason and garbled.frame_bytes == len(b"\xff\xff\xff garbled \x00\x01")
            assert welcome.frame_kind == "welcome" and "handshake" in welcome.reason
            assert "no case" in empty.reason
            coord.dispatch(s, job("next", "g", max_tokens=4))
            assert (await coord.outcome("next")).job_done.finish_reason == "length"
            assert session.stats.sessions == 1

    run(main())


def test_reject_retry_after_and_permanent(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        await coord.start()
        coord.next_reject = pb.Reject(reason="busy, come back later", retry_after_s=1)
        async with harness(_models(fixtures_dir), tmp_path, coordinator=coord) as (_, _n, session):
            await coord.wait_for_node(timeout=30)
            assert session.stats.reconnect_delays[0] >= 1.0  # not the 0.05 s base delay
        await coord.start()  # the harness stopped it
        coord.next_reject = pb.Reject(reason="this node is banned", permanent=True)
        node = make_node(_models(fixtures_dir), max_concurrent_jobs=4)
        session = CoordinatorSession(node, Settings(coordinator=coord.url, **FAST_RECONNECT),
                                     Identity.load_or_create(tmp_path / "second"))
        try:
            # Never stopped: the reconnect loop ends by itself, and the node dials no more.
            await asyncio.wait_for(session.run(asyncio.Event()), 120)
        finally:
            await node.stop()
            await coord.kill()
        assert session.rejected == "this node is banned" and session.stats.connects == 1

    run(main())


def _hkdf(shared: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt, info).derive(shared)


def test_the_golden_sealing_vectors_open():
    """An implementation of the construction written from the proto's comment alone, in raw primitives, and the
    node's own code must both agree with the checked-in vectors."""
    v = json.loads(VECTORS.read_text())
    h = bytes.fromhex
    node = X25519PrivateKey.from_private_bytes(h(v["node_secret"]))
    shared = node.exchange(X25519PublicKey.from_public_bytes(h(v["sender_key"])))
    assert shared.hex() == v["shared_secret"]
    salt = h(v["sender_key"]) + h(v["sealing_key"])
    job = v["job_id"].encode()
    request = _hkdf(shared, salt, b"provider.v1.seal request\0" + job)
    response = _hkdf(shared, salt, b"provider.v1.seal response\0" + job + b"\0" + h(v["run_salt"]))
    digest = _hkdf(shared, salt, b"provider.v1.seal digest\0" + job + b"\0" + h(v["run_salt"]))
    assert (request.hex(), response.hex(), digest.hex()) == (v["request_key"], v["response_key"], v["digest_key"])
    prefix = b"provider.v1.seal\0" + v["job_id"].encode() + b"\0"
    plain = ChaCha20Poly1305(request).decrypt(bytes(12), h(v["job"]["ciphertext"]), prefix + b"job")
    assert plain.hex() == v["job"]["plaintext"]
    chunk = pb.TokenChunk.FromString(ChaCha20Poly1305(response).decrypt(
        bytes(4) + v["chunk"]["seq"].to_bytes(8, "big"), h(v["chunk"]["ciphertext"]), prefix + b"chunk"))
    assert (chunk.text, list(chunk.token_ids)) == (v["chunk"]["text"], v["chunk"]["token_ids"])
    completion = pb.Completion.FromString(ChaCha20Poly1305(response).decrypt(
        bytes(4) + b"\xff" * 8, h(v["completion"]["ciphertext"]), prefix + b"completion"))
    assert (completion.text, list(completion.token_ids)) == (v["completion"]["text"], v["completion"]["token_ids"])
    # A sealed run's token digest: HMAC-SHA256 under the digest key, over the ids as 4-byte little-endian.
    ids = b"".join(t.to_bytes(4, "little") for t in completion.token_ids)
    assert hmac.new(digest, ids, hashlib.sha256).hexdigest() == v["completion"]["token_ids_sha256"]
    # The node's code opens the same bytes, and seals the answers to the same bytes.
    body, keys = SealingKey(node).open_job(v["job_id"], pb.Sealed(sender_key=h(v["sender_key"]),
                                                                    ciphertext=h(v["job"]["ciphertext"])),
                                           run_salt=h(v["run_salt"]))
    assert body.SerializeToString().hex() == v["job"]["plaintext"]
    assert keys.seal_chunk(v["job_id"], v["chunk"]["seq"], chunk).hex() == v["chunk"]["ciphertext"]
    assert token_digest(completion.token_ids, keys).hex() == v["completion"]["token_ids_sha256"]


def test_sealed_jobs_round_trip_and_bad_seals_fail_closed(fixtures_dir, tmp_path):
    async def main():
        async with harness(_models(fixtures_dir), tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("plain", "g", max_tokens=10, prompt="A secret prompt"))
            coord.dispatch_sealed(s, job("sealed", "g", max_tokens=10, prompt="A secret prompt"))
            await coord.outcome("plain")
            done = (await coord.outcome("sealed")).job_done
            assert coord.completion("sealed") == coord.completion("plain")  # opened, the same greedy text
            wire = [f.token_chunk for _, kind, f in coord.frames if kind == "token_chunk"
                    and f.token_chunk.job_id == "sealed"]
            assert wire and all(c.sealed and not c.text and not c.token_ids for c in wire)
            # Its digest is keyed by the run's keys: in the clear, a plain SHA-256 would confirm a guessed output.
            assert done.completion.token_ids_sha256 == token_digest(coord.token_ids("plain"), coord._run_keys["sealed"])
            assert done.completion.token_ids_sha256 != token_digest(coord.token_ids("plain"))
            # Tampered ciphertext: refused, never run in plaintext; then the node serves the next job.
            good, _ = seal_job(s.registration.sealing_key, "tampered", job("tampered", "g", max_tokens=4))
            flipped = good.ciphertext[:-1] + bytes([good.ciphertext[-1] ^ 1])
            coord.dispatch(s, pb.JobRequest(job_id="tampered", model="g",
                                            sealed=pb.Sealed(sender_key=good.sender_key, ciphertext=flipped)))
            err = (await coord.outcome("tampered")).job_error
            assert err.cause == pb.ERROR_CAUSE_SEALING_FAILED and "did not open" in err.message
            other = SealingKey()  # sealed to some other process's key
            wrong, _ = seal_job(other.public_key, "elsewhere", job("elsewhere", "g"))
            coord.dispatch(s, pb.JobRequest(job_id="elsewhere", model="g", sealed=wrong))
            assert (await coord.outcome("elsewhere")).job_error.cause == pb.ERROR_CAUSE_SEALING_FAILED
            # A sealed body names its job: the same bytes under another id do not open (no replay as a new job).
            body, _ = seal_job(s.registration.sealing_key, "once", job("once", "g", max_tokens=4))
            coord.dispatch(s, pb.JobRequest(job_id="replayed", model="g", sealed=body))
            assert (await coord.outcome("replayed")).job_error.cause == pb.ERROR_CAUSE_SEALING_FAILED
            coord.dispatch(s, job("after", "g", max_tokens=4))
            assert (await coord.outcome("after")).job_done.finish_reason == "length"
            assert node.status().counters.jobs_completed == 3  # plain, sealed, after: nothing else ran
        async with harness(_models(fixtures_dir), tmp_path / "strict", require_sealed_jobs=True) as (coord, _n, _s):
            s = await coord.wait_for_node()
            coord.dispatch(s, job("cleartext", "g", max_tokens=4))
            err = (await coord.outcome("cleartext")).job_error
            assert err.cause == pb.ERROR_CAUSE_SEALING_FAILED and "require_sealed_jobs" in err.message
            coord.dispatch_sealed(s, job("sealed", "g", max_tokens=4))
            assert (await coord.outcome("sealed")).job_done.finish_reason == "length"

    run(main())
