"""Pure parts of the coordinator client: backoff, channel policy, conversion, identity, generated code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator_client import convert
from coordinator_client.backoff import Backoff
from coordinator_client.channel import ChannelError, plan_channel
from coordinator_client.identity import Identity, IdentityError, next_session_epoch, verify_hello
from coordinator_client.pb import provider_pb2 as pb
from provider.jobs import JobError
from provider.outputs import Done, Usage
from provider.types import Cause, FinishReason, SpecMode
from provider.telemetry import SpecTelemetry, Telemetry

ROOT = Path(__file__).resolve().parents[1]


def test_backoff_is_capped_exponential_with_full_jitter():
    b = Backoff(base=0.5, cap=8.0, rand=lambda: 1.0)
    assert [b.next_delay() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    b.reset()
    assert b.next_delay() == 0.5
    zero = Backoff(base=0.5, cap=8.0, rand=lambda: 0.0)
    assert zero.next_delay() == 0.0  # full jitter reaches down to zero
    huge = Backoff(base=1.0, cap=30.0, rand=lambda: 1.0, attempt=10_000)
    assert huge.next_delay() == 30.0


@pytest.mark.parametrize("url, target, tls", [
    ("grpc://127.0.0.1:50051", "127.0.0.1:50051", False),
    ("localhost:7000", "localhost:7000", False),
    ("[::1]:7000", "[::1]:7000", False),
    ("grpcs://coord.example.net:443", "coord.example.net:443", True),
    ("coord.example.net:8443", "coord.example.net:8443", True),
    ("https://coord.example.net", "coord.example.net:443", True),
])
def test_channel_plan(url, target, tls):
    plan = plan_channel(url)
    assert (plan.target, plan.tls) == (target, tls)


def test_plaintext_to_a_network_address_is_refused_unless_allowed():
    with pytest.raises(ChannelError, match="refusing a plaintext connection"):
        plan_channel("grpc://10.1.2.3:50051")
    assert plan_channel("grpc://10.1.2.3:50051", allow_insecure=True).tls is False
    with pytest.raises(ChannelError, match="scheme"):
        plan_channel("ftp://x:1")


def test_job_request_conversion():
    req = pb.JobRequest(job_id="a", model="m", chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                                              content="hi")]),
                        max_tokens=5, stop=["x"], speculation=pb.SPECULATION_POLICY_OFF,
                        sampling=pb.SamplingParams(temperature=0, top_k=4, seed=9))
    job = convert.job_from_request(req, max_tokens_limit=100, default_max_tokens=10)
    assert job.messages == ({"role": "user", "content": "hi"},) and job.speculation == "off"
    assert job.sampling.greedy and job.sampling.top_k == 4 and job.sampling.seed == 9 and job.sampling.stop == ("x",)
    defaults = convert.job_from_request(pb.JobRequest(job_id="b", model="m", prompt="p"), max_tokens_limit=100,
                                        default_max_tokens=10)
    assert defaults.sampling.max_tokens == 10 and defaults.sampling.temperature == 1.0


def test_every_cause_has_a_wire_value():
    assert set(convert.CAUSE_TO_PB) == set(Cause)


def test_done_frame_carries_the_local_api_telemetry():
    t = Telemetry(FinishReason.LENGTH, SpecTelemetry(SpecMode.OFF, "no_drafter"), ttft_ms=12.5, queue_ms=1.0,
                  total_ms=50.0, prefill_tokens_per_s=100.0, decode_tokens_per_s=None, peak_memory_bytes=10)
    frame = convert.done_frame(Done("j", FinishReason.LENGTH, Usage(3, 4), t))
    tel = frame.job_done.telemetry
    assert tel.ttft_ms == 12.5 and not tel.HasField("decode_tokens_per_s")
    assert tel.speculation.reason == "no_drafter" and frame.job_done.usage.total_tokens == 7


@pytest.mark.parametrize("req, fragment", [
    (pb.JobRequest(model="m", prompt="p"), "job_id"),
    (pb.JobRequest(job_id="x" * 200, model="m", prompt="p"), "job_id"),
    (pb.JobRequest(job_id="a", model="m"), "neither"),
    (pb.JobRequest(job_id="a", model="m", prompt=""), "prompt is empty"),
    (pb.JobRequest(job_id="a", model="m", prompt="p", max_tokens=101), "max_tokens"),
    (pb.JobRequest(job_id="a", model="m", prompt="p", sampling=pb.SamplingParams(top_p=0)), "top_p"),
    (pb.JobRequest(job_id="a", model="m", prompt="p", sampling=pb.SamplingParams(temperature=float("nan"))),
     "temperature"),
])
def test_bad_job_requests_are_invalid_request(req, fragment):
    with pytest.raises(JobError) as e:
        convert.job_from_request(req, max_tokens_limit=100, default_max_tokens=10)
    assert e.value.cause == Cause.INVALID_REQUEST and fragment in e.value.message


def test_identity_key_is_private_and_stable(tmp_path):
    a = Identity.load_or_create(tmp_path)
    key = tmp_path / "identity.ed25519.pem"
    assert key.stat().st_mode & 0o777 == 0o600
    assert Identity.load_or_create(tmp_path).node_id == a.node_id
    reg = pb.Registration(node_id=a.node_id, public_key=a.public_key, nonce=b"n" * 16)
    assert verify_hello(a.hello(reg)).nonce == b"n" * 16
    os.chmod(key, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)
    os.chmod(key, 0o600)
    key.write_text("not a key")
    with pytest.raises(IdentityError, match="not a PEM"):
        Identity.load_or_create(tmp_path)


def test_session_epoch_grows_across_restarts(tmp_path):
    assert [next_session_epoch(tmp_path) for _ in range(3)] == [1, 2, 3]


def test_generated_code_matches_the_proto():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "scripts" / "gen_proto.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_outcome_store_answers_repeats_of_its_last_max_finished_jobs():
    """The store keeps the last MAX_FINISHED outcomes (10,000) to answer a repeated JobRequest; the one before them
    counts as new. (test_sealing_replay floods a smaller bound through a node: the same eviction, fewer frames.)"""
    from coordinator_client.outcomes import MAX_FINISHED, Outcomes

    assert MAX_FINISHED == 10_000  # docs/protocol.md's figure
    store = Outcomes()
    for i in range(MAX_FINISHED + 1):
        store.record(f"j{i}", pb.ProviderFrame(job_error=pb.JobError(job_id=f"j{i}", message="x")))
    assert not store.ran("j0") and store.ran("j1") and store.ran(f"j{MAX_FINISHED}")
    assert store.finished("j1").job_error.job_id == "j1"
