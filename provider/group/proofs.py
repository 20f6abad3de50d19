"""Whether rank 0 of a group can commit to the model's hidden states (docs/verification.md), and refusing when not.

A commitment is made from the final norm's output on the rank that samples the tokens (provider.verification.
hidden_tap). In a group, rank 0 samples; whether its norm sees the model's real final hidden state depends on the
split (mlx-lm 0.32):

- tensor: each layer's projections are split, and every layer ends in an all-sum ("sharded-to-all"), so every
  rank holds the whole residual stream, and the norm's input, after every layer;
- pipeline: `PipelineMixin.pipeline` gives rank 0 the *last* layers (rank r runs the layers after those of ranks
  r+1 .. size-1), and each family's forward all-gathers rank 0's output to every rank before the norm.

So rank 0's tap holds the real state in both, and no step needs to carry hidden states between ranks (measured:
the group's commitments equal a single node's bit for bit, tests/test_group_verify.py). What holds it there is
mlx-lm's convention, not this node's code: should a version put the last layers on another rank, rank 0's norm
would read a state its own layers never finished, so rank 0 then refuses to commit (no proof at all, rather than
a proof of something the model did not compute).
"""

from __future__ import annotations

from .. import logs
from ..memory.estimate import text_config
from ..models.loader import LoadedModel

log = logs.get("group")


def why_not_committing(lm: LoadedModel) -> str | None:
    """Why rank 0's final norm does not see the model's final hidden state (its commitments would be false), or
    None when it does."""
    inner = getattr(getattr(lm.model, "language_model", lm.model), "model", None)
    size = getattr(inner, "pipeline_size", 1)
    if size <= 1:  # not split by layers: a tensor split replicates the residual stream on every rank
        return None
    layers = text_config(lm.config).get("num_hidden_layers")
    rank, end = getattr(inner, "pipeline_rank", None), getattr(inner, "end_idx", None)
    if rank != 0 or type(layers) is not int or end != layers:
        return (f"split by layers, rank 0 runs layers up to {end} of {layers} (pipeline rank {rank}): the final "
                "hidden state is made on another rank")
    return None


def refuse_false_commitments(lm: LoadedModel) -> None:
    """Drop rank 0's hidden-state tap when it would not hold the final state: the engine then makes no commitment
    (Running.start commits only with a tap), and every outcome goes without a proof."""
    if lm.hidden_tap is None:
        return
    why = why_not_committing(lm)
    if why is not None:
        log.warning("group_commitments_refused", model=lm.id, reason=why)
        lm.hidden_tap = None
