"""What a model's batches will hold in KV, worst case, from the rows they run: pure arithmetic over plain
numbers (each row's final length: prompt + max_tokens), so admission can reserve what the batch becomes, not
what each job would need alone.

The layouts are mlx-lm's:
- a plain batch (BatchKVCache, BatchRotatingKVCache) aligns every row to the longest one (left padding), and
  a buffer that fills grows 256 positions past where it filled, not to a multiple of 256: a prompt read in
  124-token chunks fills at 1,499 and holds 1,755 (measured in tools/bench/memory_ledger.py's phase b), so a
  row that reaches n tokens holds up to n + 255: rows x that, for the longest row;
- a speculating row owns per-sequence caches (KVCache, grown in the same steps), and each round merges the
  rows into one padded copy for the forward (rows x the longest), which lives as long as the round;
- a draft model keeps the same two per row, in its own (smaller) KV shape; an MTP assistant reads the
  target's K/V and keeps none.
A sliding-window layer holds at most its window, whatever the length; a hybrid's recurrent layer (Gated
DeltaNet) holds one state per row, whatever the length (KVShape.bytes_per_row, inside bytes_for).
"""

from __future__ import annotations

from .estimate import ActivationShape, KVShape

STEP = 256  # mlx-lm's KVCache and BatchKVCache grow their buffers by this many positions


def held(tokens: int) -> int:
    """The longest buffer mlx-lm's caches hold for a row that reaches `tokens`: the last growth starts below
    `tokens` and adds whole steps past it."""
    return max(tokens, 1) + STEP - 1


def prefill_transient_bytes(prompts: list[int], act: ActivationShape, chunk: int, rows_at_once: int) -> int:
    """Scratch of reading the longest prompts still being read, `rows_at_once` of them in one forward
    (mlx-lm's prompt batch), a chunk each, attending to a whole prompt: the batch's peak beyond its KV."""
    if not prompts:
        return 0
    reading = sorted(prompts)[-rows_at_once:]
    return act.prefill_bytes(len(reading), min(chunk, max(reading)), max(reading))


def plain_batch_bytes(finals: list[int], kv: KVShape) -> int:
    """A batched generator's caches when every row has reached its final length."""
    if not finals:
        return 0
    return len(finals) * kv.bytes_for(held(max(finals)))


def spec_batch_bytes(finals: list[int], kv: KVShape, draft: KVShape | None = None) -> int:
    """Speculating rows: each row's own caches, and the merged copy a round makes of all of them (one row
    needs no merge); the same again in the draft model's shape when a draft model drafts. A hybrid's recurrent
    layers are not updated in place as K/V is: the verify writes each row's state anew while the state before it
    is kept to rewind rejected drafts (engine.recurrent.Rewind), so a round holds one more state per row (measured
    in memory_ledger's phase m: 9 rows' 14.8 MiB of state, all of MLX's excess over the books without it)."""
    if not finals:
        return 0
    total = 0
    for shape in (kv, draft):
        if shape is None:
            continue
        total += sum(shape.bytes_for(held(f)) for f in finals) + len(finals) * shape.bytes_per_row
        if len(finals) > 1:
            total += len(finals) * shape.bytes_for(held(max(finals)))
    return total
