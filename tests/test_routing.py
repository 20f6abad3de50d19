"""Cache-aware routing: the keyed prefix chain, the router's choice and its quarantine (pure), and two real
nodes on the reference coordinator, a conversation's next turn sent where its prefix is held."""

import asyncio
import contextlib

from coordinator_client.identity import Identity
from coordinator_client.pb import provider_pb2 as pb
from coordinator_client.reference_coordinator import ReferenceCoordinator
from coordinator_client.routing import STRIKES, Router, dispatch_routed, prefix_chain
from coordinator_client.session import CoordinatorSession
from provider.settings import Settings
from tests.helpers import run, until
from tools.harness.nodes import FAST_RECONNECT, make_node

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]


@contextlib.asynccontextmanager
async def connected_nodes(fixtures_dir, tmp_path, *settings: dict):
    """The reference coordinator and a node per `settings` (on llama-tiny) in session with it, all stopped after."""
    coord = ReferenceCoordinator(heartbeat_interval_ms=100, verify_fraction=0.0)  # routing, not spot checks
    await coord.start()
    stop, tasks, nodes = asyncio.Event(), [], []
    for i, kw in enumerate(settings):
        node = make_node({"m": fixtures_dir / "llama-tiny"}, **kw)
        session = CoordinatorSession(node, Settings(coordinator=coord.url, **FAST_RECONNECT),
                                     Identity.load_or_create(tmp_path / str(i)))
        tasks.append(asyncio.create_task(session.run(stop)))
        nodes.append(node)
    try:
        await until(lambda: len(coord.sessions) == len(nodes), "every node in session")
        yield coord, nodes
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for node in nodes:
            await node.stop()
        await coord.kill()


def test_the_chain_is_keyed_scoped_and_grows_with_the_conversation():
    chain = prefix_chain(KEY, "m", "t", CHAT)
    longer = prefix_chain(KEY, "m", "t", CHAT + [{"role": "assistant", "content": "Hello"}])
    assert len(chain) == 2 and longer[:2] == chain
    assert prefix_chain(OTHER_KEY, "m", "t", CHAT)[0] != chain[0]  # without the key, nothing to compare
    assert prefix_chain(KEY, "m", "u", CHAT)[0] != chain[0] and prefix_chain(KEY, "n", "t", CHAT)[0] != chain[0]
    assert prefix_chain(KEY, "m", "t", [{"role": "user", "content": [{"type": "image_url"}]}]) == []


def test_the_router_follows_held_prefixes_weighs_load_and_quarantines_unconfirmed_claims():
    router = Router(KEY, seed=1)
    chain = prefix_chain(KEY, "m", "t", CHAT)
    router.heard("a", [chain[1]])
    assert router.pick(["a", "b"], chain, "j1") == "a"
    router.finished("a", "j1", cached_prompt_tokens=30)  # confirmed
    router.nodes["a"].load = 3  # busy: three jobs running outweigh two messages held
    assert router.pick(["a", "b"], chain, "j2") == "b"
    router.nodes["a"].load = 0
    for i in range(STRIKES):  # claims it never confirms
        assert router.pick(["a", "b"], chain, f"lie{i}") == "a"
        router.finished("a", f"lie{i}", cached_prompt_tokens=0)
    assert router.quarantines == 1
    picks = {router.pick(["a", "b"], chain, f"after{i}") for i in range(20)}
    assert picks == {"a", "b"} or picks == {"b"}  # its claims ignored: load and chance decide


def test_the_next_turn_goes_to_the_node_that_holds_the_conversation(fixtures_dir, tmp_path):
    async def main():
        async with connected_nodes(fixtures_dir, tmp_path, *[{"max_concurrent_jobs": 2, "prefix_disk_gb": 0.0}] * 2) \
                as (coord, _):
            messages = [{"role": "system", "content": "cache " * 300}, {"role": "user", "content": "first"}]

            def request(job_id):
                return pb.JobRequest(job_id=job_id, model="m", max_tokens=4, sampling=pb.SamplingParams(temperature=0),
                                     cache_scope="t",
                                     chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))

            first = dispatch_routed(coord, request("turn-1"))
            await coord.outcome("turn-1")
            messages += [{"role": "assistant", "content": coord.text("turn-1")}, {"role": "user", "content": "next"}]
            await until(lambda: len(first.heartbeats) and first.heartbeats[-1].prefix_hashes, "held prefixes told")
            for turn in range(2, 5):
                chosen = dispatch_routed(coord, request(f"turn-{turn}"))
                done = (await coord.outcome(f"turn-{turn}")).job_done
                assert chosen is first and done.usage.cached_prompt_tokens > 300
                assert done.telemetry.prefix_tier == "memory"
                messages += [{"role": "assistant", "content": coord.text(f"turn-{turn}")},
                             {"role": "user", "content": f"turn {turn}"}]
                await asyncio.sleep(0.3)
            assert coord.router.quarantines == 0

    run(main())


def test_a_node_stops_claiming_what_it_no_longer_holds(fixtures_dir, tmp_path):
    """Unloading the model drops its memory tier: the prefixes it held leave the heartbeats (an honest node is
    never struck for a claim it could not serve); those also on disk stay claimed."""
    async def main():
        async with connected_nodes(fixtures_dir, tmp_path, *[
                {"prefix_disk_gb": gb, "prefix_disk_dir": str(tmp_path / f"disk-{i}")} for i, gb in enumerate([0, 1])
        ]) as (coord, nodes):
            messages = [pb.ChatMessage(role="system", content="cache " * 700),
                        pb.ChatMessage(role="user", content="hi")]
            for i, s in enumerate(coord.sessions.values()):
                coord.dispatch(s, pb.JobRequest(job_id=f"j{i}", model="m", max_tokens=4, cache_scope="t",
                                                sampling=pb.SamplingParams(temperature=0),
                                                chat=pb.ChatMessages(messages=messages)))
                await coord.outcome(f"j{i}")
            sessions = list(coord.sessions.values())
            await until(lambda: all(s.heartbeats and s.heartbeats[-1].prefix_hashes for s in sessions),
                        "both nodes claim the conversation")
            for node in nodes:
                assert await node.unload_model("m") == "unloaded"
            await asyncio.sleep(0.5)  # a few heartbeats
            claims = sorted(bool(s.heartbeats[-1].prefix_hashes) for s in sessions)
            assert claims == [False, True]  # the memory-only node claims nothing now; the one with a disk still does

    run(main())
