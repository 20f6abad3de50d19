"""The memory ledger against what MLX really holds, in this process (`mx.get_active_memory()`), on the fixture
factory's KV-heavy Llama (8 KiB of KV per token, so KV dominates).

Each test measures MLX's active memory as a difference from before the node existed, so what other tests in
the same worker hold does not count; the bound is the ledger's own target: at most 10 % + 16 MiB over.
"""

from __future__ import annotations

import asyncio
import gc

import mlx.core as mx

from provider.jobs import Done, Job
from tests.helpers import collect, greedy, make_node, run

MiB = 1 << 20
WORDS = "cache batch token prompt model stream window prefix memory budget node server request reply".split()


def _prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words)) + f" {i}"


def _active() -> int:
    gc.collect()
    return mx.get_active_memory()


def _within(active: int, ledger: int) -> bool:
    return active <= ledger * 1.10 + 16 * MiB


def test_prefix_entries_hold_only_their_own_bytes(fixtures_dir):
    base = _active()
    node = make_node({"m": fixtures_dir / "llama-kv-heavy"}, max_concurrent_jobs=8, prefix_cache_gb=1.0)

    async def main():
        ends = await asyncio.gather(*(collect(node, Job(f"j{i}", "m", greedy(32), prompt=_prompt(i, 300 + 13 * i)))
                                      for i in range(8)))
        assert all(isinstance(end, Done) for _, _, end, _ in ends)
        st = node.status()
        held, weights, prefix = _active() - base, st.models[0].measured_weight_bytes, st.memory.prefix_cache_bytes
        assert st.memory.jobs_kv_bytes == 0 and prefix > 0
        # Idle: MLX holds the weights and the prefix entries, and no more (an entry that is a slice of its
        # batch's buffers keeps the whole buffer: here about 40 MiB more).
        assert _within(held, weights + prefix), (held / MiB, weights / MiB, prefix / MiB)
        await node.stop()

    run(main())
