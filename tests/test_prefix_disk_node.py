"""The disk tier through the node: a long prompt's KV outlives the process and is read back (telemetry says
which tier), the output the same as computed; never across tenant scopes; never for a job that may not be
written (a sealed one)."""

import pytest

from provider.engine.prefix_cache import DISK_MIN_TOKENS
from provider.jobs import Job, PrefixScope
from provider.outputs import Done
from tests.helpers import collect, greedy, run
from tools.harness.nodes import make_node

PROMPT = [(i * 13) % 400 + 20 for i in range(700)]


def node_on(fixtures_dir, name, disk):
    node = make_node({name: fixtures_dir / name}, max_concurrent_jobs=2, prefix_disk_dir=str(disk),
                     prefix_disk_gb=1.0)
    assert node.prefix_disk.scanned.wait(30)  # what a restart finds is indexed off the start's path
    return node


@pytest.mark.parametrize("name", ["llama-tiny", "gemma4-tiny"])  # cut to any prefix; sliding-window layers
def test_a_long_prompt_outlives_the_process_and_reads_back_the_same(fixtures_dir, tmp_path, name):
    async def once(job_id, scope=PrefixScope()):
        node = node_on(fixtures_dir, name, tmp_path)
        try:
            ids, _, end, _ = await collect(node, Job(job_id, name, greedy(8), prompt_ids=tuple(PROMPT),
                                                     prefix_scope=scope))
        finally:
            await node.stop()
        assert isinstance(end, Done)
        return ids, end.telemetry

    async def main():
        cold_ids, cold = await once("cold")
        assert cold.prefix_tier == "" and cold.cached_prompt_tokens == 0
        assert list(tmp_path.glob("*.pxkv"))  # written before the node stopped
        warm_ids, warm = await once("warm")  # another process, as after a restart
        assert warm.prefix_tier == "disk" and warm.cached_prompt_tokens >= 512
        assert warm_ids == cold_ids
        other_ids, other = await once("other", PrefixScope("tenant-b"))  # the same prompt, another tenant
        assert other.prefix_tier == "" and other.cached_prompt_tokens == 0 and other_ids == cold_ids

    run(main())


def test_a_sliding_model_keeps_both_its_system_prefix_and_its_whole_prompt(fixtures_dir, tmp_path):
    """Its caches cannot be cut shorter, so the whole prompt is kept for the disk tier; the shared system
    prefix is kept as well, for the next conversation that starts with it (keeping only the whole prompt
    once cost every other conversation its system prefix)."""
    system = "Be brief. " * 64

    def chat(user):
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    async def main():
        node = node_on(fixtures_dir, "gemma4-tiny", tmp_path)
        try:
            ends = [(await collect(node, Job(f"j{i}", "gemma4-tiny", greedy(4), messages=chat(user))))[2]
                    for i, user in enumerate(["Tell me about rivers.", "And mountains?", "Tell me about rivers."])]
        finally:
            await node.stop()
        first, other, again = ends
        assert first.telemetry.cached_prompt_tokens == 0 and first.usage.prompt_tokens > DISK_MIN_TOKENS
        # Another conversation: its system prefix (all but a few tokens of the prompt) from memory.
        assert other.telemetry.prefix_tier == "memory"
        assert other.usage.prompt_tokens - 24 <= other.telemetry.cached_prompt_tokens < other.usage.prompt_tokens - 4
        assert again.telemetry.cached_prompt_tokens == again.usage.prompt_tokens - 1  # the same one: all of it

    run(main())


def test_a_job_that_may_not_be_written_leaves_no_file(fixtures_dir, tmp_path):
    async def main():
        node = node_on(fixtures_dir, "llama-tiny", tmp_path)
        sealed = PrefixScope("tenant-a", to_disk=False)
        await collect(node, Job("s", "llama-tiny", greedy(8), prompt_ids=tuple(PROMPT), prefix_scope=sealed))
        second = (await collect(node, Job("s2", "llama-tiny", greedy(8), prompt_ids=tuple(PROMPT),
                                          prefix_scope=sealed)))[2]
        await node.stop()
        assert second.telemetry.prefix_tier == "memory"  # reused in memory, within its own scope
        assert not list(tmp_path.glob("*.pxkv"))

    run(main())


def test_over_the_wire_scopes_and_sealed_jobs(fixtures_dir, tmp_path):
    from coordinator_client.pb import provider_pb2 as pb
    from tools.harness.nodes import harness

    def request(job_id, scope):
        return pb.JobRequest(job_id=job_id, model="l", prompt_ids=pb.PromptTokens(ids=PROMPT), max_tokens=4,
                             sampling=pb.SamplingParams(temperature=0), cache_scope=scope)

    async def main():
        disk = dict(prefix_disk_dir=str(tmp_path / "disk"), prefix_disk_gb=1.0, prefix_cache_gb=0.0)
        async with harness({"l": fixtures_dir / "llama-tiny"}, tmp_path, **disk) as (coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch_sealed(s, request("sealed", "t1"))
            coord.dispatch(s, request("unscoped", ""))
            for job_id in ("sealed", "unscoped"):
                assert (await coord.outcome(job_id)).WhichOneof("frame") == "job_done"
            assert not list((tmp_path / "disk").glob("*.pxkv"))  # neither may be written
            coord.dispatch(s, request("t1-first", "t1"))
            await coord.outcome("t1-first")
        # The node again, as after a restart (its memory tier off: whatever is reused comes from disk).
        async with harness({"l": fixtures_dir / "llama-tiny"}, tmp_path, **disk) as (coord, node, _):
            s = await coord.wait_for_node()
            coord.dispatch(s, request("t1-again", "t1"))
            coord.dispatch(s, request("t2", "t2"))
            again, other = [(await coord.outcome(j)).job_done for j in ("t1-again", "t2")]
            assert again.telemetry.prefix_tier == "disk" and again.usage.cached_prompt_tokens >= 512
            assert other.telemetry.prefix_tier == "" and other.usage.cached_prompt_tokens == 0
            assert coord.token_ids("t1-again") == coord.token_ids("t2")  # the same tokens either way
            coord.dispatch(s, request("long-scope", "x" * 129))
            assert (await coord.outcome("long-scope")).job_error.cause == pb.ERROR_CAUSE_INVALID_REQUEST

    run(main())
