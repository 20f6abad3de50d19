"""The coordinator's WarmModel and ReleaseModel to a real daemon (`provider start --coordinator URL --local` in a
subprocess, against the reference coordinator): each answered by one ModelResidency, and what the daemon's
heartbeats say is resident, and for how long, agrees with its /health (in-process: test_residency_wire.py)."""

import asyncio
import time

import httpx

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from tests.helpers import run, until
from tools.harness.daemon import LocalServer
from tools.harness.nodes import job


def answers(coord) -> dict[int, pb.ModelResidency]:
    return {f.model_residency.request_id: f.model_residency for _, kind, f in coord.frames if kind == "model_residency"}


async def answer(coord, request_id: int) -> pb.ModelResidency:
    await until(lambda: request_id in answers(coord), f"no answer to request {request_id}", timeout=60)
    return answers(coord)[request_id]


async def health(server) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(f"{server.url}/health")).json()


def heartbeat_view(s) -> dict[str, pb.ModelResidency]:
    return {r.model: r for r in s.heartbeats[-1].residency} if s.heartbeats else {}


async def agreeing(s, server, want: set[str]) -> tuple[dict, dict]:
    """The daemon's latest heartbeat and its /health, once both say exactly `want` is ready: its view sent to the
    coordinator and its local one, side by side."""
    async def views():
        return heartbeat_view(s), {m["id"]: m for m in (await health(server))["resident"]}

    deadline = time.monotonic() + 30
    while True:
        beat, local = await views()
        if {m for m, r in beat.items() if r.state == "ready"} == set(beat) == want \
                and {m for m, r in local.items() if r["state"] == "ready"} == set(local) == want \
                and set(s.heartbeats[-1].resident_models) == want:
            return beat, local
        assert time.monotonic() < deadline, (f"want {sorted(want)} ready; heartbeat: "
                                             f"{ {m: r.state for m, r in beat.items()} }, /health: "
                                             f"{ {m: r['state'] for m, r in local.items()} }")
        await asyncio.sleep(0.05)


def test_warm_and_release_from_the_coordinator_as_the_daemon_reports_them(fixtures_dir, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f"""
max_resident_models = 3
[models.pinned]
source = "{fixtures_dir / 'llama-tiny'}"
pin = true
[models.q]
source = "{fixtures_dir / 'qwen3-tiny'}"
[models.g]
source = "{fixtures_dir / 'gemma4-tiny'}"
""")

    async def main():
        coord = ReferenceCoordinator(heartbeat_interval_ms=200)
        await coord.start()
        server = await asyncio.to_thread(LocalServer, None, tmp_path, "--config", str(config), "--coordinator",
                                         coord.url, env={"PROVIDER_RECONNECT_MAX_DELAY_S": "0.5"})
        try:
            s = await coord.wait_for_node(timeout=120)
            await agreeing(s, server, {"pinned"})

            coord.send(s, pb.CoordinatorFrame(warm_model=pb.WarmModel(model="q", keep_alive="10m", request_id=1)))
            warm = await answer(coord, 1)
            assert warm.model == "q" and warm.state == "ready" and warm.keep_alive_s == 600 and not warm.pinned
            beat, local = await agreeing(s, server, {"pinned", "q"})
            assert beat["q"].keep_alive_s == 600 == local["q"]["keep_alive_s"]
            assert abs(beat["q"].unload_at_ms / 1000 - local["q"]["unload_at"]) < 2
            assert abs(local["q"]["unload_at"] - (time.time() + 600)) < 30
            assert beat["pinned"].pinned and beat["pinned"].keep_alive_s == -1 and beat["pinned"].unload_at_ms == 0
            assert local["pinned"]["pinned"] and local["pinned"]["keep_alive_s"] is None

            coord.send(s, pb.CoordinatorFrame(warm_model=pb.WarmModel(model="g", keep_alive="-1", request_id=2)))
            kept = await answer(coord, 2)
            assert kept.state == "ready" and kept.keep_alive_s == -1 and kept.unload_at_ms == 0
            beat, local = await agreeing(s, server, {"pinned", "q", "g"})
            assert beat["g"].keep_alive_s == -1 and local["g"]["keep_alive_s"] is None and local["g"]["unload_at"] is None

            # A job for a warmed model is served from it, with no load of its own.
            loads = server.logs().count('"event": "model_loaded"')
            coord.dispatch(s, job("after-warm", "g", max_tokens=4))
            assert (await coord.outcome("after-warm", timeout=60)).job_done.usage.completion_tokens >= 1
            assert server.logs().count('"event": "model_loaded"') == loads

            coord.send(s, pb.CoordinatorFrame(release_model=pb.ReleaseModel(model="q", request_id=3)))
            assert (await answer(coord, 3)).state == "unloaded"
            await agreeing(s, server, {"pinned", "g"})
            coord.send(s, pb.CoordinatorFrame(release_model=pb.ReleaseModel(model="pinned", request_id=4)))
            refused = await answer(coord, 4)
            assert refused.state == "refused" and refused.error_cause == pb.ERROR_CAUSE_INVALID_REQUEST
            assert "pinned" in refused.error_message
            coord.send(s, pb.CoordinatorFrame(release_model=pb.ReleaseModel(model="g", request_id=5)))
            assert (await answer(coord, 5)).state == "unloaded"
            await agreeing(s, server, {"pinned"})
            assert (await health(server))["counters"]["jobs_failed"] == 0
        finally:
            await asyncio.to_thread(server.stop)
            await coord.kill()

    run(main())
