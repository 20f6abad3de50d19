"""Issue 20, finding 1: a coordinator floods the node's outcome store, then replays a sealed job, and reuses a
sender key for another job id. The node must never seal two things under one (key, nonce) pair: a replay is
refused while its sender key is remembered, and when it is not (the memory is bounded; here it is cleared, an
injected fault), the run's fresh salt gives it a new response key. The (key, nonce) pairs are computed on the
coordinator's side, from what it can know: its own ephemeral secret and each run's announced salt."""

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from coordinator_client import outcomes
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.sealing import COMPLETION_COUNTER, derive_keys, nonce, seal_job
from tests.helpers import run, until
from tools.harness.nodes import harness, job


def _pairs(coord, sender: X25519PrivateKey, sealing_key: bytes) -> list[tuple[bytes, bytes]]:
    """Every (response key, nonce) the node sealed with, in the order the frames came."""
    sender_key = sender.public_key().public_bytes_raw()
    shared = sender.exchange(X25519PublicKey.from_public_bytes(sealing_key))
    salt: dict[str, bytes] = {}
    out = []
    for _, kind, frame in coord.frames:
        if kind == "job_accepted" and frame.job_accepted.seal_salt:
            salt[frame.job_accepted.job_id] = frame.job_accepted.seal_salt
        elif kind == "token_chunk" and frame.token_chunk.sealed:
            c = frame.token_chunk
            out.append((derive_keys(shared, sender_key, sealing_key, c.job_id, salt[c.job_id])[1], nonce(c.seq)))
        elif kind in ("job_done", "job_error"):
            outcome = getattr(frame, kind)
            if outcome.completion.sealed:
                key = derive_keys(shared, sender_key, sealing_key, outcome.job_id, outcome.completion.seal_salt)[1]
                out.append((key, nonce(COMPLETION_COUNTER)))
    return out


def _send_sealed(coord, session, inner: pb.JobRequest, sender: X25519PrivateKey) -> None:
    """Seal `inner` with a given ephemeral key (dispatch_sealed draws a fresh one): the attacker reuses it."""
    sealed, keys = seal_job(session.registration.sealing_key, inner.job_id, inner, sender)
    coord.dispatch(session, pb.JobRequest(job_id=inner.job_id, model=inner.model, sealed=sealed))
    coord._job_keys[inner.job_id] = keys  # to open what comes back (its result answers the sealed request sent)


async def _outcomes(coord, job_id: str, n: int, timeout: float = 60) -> list[pb.ProviderFrame]:
    await until(lambda: len(coord.outcomes.get(job_id, ())) >= n,
                lambda: f"{job_id}: {len(coord.outcomes.get(job_id, ()))} of {n} outcomes", timeout)
    return coord.outcomes[job_id]


def test_flood_then_replay_and_sender_key_reuse_never_reuse_a_key_and_nonce(fixtures_dir, tmp_path, monkeypatch):
    # The outcome store keeps 10,000 (test_coordinator_units checks it); a flood past a bound of 500 pushes
    # "victim" out the same way, in a twentieth of the frames.
    monkeypatch.setattr(outcomes, "MAX_FINISHED", 500)
    MAX_FINISHED = outcomes.MAX_FINISHED

    async def main():
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            key = s.registration.sealing_key
            sender = X25519PrivateKey.generate()
            victim = job("victim", "g", max_tokens=8, temperature=1.0)
            other = job("other", "g", max_tokens=8, temperature=1.0)
            _send_sealed(coord, s, victim, sender)
            await _outcomes(coord, "victim", 1)
            for i in range(MAX_FINISHED + 1):  # cheap invalid requests push "victim" out of the outcome store
                coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=f"flood-{i}", model="g")))
            await _outcomes(coord, f"flood-{MAX_FINISHED}", 1)
            _send_sealed(coord, s, victim, sender)  # the replay: its sender key is remembered
            refused = (await _outcomes(coord, "victim", 2))[-1]
            assert refused.job_error.cause == pb.ERROR_CAUSE_SEALING_FAILED and "used" in refused.job_error.message
            _send_sealed(coord, s, other, sender)  # one sender key, another job id
            assert (await _outcomes(coord, "other", 1))[-1].job_error.cause == pb.ERROR_CAUSE_SEALING_FAILED
            session.sealing._seen.clear()  # fault: the bounded memory has forgotten the key
            for i in range(MAX_FINISHED + 1):
                coord.send(s, pb.CoordinatorFrame(job_request=pb.JobRequest(job_id=f"again-{i}", model="g")))
            await _outcomes(coord, f"again-{MAX_FINISHED}", 1)
            coord.chunks.clear()  # the attacker's own store of the first run: each run is checked on its own
            _send_sealed(coord, s, victim, sender)  # now it runs again, sampled, and must be under a new key
            assert (await _outcomes(coord, "victim", 3))[-1].job_done.finish_reason
            session.sealing._seen.clear()  # forgotten again: the same key for another job id runs too
            _send_sealed(coord, s, other, sender)
            assert (await _outcomes(coord, "other", 2))[-1].job_done.finish_reason
            assert not coord.bad_results, coord.bad_results
            pairs = _pairs(coord, sender, key)
            assert len(pairs) >= 3 * 2 and len(set(pairs)) == len(pairs), "a (key, nonce) pair was used twice"
            salts = [f.job_accepted.seal_salt for _, kind, f in coord.frames if kind == "job_accepted"
                     and f.job_accepted.job_id in ("victim", "other")]
            assert len(salts) == 3 and len(set(salts)) == 3

    run(main())
