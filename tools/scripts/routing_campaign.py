"""Cache-aware routing against load-only routing: two nodes, the reference coordinator, multi-turn
conversations interleaved.

Each conversation has a long system prompt of its own and grows turn by turn (its answers sent back as
history); the turns of all conversations are interleaved, one job at a time. With cache-aware routing the
coordinator sends each turn to the node whose heartbeats say it holds the longest prefix of it (routing.py);
with load-only routing, to the least loaded node (ties at random, as the cache-aware router breaks them). Printed
per policy: the share of the reusable prompt tokens (those of the conversation's previous turn, prompt and
answer) that were served from a prefix cache, and the mean time to first token.

    python tools/scripts/routing_campaign.py [--conversations 20] [--turns 4] [--system-words 600] [--shared-system]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coordinator_client.identity import Identity  # noqa: E402
from coordinator_client.pb import provider_pb2 as pb  # noqa: E402
from coordinator_client.reference_coordinator import ReferenceCoordinator  # noqa: E402
from coordinator_client.routing import dispatch_routed  # noqa: E402
from coordinator_client.session import CoordinatorSession  # noqa: E402
from tools.fixtures import factory  # noqa: E402
from provider.settings import Settings  # noqa: E402
from tools.harness.nodes import FAST_RECONNECT, make_node  # noqa: E402

WORDS = ("cache prefix model token memory batch node route disk layer head query value key tensor stream "
         "answer system prompt turn user agent tool schema grammar").split()


def system_prompt(k: int, words: int, rng: random.Random) -> str:
    return f"You are assistant number {k}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def campaign(model: Path, cache_aware: bool, args, root: Path) -> dict:
    coord = ReferenceCoordinator(heartbeat_interval_ms=100)
    await coord.start()
    coord.router.cache_aware = coord.router.cache_aware and cache_aware
    nodes, tasks, stop = [], [], asyncio.Event()
    for i in range(2):
        node = make_node({"m": model}, max_concurrent_jobs=4, prefix_disk_gb=0.0, prefix_cache_gb=1.0)
        st = Settings(coordinator=coord.url, **FAST_RECONNECT)
        session = CoordinatorSession(node, st, Identity.load_or_create(root / f"{cache_aware}-{i}"))
        tasks.append(asyncio.create_task(session.run(stop)))
        nodes.append(node)
    while len(coord.sessions) < 2:
        await asyncio.sleep(0.05)
    rng = random.Random(args.seed)
    # Each conversation's own system prompt, or (--shared-system) its tenant's: an app's agents share theirs.
    systems = {t: system_prompt(t, args.system_words, rng) for t in range(3)} if args.shared_system else {}
    history = {k: [{"role": "system", "content": systems.get(k % 3) or system_prompt(k, args.system_words, rng)}]
               for k in range(args.conversations)}
    previous: dict[int, int] = {}
    reusable = reused = 0
    ttfts = []
    for turn in range(args.turns):
        for k in range(args.conversations):
            messages = history[k] + [{"role": "user", "content": f"Question {turn} of conversation {k}: "
                                      + " ".join(rng.choice(WORDS) for _ in range(12))}]
            job_id = f"{'aware' if cache_aware else 'load'}-{k}-{turn}"
            req = pb.JobRequest(job_id=job_id, model="m", max_tokens=args.max_tokens, cache_scope=f"tenant-{k % 3}",
                                sampling=pb.SamplingParams(temperature=0),
                                chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]))
            dispatch_routed(coord, req)
            done = (await coord.outcome(job_id)).job_done
            ttfts.append((turn, done.telemetry.ttft_ms))
            if k in previous:
                reusable += min(previous[k], done.usage.prompt_tokens - 1)
                reused += min(done.usage.cached_prompt_tokens, previous[k])
            previous[k] = done.usage.prompt_tokens + done.usage.completion_tokens
            history[k] = messages + [{"role": "assistant", "content": coord.text(job_id)}]
            await asyncio.sleep(0.25)  # a heartbeat or two: what the node holds reaches the coordinator
    stop.set()
    await asyncio.gather(*tasks)
    for node in nodes:
        await node.stop()
    await coord.kill()
    return {"reused": reused / max(reusable, 1), "ttft_ms": statistics.mean(t for _, t in ttfts),
            "later_ttft_ms": statistics.mean(t for turn, t in ttfts if turn > 0), "reusable": reusable,
            "quarantines": coord.router.quarantines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--shared-system", action="store_true",
                    help="one system prompt per tenant (3 tenants), not one per conversation")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "llama-kv-heavy"
        factory.make_llama_kv_heavy(model)
        rows = {name: asyncio.run(campaign(model, aware, args, root)) for name, aware in
                (("cache-aware", True), ("load-only", False))}
    for name, r in rows.items():
        print(f"{name:<12} reusable prompt tokens reused {r['reused']:6.1%} (of {r['reusable']}), mean TTFT "
              f"{r['ttft_ms']:7.1f} ms (turns after the first: {r['later_ttft_ms']:7.1f} ms), quarantines "
              f"{r['quarantines']}")
    aware, load = rows["cache-aware"], rows["load-only"]
    print(f"cache-aware / load-only mean TTFT: x{aware['ttft_ms'] / load['ttft_ms']:.2f} over every turn (the first "
          f"turns, cold under either, included), x{aware['later_ttft_ms'] / load['later_ttft_ms']:.2f} over the "
          f"turns that can reuse (goal <= 0.5); reuse {aware['reused']:.1%} (goal >= 90%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
