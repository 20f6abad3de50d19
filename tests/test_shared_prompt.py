"""n choices read their prompt once (issue 22): the first choice (`Job.share_prompt`) keeps its prompt's KV as
soon as it is read, plain or speculating, and a choice started after that takes all of it but the last token
from the prefix cache, giving the same tokens."""

import pytest

from provider.jobs import Job, SamplingParams
from provider.outputs import Done, Tokens
from tests.helpers import collect, make_node, run

PROMPT = "The provider node serves models to the network and keeps a cache of recent prompts " * 3


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_the_first_choice_shares_its_prompt_once_read(fixtures_dir, speculation):
    drafters = {"m": fixtures_dir / "llama-tiny-draft"} if speculation == "on" else {}
    node = make_node({"m": fixtures_dir / "llama-tiny"}, speculation=speculation, prefix_cache_gb=0.5,
                     manager_kw={"drafters": drafters})
    params = SamplingParams(max_tokens=12, temperature=0.0)

    async def main():
        first = Job(id="c0", model="m", prompt=PROMPT, sampling=params, share_prompt=True)
        events = []
        async with node.run(first) as stream:
            async for ev in stream:
                events.append(ev)
                if isinstance(ev, Tokens) and len(events) == 2:  # its prompt is read: start the next choice
                    other = await collect(node, Job(id="c1", model="m", prompt=PROMPT, sampling=params))
        await node.stop()
        return events, other

    events, (ids, _, end, _) = run(main())
    done = events[-1]
    assert isinstance(done, Done) and isinstance(end, Done)
    assert end.usage.cached_prompt_tokens == done.usage.prompt_tokens - 1
    assert ids == [t for e in events if isinstance(e, Tokens) for t in e.token_ids]  # greedy: the same choice
    if speculation == "on":
        assert done.telemetry.speculation.mode != "off" and end.telemetry.speculation.mode != "off"
