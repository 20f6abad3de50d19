"""`provider start --coordinator` as a process, against the reference coordinator."""

import asyncio
import os
import signal
import subprocess
import sys

from coordinator_client.reference_coordinator import ReferenceCoordinator
from tools.harness.nodes import job
from tests.helpers import run


def _env(home):
    return os.environ | {"XDG_CONFIG_HOME": str(home / "config"), "XDG_STATE_HOME": str(home / "state"),
                         "XDG_CACHE_HOME": str(home / "cache"), "HF_HUB_OFFLINE": "1",
                         "PROVIDER_RECONNECT_MAX_DELAY_S": "0.5"}


def test_daemon_registers_serves_and_drains_on_sigterm(fixtures_dir, tmp_path):
    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=300)
        await coord.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "provider", "start", "--coordinator", coord.url, "--local", "--port", "0",
            "--model", str(fixtures_dir / "qwen3-tiny"), "--log-format", "json", env=_env(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        try:
            s = await coord.wait_for_node(timeout=120)
            assert [m.id for m in s.registration.models] == ["qwen3-tiny"]
            coord.dispatch(s, job("cli-1", "qwen3-tiny", max_tokens=6))
            assert (await coord.outcome("cli-1")).job_done.usage.completion_tokens >= 1
            coord.dispatch(s, job("cli-2", "qwen3-tiny", max_tokens=300))
            while len(coord.chunks["cli-2"]) < 2:
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
            # It drained: the job in flight reached its outcome and the node said Drained.
            assert (await coord.outcome("cli-2", timeout=5)).WhichOneof("frame") == "job_done"
            assert coord.drained
            out = (await proc.stdout.read()).decode()
            assert "coordinator: grpc://127.0.0.1" in out and "local OpenAI-compatible API" in out
        finally:
            if proc.returncode is None:
                proc.kill()
            await coord.kill()

    run(main())


def test_refuses_plaintext_to_a_network_coordinator_and_unsafe_keys(fixtures_dir, tmp_path):
    base = [sys.executable, "-m", "provider", "start", "--model", str(fixtures_dir / "qwen3-tiny")]
    r = subprocess.run(base + ["--coordinator", "grpc://10.9.8.7:50051"], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "refusing a plaintext connection" in r.stderr
    key = tmp_path / "state" / "provider" / "identity.ed25519.pem"
    key.parent.mkdir(parents=True, exist_ok=True)
    assert not key.exists()  # the bad URL was refused before any key was made
    key.write_text("x")
    key.chmod(0o644)
    r = subprocess.run(base + ["--coordinator", "grpc://127.0.0.1:1"], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "chmod 600" in r.stderr


def test_a_permanent_reject_ends_a_coordinator_only_node_with_exit_2(fixtures_dir, tmp_path):
    from coordinator_client.pb import provider_pb2 as pb

    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=300)
        await coord.start()
        coord.next_reject = pb.Reject(reason="protocol version 1 is no longer served", permanent=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "provider", "start", "--coordinator", coord.url,
            "--model", str(fixtures_dir / "qwen3-tiny"), env=_env(tmp_path),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            assert await asyncio.wait_for(proc.wait(), 120) == 2  # the service manager does not restart it
            err = (await proc.stderr.read()).decode()
            assert "refused this node for good: protocol version 1 is no longer served" in err
            assert coord.hellos == 1  # it did not dial again
        finally:
            if proc.returncode is None:
                proc.kill()
            await coord.kill()

    run(main())
