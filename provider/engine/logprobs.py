"""Log-probabilities a job asked for, taken from the forwards the engine runs anyway.

Values are the model's own log-softmax over its logits, before any sampling transform (temperature, top-p,
top-k, min-p), penalty, logit bias or grammar mask: what vLLM returns by default, and what a harness that
scores text wants. Generated tokens take them from the decode forward (a plain row's, or the target's
verify forward in a speculative round: an accepted draft's logprob is the target's); prompt tokens from
the prefill's own logits, chunk by chunk (`PromptScorer`).

Everything here is lazy MLX until the caller's one read-back; `read` turns the arrays into `TokenLogprob`s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

from ..outputs import TokenLogprob
from .prompt_reader import SCORE_SCRATCH_BYTES, PromptReader

SCORE_BYTES_PER_LOGIT = 16  # a scored position's logits, their float32 log-softmax and top-k indices


def score_chunk(chunk: int, n_vocab: int) -> int:
    """Prompt positions one scoring forward may read: `chunk`, fewer where the vocabulary is large."""
    return max(1, min(chunk, SCORE_SCRATCH_BYTES // max(1, n_vocab * SCORE_BYTES_PER_LOGIT)))


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def pick(logprobs: mx.array, tokens: mx.array, top: int, limit: int | None = None) -> tuple:
    """For each row of `logprobs` [n, V]: the logprob of its token, and the `top` best (ids, values), best
    first, over the ids below `limit` (those the detokenizer can decode). Lazy."""
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    if top <= 0:
        return chosen, None, None
    logprobs = logprobs[..., :limit]
    if top == 1:
        ids = mx.argmax(logprobs, axis=-1, keepdims=True)
    else:
        part = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        order = mx.argsort(-mx.take_along_axis(logprobs, part, axis=-1), axis=-1)
        ids = mx.take_along_axis(part, order, axis=-1)
    return chosen, ids, mx.take_along_axis(logprobs, ids, axis=-1)


class TokenTexts:
    """Each token's text and exact bytes (a byte-level piece of a multi-byte character is its own bytes, not
    U+FFFD), from the detokenizer mlx-lm chose for the tokenizer."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._det = tokenizer._detokenizer
        self.bytes_of = lru_cache(maxsize=1 << 16)(self._bytes_of)

    def _bytes_of(self, token: int) -> bytes:
        det = self._det
        try:
            if isinstance(det, SPMStreamingDetokenizer):
                return det.tokenmap[token].replace(det._sep, b" ")
            if isinstance(det, BPEStreamingDetokenizer):
                decoder = _byte_decoder()
                return b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in det.tokenmap[token])
        except IndexError:  # an id past the tokenizer (a padded vocabulary): no text
            return b""
        return self._tok.decode([token]).encode()

    def text(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", "replace")

    def scored(self, token: int, logprob: float | None, top: tuple = ()) -> TokenLogprob:
        return TokenLogprob(token, self.text(token), logprob, top, self.bytes_of(token))


_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def texts_for(tokenizer) -> TokenTexts:
    """One TokenTexts per tokenizer (engine thread only), so its cache outlives any one batch."""
    texts = _texts.get(tokenizer)
    if texts is None:
        texts = _texts[tokenizer] = TokenTexts(tokenizer)
    return texts


@dataclass(frozen=True)
class LogprobRequest:
    """What a row reports: `top` alternatives per token, over the ids below `limit`."""

    top: int
    texts: TokenTexts
    limit: int | None

    @classmethod
    def of(cls, output, lm) -> "LogprobRequest | None":
        """The request of a job's output on a loaded model, or None when its job asked for no logprobs."""
        params = output.job.sampling
        if params.logprobs is None:
            return None
        return cls(params.top_logprobs, texts_for(lm.tokenizer), lm.decodable)


def read(tokens: list[int], picked: tuple, texts: TokenTexts) -> list[TokenLogprob]:
    """`pick`'s arrays, evaluated, as one TokenLogprob per token."""
    chosen, ids, values = picked
    chosen = chosen.tolist()
    ids = ids.tolist() if ids is not None else [[] for _ in tokens]
    values = values.tolist() if values is not None else [[] for _ in tokens]
    return [texts.scored(t, lp, tuple((i, texts.text(i), v, texts.bytes_of(i)) for i, v in zip(row_ids, row_values)))
            for t, lp, row_ids, row_values in zip(tokens, chosen, ids, values)]


class PromptScorer:
    """Reads a prompt through the model by the one prompt reader (provider.engine.prompt_reader) into fresh
    caches, keeping each position's logprob of the next prompt token (and its `top` alternatives): the logits
    the prefill computes anyway, a chunk's at most what fits SCORE_SCRATCH_BYTES. The first prompt token has
    none. Once `done`, its caches hold every prompt token but the last, as a prefix-cache hit's would, so the
    row decodes on from there."""

    def __init__(self, model, prompt: list[int], top: int, texts: TokenTexts, limit: int | None = None,
                 n_vocab: int = 0, cache: list | None = None):
        from mlx_lm.models.cache import make_prompt_cache

        self.prompt = prompt
        self.n_vocab = n_vocab  # the logits' width: it bounds a chunk (score_chunk)
        # `cache`: fresh caches of the model's KV precision (kv_quant.caches_for); mlx-lm's by default
        self.reader = PromptReader(prompt, cache if cache is not None else make_prompt_cache(model), self._forward,
                                   most=score_chunk(len(prompt), n_vocab))
        self.logprobs = [texts.scored(prompt[0], None)]  # nothing before it scores it
        self._model, self._top, self._texts, self._limit = model, top, texts, limit
        self._picked: tuple = ()

    @property
    def cache(self) -> list:
        return self.reader.cache

    @property
    def read(self) -> int:
        """Prompt tokens in the caches."""
        return self.reader.read

    @property
    def done(self) -> bool:
        return self.reader.done

    def step(self, chunk: int) -> None:
        """Read up to `chunk` more tokens (all but the prompt's last), fewer if their logits would not fit."""
        start, end = self.reader.step(chunk)
        if end > start:
            self.logprobs += read(self.prompt[start + 1:end + 1], self._picked, self._texts)
            self._picked = ()

    def _forward(self, start: int, end: int) -> list:
        logits = self._model(mx.array(self.prompt[start:end])[None], cache=self.cache)[0]
        following = mx.array(self.prompt[start + 1:end + 1])
        self._picked = pick(log_softmax(logits), following, self._top, self._limit)
        return [a for a in self._picked if a is not None]
