"""What a model's batches hold, as memory.batch_kv computes it: pure arithmetic, checked against the layouts."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from provider.memory.batch_kv import STEP, held, plain_batch_bytes, prefill_transient_bytes, spec_batch_bytes
from provider.memory.estimate import ActivationShape, KVShape
from tools.harness.isolated import run_isolated

FULL = KVShape(bytes_per_token_full=100, bytes_per_token_sliding=0, sliding_window=None)
SLIDING = KVShape(bytes_per_token_full=100, bytes_per_token_sliding=10, sliding_window=64)


def test_a_plain_batch_is_every_row_padded_to_the_longest_and_its_growth():
    assert held(1) == STEP and held(STEP + 1) == 2 * STEP
    # One 16k chat beside 15 short jobs: 16 rows of 16k, not 16k + 15 short ones.
    assert plain_batch_bytes([16_384] + [100] * 15, FULL) == 16 * held(16_384) * 100
    assert plain_batch_bytes([], FULL) == 0
    # Sliding layers hold their window, whatever the length.
    assert plain_batch_bytes([1000, 10], SLIDING) == 2 * (held(1000) * 100 + 64 * 10)


@pytest.mark.parametrize("chunk", [1, 124, 128, 256, 300, 2048])
def test_held_bounds_mlx_lms_own_buffers_read_in_any_chunks_then_joined_and_decoded(chunk):
    """The bound against mlx-lm's caches themselves: a 1,500-token prompt read in chunks, joined to a batch
    of short rows (the join right-aligns every row to the longest), then decoded to its end."""
    def grow(cache, rows: int, tokens: int, step: int) -> int:
        longest = 0
        for start in range(0, tokens, step):
            n = min(step, tokens - start)
            cache.update_and_fetch(mx.zeros((rows, 1, n, 4)), mx.zeros((rows, 1, n, 4)))
            longest = max(longest, cache.keys.shape[2])
        return longest

    alone = KVCache()
    assert grow(alone, 1, 1500, chunk) <= held(1500)
    long = BatchKVCache([0])
    filled = grow(long, 1, 1500, chunk)
    assert filled <= held(1500)
    short = BatchKVCache([0] * 15)
    grow(short, 15, 40, 40)
    short.extend(long)  # the long row joins 15 short ones: every row as long as the longest buffer
    assert short.keys.shape[0] == 16 and short.keys.shape[2] <= held(1500)
    assert grow(short, 16, 16, 1) <= held(1500 + 16)  # its 16 tokens decoded beside them
    if chunk == 124:  # grows a step past where it fills: more than 1,500 rounded up to a whole step
        assert filled > -(-1500 // STEP) * STEP


def _join_peak() -> dict:
    """A 1,500-token row joins 15 short ones; the joined batch's size from its lazy shapes, and MLX's peak over
    the step that evaluates it (run in a process of its own: the figures are process-wide)."""
    short, long = BatchKVCache([0] * 15), BatchKVCache([0])
    for cache, rows, tokens in ((short, 15, 40), (long, 1, 1500)):
        for start in range(0, tokens, 124):
            n = min(124, tokens - start)
            cache.update_and_fetch(mx.zeros((rows, 8, n, 32)), mx.zeros((rows, 8, n, 32)))
        mx.eval(cache.keys, cache.values)
    short.extend(long)
    del long
    joined = short.nbytes  # from the shapes, before anything is evaluated
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(short.keys, short.values)
    return {"joined": joined, "padded": short.keys.shape[2], "held": mx.get_peak_memory() - before}


def test_a_join_holds_a_second_copy_of_the_batch_for_the_step_that_makes_it():
    """Why PlainBatch.copying books a copy: mlx-lm's join pads every row to the longest and concatenates, and
    MLX holds both while it runs. Its size is known from the lazy caches' shapes before they are evaluated."""
    m = run_isolated(_join_peak)
    assert m["joined"] == 2 * 16 * m["padded"] * 8 * 32 * 4
    assert m["held"] >= 1.8 * m["joined"], m  # the padded rows and the joined batch, both held


def test_speculating_rows_own_their_caches_and_a_round_merges_a_padded_copy():
    assert spec_batch_bytes([300], FULL) == held(300) * 100  # one row: no merge
    assert spec_batch_bytes([300, 20], FULL) == (held(300) + held(20)) * 100 + 2 * held(300) * 100
    draft = KVShape(10, 0, None)
    assert spec_batch_bytes([300, 20], FULL, draft) == (held(300) + held(20)) * 110 + 2 * held(300) * 110


def test_reading_prompts_cost_their_chunk_against_the_longest():
    act = ActivationShape(per_token=8, per_score=2, per_row=1000)
    assert prefill_transient_bytes([], act, 512, 8) == 0
    # The 2 longest of 3 are read together, a 512 chunk each, attending to 2,000 positions.
    assert prefill_transient_bytes([100, 2000, 1500], act, 512, 2) == 2 * (512 * 8 + 512 * 2000 * 2 + 1000)
    assert prefill_transient_bytes([100], act, 512, 8) == 100 * 8 + 100 * 100 * 2 + 1000
