"""What a model's batches hold, as memory.batch_kv computes it: pure arithmetic, checked against the layouts."""

from provider.memory.batch_kv import STEP, padded, plain_batch_bytes, prefill_transient_bytes, spec_batch_bytes
from provider.memory.estimate import ActivationShape, KVShape

FULL = KVShape(bytes_per_token_full=100, bytes_per_token_sliding=0, sliding_window=None)
SLIDING = KVShape(bytes_per_token_full=100, bytes_per_token_sliding=10, sliding_window=64)


def test_a_plain_batch_is_every_row_padded_to_the_longest_in_whole_steps():
    assert padded(1) == padded(STEP) == STEP and padded(STEP + 1) == 2 * STEP
    # One 16k chat beside 15 short jobs: 16 rows of 16k, not 16k + 15 short ones.
    assert plain_batch_bytes([16_384] + [100] * 15, FULL) == 16 * 16_384 * 100
    assert plain_batch_bytes([], FULL) == 0
    # Sliding layers hold their window, whatever the length.
    assert plain_batch_bytes([1000, 10], SLIDING) == 2 * (1024 * 100 + 64 * 10)


def test_speculating_rows_own_their_caches_and_a_round_merges_a_padded_copy():
    assert spec_batch_bytes([300], FULL) == 512 * 100  # one row: no merge
    assert spec_batch_bytes([300, 20], FULL) == (512 + 256) * 100 + 2 * 512 * 100
    draft = KVShape(10, 0, None)
    assert spec_batch_bytes([300, 20], FULL, draft) == (512 + 256) * 110 + 2 * 512 * 110


def test_reading_prompts_cost_their_chunk_against_the_longest():
    act = ActivationShape(per_token=8, per_score=2, per_row=1000)
    assert prefill_transient_bytes([], act, 512, 8) == 0
    # The 2 longest of 3 are read together, a 512 chunk each, attending to 2,000 positions.
    assert prefill_transient_bytes([100, 2000, 1500], act, 512, 2) == 2 * (512 * 8 + 512 * 2000 * 2 + 1000)
    assert prefill_transient_bytes([100], act, 512, 8) == 100 * 8 + 100 * 100 * 2 + 1000
