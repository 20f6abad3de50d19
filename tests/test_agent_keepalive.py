"""Issue 58: a streamed agent answer says it is alive while a long prompt is read. Claude Code drops a stream idle for
300 s and Codex after its stream_idle_timeout_ms (300 s by default), then send the whole request again; reading an
agent's 25k-token prompt on a 2-core CPU takes longer than that. `kept_alive` yields None after each quiet interval,
and the routes write Anthropic's `ping` or the Responses API's `response.in_progress` again."""

import asyncio

from provider.local.agent_edge import KEEPALIVE_S, kept_alive
from provider.local.responses_output import ResponseEvents


async def _slow(delays, closed):
    try:
        for i, d in enumerate(delays):
            await asyncio.sleep(d)
            yield [f"batch {i}"], None
    finally:
        closed.append(True)


def test_quiet_intervals_become_keepalives_and_every_event_still_arrives_in_order():
    async def run():
        closed = []
        got = [item async for item in kept_alive(_slow([0.0, 0.35, 0.0, 0.25], closed), every=0.1)]
        return got, closed

    got, closed = asyncio.run(run())
    events = [g for g in got if g is not None]
    assert events == [([f"batch {i}"], None) for i in range(4)]
    assert got[0] is not None and got.count(None) >= 4  # 0.35 s and 0.25 s of quiet: at least 3 + 2 keepalives
    assert closed == [True]


def test_leaving_early_stops_the_pending_read():
    async def run():
        closed = []
        stream = kept_alive(_slow([0.0, 30.0], closed), every=0.05)
        first = await anext(stream)
        second = await anext(stream)  # the read of the next event is pending
        await stream.aclose()
        await asyncio.sleep(0)
        return first, second, closed

    first, second, closed = asyncio.run(asyncio.wait_for(run(), 10))
    assert first == (["batch 0"], None) and second is None and closed == [True]


def test_the_responses_keepalive_is_the_response_in_progress_again_in_sequence():
    from provider.local.agent_edge import EdgeNotes

    out = ResponseEvents("resp_x", "m", 0, {}, EdgeNotes("openai_responses"))
    start = out.start()
    again = out.still()
    assert [e["type"] for e in start + again] == ["response.created", "response.in_progress", "response.in_progress"]
    assert [e["sequence_number"] for e in start + again] == [0, 1, 2]
    assert again[0]["response"]["status"] == "in_progress"
    assert KEEPALIVE_S < 300 / 4  # several keepalives inside the agents' idle limit
