"""The forger of docs/verification.md's threat model: it holds the real weights, so it can compute an honest
commitment for any token string by one forward of its own over prompt + tokens. Tests and campaigns use it to
show that only the verifier's token and claim checks stand between such a claim and a pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from provider.engine.kv_quant import caches_for
from provider.proofs.commitment import CommitmentBuilder
from provider.proofs.hidden_tap import install, top_entries


def forged_commitment(lm, prompt, tokens) -> bytes:
    """The commitment an honest node would make had `lm` produced `tokens` (the output, then any end token claimed)
    after `prompt`: each token's top entries of the hidden state at the position before it."""
    tap = install(lm.model)
    lm.model(mx.array(list(prompt) + list(tokens))[None], cache=caches_for(lm))
    first = len(prompt) - 1  # the position whose forward gives output token 0
    indices, bits = top_entries(tap.last[0, first:first + len(tokens)])
    builder = CommitmentBuilder(tap.hidden_size)
    builder.add(np.array(indices), np.array(bits))
    return builder.finish(len(tokens))
