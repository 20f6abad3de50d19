"""What a claim is checked against, derived from its request alone (docs/verification.md, "What the verifier
believes"). Pure functions over plain data: no model, no MLX.

A forger may hold the real weights and commit honestly to any token string, so the commitment cannot tell who
chose the tokens: only the token checks can, and they must not take the producer's word for which check runs.
The request decides:

- a greedy request: every token the argmax;
- a request with a seed: every token the seeded draw with exactly that seed (coupled speculation draws the same);
- a sampled request without one: what the proof declares (`replayable` with the seed the node drew, or
  `speculative`, checked for plausibility only). The network seeds every sampled job, so this is a local case.

A declaration that contradicts the request fails the claim at position 0. So does a length the request did not
allow, and an ending nobody can see the reason for.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jobs import SamplingParams
from ..outputs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER, Proof


@dataclass(frozen=True)
class TokenCheck:
    """How every token of a claim is judged: `sampler` (greedy / replayable / speculative) and, replayable, `seed`."""

    sampler: str
    seed: int | None = None


@dataclass(frozen=True)
class Failure:
    position: int  # the output position the claim fails at
    reason: str


def token_check(sampling: SamplingParams, proof: Proof) -> TokenCheck | Failure:
    """The check the request calls for, or why the proof's declaration contradicts the request."""
    declared = proof.sampler
    if sampling.greedy:
        if declared != GREEDY_SAMPLER:
            return Failure(0, f"the request is greedy but the proof says its tokens were drawn {declared}")
        return TokenCheck(GREEDY_SAMPLER)
    if declared == GREEDY_SAMPLER:
        return Failure(0, f"the request samples at temperature {sampling.temperature:g} but the proof says greedy")
    if sampling.seed is not None:
        if declared != REPLAYABLE_SAMPLER:
            return Failure(0, f"the request fixes a seed but the proof says its tokens were drawn {declared}")
        if proof.seed != sampling.seed:
            return Failure(0, "the proof names another seed than the request's")
        return TokenCheck(REPLAYABLE_SAMPLER, sampling.seed)
    if declared == REPLAYABLE_SAMPLER:
        return TokenCheck(REPLAYABLE_SAMPLER, proof.seed)
    return TokenCheck(SPECULATIVE_SAMPLER)


def length_failure(output: list[int] | tuple[int, ...], end_token: int | None, limit: int, end_ids: set[int],
                   stop_at: int | None) -> Failure | None:
    """Whether the claim's length and ending are ones its request allows.

    `limit`: the most tokens the request let the node generate (its max_tokens within the model's context; the
    end token counts, as it is generated). `stop_at`: the output position where one of the request's stop
    strings first completes in the output's text, if one does. An honest output ends on an end token, a stop
    string completed by its last token, or its limit; any other ending (cut short, or run on past a stop or an
    end id) fails at the first position the producer could not have emitted."""
    n = len(output)
    inside = next((j for j, t in enumerate(output) if t in end_ids), None)
    if inside is not None:  # an end id ends the output unemitted: nothing follows it
        return Failure(inside, f"output token {inside} is an end id, which would have ended the output there")
    if stop_at is not None and stop_at < n - 1:
        return Failure(stop_at + 1, f"the output goes on past a stop string of the request (completed at token "
                                    f"{stop_at})")
    claimed = n + (end_token is not None)
    if claimed > limit:
        return Failure(limit, f"the claim is {claimed} tokens but the request allowed at most {limit}")
    if end_token is not None:
        if stop_at is not None:  # the stop string ended it at its last token: no end token was drawn after it
            return Failure(n, "an end token is claimed after a stop string that had already ended the output")
        return None
    if stop_at == n - 1 or n == limit:
        return None
    return Failure(n, f"the output ends after {n} of {limit} tokens with no end token and no stop string")
