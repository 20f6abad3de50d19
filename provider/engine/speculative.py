"""Speculative decoding rounds: draft k tokens, verify k+1 positions in one target forward, keep the accepted
prefix plus one token from the target, roll every target cache back exactly.

Lossless for greedy and sampled jobs alike (`acceptance`: greedy matching, or speculative sampling). Greedy:
the target's argmax is computed exactly as mlx-lm's plain path computes it (log-softmax, then argmax), and
on this CPU backend a row of a width-(k+1) forward equals the width-1 row bit for bit. The host reads
values back once per round.

mlx-lm's own speculative loop is not used: `trim_prompt_cache` silently trims nothing from a
RotatingKVCache once the context passes the sliding window, so Gemma 4 diverges there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..models.gemma4_assistant import QUERY_POSITION_OFFSET, Gemma4Assistant
from ..speculation import SpecMode
from ..telemetry import SpecTelemetry, decision_dict
from .acceptance import GREEDY, GreedyChoice


@dataclass
class SpecStats:
    mode: str
    k: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0  # the prefill forward counts
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    scheme: str = GREEDY
    choice: Any = None  # auto's speculation.KChoice, when auto chose k
    judged: int = 0  # drafts the target ruled on (a round stops at its first rejection): accepted / judged
    # Sampled rounds, over the drafts judged: the sum of Σ min(p, q) (this scheme's acceptance probability)
    # and of Σ p·q (what sample-and-compare, mlx-lm's scheme, would accept there).
    min_overlap: float = 0.0
    dot_overlap: float = 0.0

    def telemetry(self) -> SpecTelemetry:
        return SpecTelemetry(
            mode=SpecMode(self.mode), reason="ok", k=self.k, sampling_scheme=self.scheme, rounds=self.rounds,
            drafted=self.drafted,
            accepted=self.accepted, acceptance_rate=round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            target_forwards=self.target_forwards,
            tokens_per_target_forward=round(self.emitted / self.target_forwards, 4) if self.target_forwards else 0.0,
            draft_ms=round(self.draft_s * 1000, 3), verify_ms=round(self.verify_s * 1000, 3),
            decision=decision_dict(self.choice))


def rollback(caches: list, n: int) -> None:
    """Drop the last `n` positions from every cache, sliding-window (rotating) caches included."""
    if n <= 0:
        return
    for c in caches:
        c.trim(n)  # KVCache and RotatingKVCache both move offset back; is_trimmable() is too strict here
        if isinstance(c, RotatingKVCache) and c.keys is not None:
            # A verify step leaves the buffer in temporal order; cut the stale tail now, or the next
            # width-1 update trims live entries from the front and writes over the wrong slot.
            c.keys = c.keys[..., : c._idx, :]
            c.values = c.values[..., : c._idx, :]


class Target:
    """The target model seen by the round loop: logits, and for Gemma 4 its final-norm hidden and K/V."""

    def __init__(self, model):
        self.model = model
        lm = getattr(model, "language_model", model)
        self.gemma4 = lm.__class__.__module__.endswith("gemma4_text")
        self.lm = lm
        if self.gemma4:
            from mlx_lm.models.gemma4_text import logit_softcap

            self._softcap = logit_softcap
            args = lm.args
            first_shared = args.num_hidden_layers - args.num_kv_shared_layers
            types = args.layer_types[:first_shared]
            # The drafter reads the last non-shared layer of each attention type.
            self.kv_layer = {t: max(i for i, x in enumerate(types) if x == t) for t in set(types)}
            self.window = args.sliding_window
            self.hidden_size = args.hidden_size

    def forward(self, tokens: mx.array, caches: list) -> tuple[mx.array, mx.array | None]:
        """tokens [1, L] -> (logits [1, L, V], final-norm hidden [1, L, H] or None)."""
        if not self.gemma4:
            return self.model(tokens, cache=caches), None
        text = self.lm.model
        hidden = text(tokens, cache=caches)
        logits = text.embed_tokens.as_linear(hidden) if self.lm.tie_word_embeddings else self.lm.lm_head(hidden)
        if self.lm.final_logit_softcapping is not None:
            logits = self._softcap(self.lm.final_logit_softcapping, logits)
        return logits, hidden

    def scaled_embedding(self, tokens: mx.array) -> mx.array:
        text = self.lm.model
        return text.embed_tokens(tokens) * text.embed_scale

    def shared_kv(self, caches: list) -> dict[str, tuple[mx.array, mx.array]]:
        """Committed K/V of the last sliding and last full layer (sliding: the last `window` rows)."""
        out = {}
        for kind, i in self.kv_layer.items():
            c = caches[i]
            if isinstance(c, RotatingKVCache):
                k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
                n = min(c.offset, k.shape[2], self.window)
                out[kind] = (k[..., k.shape[2] - n:, :], v[..., v.shape[2] - n:, :])
            else:
                out[kind] = (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
        return out


class DraftModelDrafter:
    """A smaller LM with the target's vocabulary and its own trimmable caches."""

    mode = "draft"

    def __init__(self, model):
        self.model = model
        self.cache = make_prompt_cache(model)
        self._pending: list[int] = []  # tokens accepted but not yet in the draft cache

    def start(self, prompt: list[int], first: int, prefill_step: int) -> None:
        prefill(self.model, self.cache, prompt[:-1], prefill_step)
        self._pending = [prompt[-1], first]

    def propose(self, k: int, choice, **_) -> tuple[mx.array, list]:
        x = mx.array(self._pending)
        drafted, qs = [], []
        for _ in range(k):
            x, q = choice.draft(self.model(x[None], cache=self.cache)[:, -1, :])
            drafted.append(x)
            qs.append(q)
        return mx.concatenate(drafted), qs

    def accepted(self, n: int, k: int, drafts: list[int], bonus: int) -> None:
        # The cache took the pending tokens and drafts d1..d(k-1).
        if n == k:
            self._pending = [drafts[-1], bonus]
        else:
            rollback(self.cache, (k - 1) - n)
            self._pending = [bonus]


class MTPDrafter:
    """The Gemma 4 assistant: reads the target's committed K/V and last hidden state."""

    mode = "mtp"

    def __init__(self, assistant: Gemma4Assistant, target: Target):
        self.assistant = assistant
        self.target = target

    def start(self, prompt: list[int], first: int, prefill_step: int) -> None:
        pass

    def propose(self, k: int, choice, *, last: mx.array, hidden: mx.array, caches: list,
                committed: int) -> tuple[mx.array, list]:
        kv = self.target.shared_kv(caches)
        position = committed + QUERY_POSITION_OFFSET  # held for the whole round
        token, h, drafted, qs = last, hidden, [], []
        for _ in range(k):
            logits, h = self.assistant.step(self.target.scaled_embedding(token)[None], h, kv, position)
            token, q = choice.draft(logits[:, -1, :])
            drafted.append(token)
            qs.append(q)
        return mx.concatenate(drafted), qs

    def accepted(self, n: int, k: int, drafts: list[int], bonus: int) -> None:
        pass


def drafter_for(lm):
    """A fresh drafter for a loaded pair (`models.loader.LoadedModel`): its own caches, one per job."""
    if lm.drafter_mode == SpecMode.MTP:
        return MTPDrafter(lm.drafter, Target(lm.model))
    return DraftModelDrafter(lm.drafter)


def prefill(model, cache: list, tokens: list[int], step: int) -> None:
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def speculative_tokens(model, prompt: list[int], drafter, *, k: int, stats: SpecStats,
                       prefill_step: int = 2048, choice=None) -> Iterator[int]:
    """Tokens for `prompt`, k drafts verified per target forward: identical to plain greedy decoding, or
    distributed exactly as plain sampling, as `choice` says (greedy when None)."""
    choice = choice or GreedyChoice()
    stats.scheme = choice.scheme
    target = Target(model)
    caches = make_prompt_cache(model)
    # Prefill leaves the last prompt token for a width-1 step, as mlx-lm does.
    prefill(model, caches, prompt[:-1], prefill_step)
    logits, hidden = target.forward(mx.array(prompt[-1:])[None], caches)
    last = choice.first(logits[:, -1, :])
    first = last.item()
    stats.target_forwards += 1
    stats.emitted += 1
    committed = len(prompt)  # K/V rows the target holds for accepted tokens
    hidden = hidden[:, -1:, :] if hidden is not None else None
    drafter.start(prompt, first, prefill_step)
    yield first
    while True:
        t0 = time.perf_counter()
        drafts, qs = drafter.propose(k, choice, last=last, hidden=hidden, caches=caches, committed=committed)
        mx.eval(drafts, qs)  # materialized here so the draft views into the caches are released before verify
        t1 = time.perf_counter()
        logits, hidden_all = target.forward(mx.concatenate([last, drafts])[None], caches)
        accepted, after, extras = choice.verify(logits[0], drafts, qs)
        mx.eval(accepted, after, extras)  # the round's one read-back
        n, bonus, drafted = accepted.item(), after.item(), drafts.tolist()
        rollback(caches, k - n)
        committed += n + 1
        drafter.accepted(n, k, drafted, bonus)
        last = after
        judged = min(n + 1, k)  # the drafts judged this round: up to and including the first rejection
        stats.judged += judged
        if extras:
            stats.min_overlap += sum(extras["min_overlap"].tolist()[:judged])
            stats.dot_overlap += sum(extras["dot_overlap"].tolist()[:judged])
        hidden = hidden_all[:, n:n + 1, :] if hidden_all is not None else None
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        stats.target_forwards += 1
        stats.emitted += n + 1
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        yield from drafted[:n]
        yield bonus
