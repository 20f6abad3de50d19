"""The coordinator's say in what stays loaded, over a real gRPC session on loopback: WarmModel and
ReleaseModel answered by one ModelResidency each, heartbeats saying what is warm and until when, and frames a
hostile coordinator sends (unknown models, huge names, floods) refused without harm."""

import time

from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.residency import MAX_MODEL_NAME
from tools.harness.nodes import harness
from tests.helpers import run, until


def answers(coord) -> dict[int, pb.ModelResidency]:
    return {f.model_residency.request_id: f.model_residency for _, kind, f in coord.frames if kind == "model_residency"}


async def answer(coord, request_id: int) -> pb.ModelResidency:
    await until(lambda: request_id in answers(coord), f"no answer to request {request_id}")
    return answers(coord)[request_id]


def test_warm_then_release_and_heartbeats_say_what_is_warm_until_when(fixtures_dir, tmp_path):
    models = {"q": fixtures_dir / "qwen3-tiny", "l": fixtures_dir / "llama-tiny"}

    async def main():
        async with harness(models, tmp_path, manager_kw={"pins": ("l",)}) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.send(s, pb.CoordinatorFrame(warm_model=pb.WarmModel(model="q", keep_alive="10m", request_id=1)))
            warm = await answer(coord, 1)
            assert warm.model == "q" and warm.state == "ready" and warm.keep_alive_s == 600
            assert abs(warm.unload_at_ms / 1000 - (time.time() + 600)) < 30
            # A heartbeat built after the load (one built during it says "loading").
            await until(lambda: any(r.model == "q" and r.state == "ready" for r in s.heartbeats[-1].residency),
                        "q ready in a heartbeat")
            (q,) = [r for r in s.heartbeats[-1].residency if r.model == "q"]
            assert q.request_id == 0 and q.keep_alive_s == 600 and q.unload_at_ms > 0
            coord.send(s, pb.CoordinatorFrame(warm_model=pb.WarmModel(model="l", keep_alive="-1", request_id=2)))
            pinned = await answer(coord, 2)
            assert pinned.pinned and pinned.keep_alive_s == -1 and pinned.unload_at_ms == 0
            coord.send(s, pb.CoordinatorFrame(release_model=pb.ReleaseModel(model="q", request_id=3)))
            assert (await answer(coord, 3)).state == "unloaded"
            assert node.models.resident() == ["l"]
            coord.send(s, pb.CoordinatorFrame(release_model=pb.ReleaseModel(model="l", request_id=4)))
            refused = await answer(coord, 4)
            assert refused.state == "refused" and refused.error_cause == pb.ERROR_CAUSE_INVALID_REQUEST
            assert "pinned" in refused.error_message and node.models.resident() == ["l"]
            await until(lambda: [r.model for r in s.heartbeats[-1].residency] == ["l"], "q gone from heartbeats")

    run(main())


def test_hostile_residency_frames_are_refused_and_the_session_keeps_serving(fixtures_dir, tmp_path):
    async def main():
        async with harness({"q": fixtures_dir / "qwen3-tiny"}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            frames = [pb.WarmModel(model="no-such-model", request_id=1), pb.WarmModel(model="x" * 100_000, request_id=2),
                      pb.WarmModel(model="q", keep_alive="soon", request_id=3),
                      pb.ReleaseModel(model="no-such-model", request_id=4)]
            for f in frames:
                coord.send(s, pb.CoordinatorFrame(**{"warm_model" if isinstance(f, pb.WarmModel) else
                                                     "release_model": f}))
            causes = {i: (await answer(coord, i)).error_cause for i in (1, 2, 3, 4)}
            assert causes == {1: pb.ERROR_CAUSE_UNKNOWN_MODEL, 2: pb.ERROR_CAUSE_INVALID_REQUEST,
                              3: pb.ERROR_CAUSE_INVALID_REQUEST, 4: pb.ERROR_CAUSE_UNKNOWN_MODEL}
            assert len(answers(coord)[2].model) <= MAX_MODEL_NAME
            assert not node.models.resident()  # nothing refused was loaded
            # A flood of warms and releases: every frame answered, at most one load, the node still serving.
            for i in range(100, 400):
                kind = "warm_model" if i % 2 else "release_model"
                body = pb.WarmModel(model="q", request_id=i) if i % 2 else pb.ReleaseModel(model="q", request_id=i)
                coord.send(s, pb.CoordinatorFrame(**{kind: body}))
            # One answers() a poll: building it per id starved the session sharing this loop (0.3 M frame reads a poll).
            await until(lambda: answers(coord).keys() >= set(range(100, 400)), "every frame answered")
            states = {answers(coord)[i].state for i in range(100, 400)}
            assert states <= {"ready", "loading", "unloaded", "unloading", "not_loaded", "refused"}
            coord.send(s, pb.CoordinatorFrame(warm_model=pb.WarmModel(model="q", request_id=500)))
            assert (await answer(coord, 500)).state in ("ready", "loading")
            assert session.stats.protocol_errors == 0

    run(main())
