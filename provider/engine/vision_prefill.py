"""Prompts with images or video, read into mlx-lm caches a piece per engine pass, beside the batches.

Each piece is one image (or one video's frames) through the checkpoint's vision tower, or one chunk of the
prompt through the text model with the tower's features in place of the media tokens' embeddings, read by the
one prompt reader (provider.engine.prompt_reader: its chunk rule, beside the model's decoding rows). One piece a
pass keeps the other streams going while an image is read, as chunked prefill does for long text prompts.

What comes out is what a prefix-cache hit gives: caches holding every prompt token but the last. The row then
joins its batch (plain or speculating) as after a hit, and its last token's forward gives the first token and,
for MTP, the target's hidden state at the last prompt position, so the assistant sees the image through the
target's K/V like any other prompt token.

mlx-vlm's Gemma 4 does the same with its own copy of the language model: its scaled embeddings with the
features scattered in. mlx-lm's text model scales what it is given, so the features go in divided by that
scale, and the per-layer inputs are the text tokens' with media positions as token 0, as mlx-vlm computes them.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import mlx.core as mx

from ..media.plan import MediaPlan
from ..memory.estimate import media_read_bytes, vision_scratch_bytes
from ..models.loader import LoadedModel
from ..types import Cause, JobError
from .kv_quant import caches_for
from .prompt_reader import PromptReader

PIXELS_WAIT_S = 0.05  # with nothing else to run, the engine waits this long at most for an item's pixels


class MediaRead:
    """One job's prompt being read, images and all. `joining` holds what its batch needs once it is read.

    Its media are prepared again from here (MediaPlan.load, on the prompt workers) and each is read by the tower
    once ready. What it holds beside its KV is booked from its start until it is read (`held_bytes`): each
    item's prepared arrays until the tower has read it, the prompt's embeddings; and, while an item is left to
    encode, the tower's scratch for the largest of them (`scratch_bytes`)."""

    def __init__(self, lm: LoadedModel, output, sink, prompt: list[int], media: MediaPlan, cache: list | None,
                 cached: int, *, keep_at: int = 0, keep: Callable[[list], None] | None = None, joining: dict):
        if lm.vision is None:
            raise JobError(Cause.INVALID_REQUEST, f"model {lm.id} cannot read images: its vision tower is not "
                                                  "loaded", "messages")
        first = next(i for i, t in enumerate(prompt) if t in (media.shape.image_token_id, media.shape.video_token_id))
        if first < cached:
            raise JobError(Cause.INTERNAL, "a cached prefix reaches into an image")
        self.lm, self.output, self.sink, self.prompt, self.joining = lm, output, sink, prompt, joining
        keep_at = keep_at if keep is not None and cached < keep_at <= first else 0
        self._reader = PromptReader(prompt, cache if cache is not None else caches_for(lm),
                                    self._forward, read=cached, pause_at=keep_at, on_pause=keep)
        self._text = lm.model.language_model.model  # mlx-lm's Gemma4TextModel: hidden states, no logits
        self._ids = mx.array(prompt[:-1])[None]
        self._embedded = media_read_bytes(lm.config, len(prompt))
        self._features: dict[int, list[mx.array]] = {}
        self._embeds: Any = None
        self._per_layer: Any = None
        # (media token, bytes its arrays hold, the tower's scratch for it, its pixels) for each item left to read
        self._todo = [(token, size, vision_scratch_bytes(lm.config, n) * at_once, future) for (token, _), size,
                      (n, at_once), future in zip(media.items(), media.item_bytes, media.encodes(), media.load())]

    @property
    def held_bytes(self) -> int:
        """Booked beside its KV: the arrays of the items the tower has not read, and the prompt's embeddings."""
        return sum(size for _, size, _, _ in self._todo) + self._embedded

    @property
    def scratch_bytes(self) -> int:
        """The tower's scratch for the largest item left to encode (one encode at a time); 0 once all are read."""
        return max((scratch for _, _, scratch, _ in self._todo), default=0)

    @property
    def waiting(self) -> concurrent.futures.Future | None:
        """The next item's pixels when they are still being prepared."""
        if self._todo and not self._todo[0][3].done():
            return self._todo[0][3]
        return None

    def close(self) -> None:
        """Ended before it was read: items not yet prepared are not prepared."""
        for *_, f in self._todo:
            f.cancel()
        self._todo = []

    @property
    def cache(self) -> list:
        return self._reader.cache

    @property
    def read(self) -> int:
        """Prompt tokens in the caches."""
        return self._reader.read

    @property
    def done(self) -> bool:
        return self._reader.done

    def advance(self, budget: int, decoding: int = 0) -> None:
        """One piece: the next image or video through the tower (once prepared), else a chunk of the prompt, by
        the one chunk rule for a `budget`-token step beside `decoding` rows."""
        if self._todo:
            if self.waiting is not None:
                return
            token, _, _, future = self._todo[0]
            item = future.result()  # a JobError raised while preparing it fails this job alone
            features = lm_encode(self.lm, item)
            mx.eval(features)
            del item
            # The encode's scratch (up to gigabytes) would stay in MLX's buffer pool, held by the process but in
            # no ledger, once its booking ends: give it back now (re-allocating it costs ~1 % of an encode).
            mx.clear_cache()
            self._todo.pop(0)  # its arrays and its scratch are gone: booked no more
            self._features.setdefault(token, []).append(features)
            return
        if self._embeds is None:
            self._embed()
        self._reader.step(self._reader.chunk(budget, decoding))

    def _forward(self, start: int, end: int) -> None:
        self._text(None, cache=self.cache, input_embeddings=self._embeds[:, start:end],
                   per_layer_inputs=None if self._per_layer is None else self._per_layer[:, start:end])

    def _embed(self) -> None:
        text, ids = self._text, self._ids
        embeds = text.embed_tokens(ids)
        media = mx.zeros(ids.shape, dtype=mx.bool_)
        for token, parts in self._features.items():
            features = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            positions = [i for i, t in enumerate(self.prompt[:-1]) if t == token]
            if len(positions) != features.shape[0]:  # mlx-vlm's masked_scatter would wrap silently
                raise JobError(Cause.INTERNAL, f"{len(positions)} media tokens for {features.shape[0]} features")
            embeds[0, mx.array(positions)] = (features / text.embed_scale).astype(embeds.dtype)
            media = media | (ids == token)
        self._features.clear()
        self._embeds = embeds
        if text.hidden_size_per_layer_input:  # mlx-vlm's: image and video positions read as token 0
            self._per_layer = text._get_per_layer_inputs(mx.where(media, 0, ids))


def lm_encode(lm: LoadedModel, item) -> mx.array:
    if hasattr(item, "pixels"):
        return lm.vision.encode(item.pixels)
    return lm.vision.encode_frames(item.patches, item.positions)


class MediaReads:
    """The prompts with media being read, first come first served, one piece per engine pass."""

    def __init__(self):
        self._reads: dict[str, MediaRead] = {}
        self._faults: list[tuple[MediaRead, BaseException]] = []

    def __len__(self) -> int:
        return len(self._reads)

    def job_ids(self) -> list[str]:
        return list(self._reads)

    def rows(self, model_id: str | None = None) -> list[MediaRead]:
        return [r for r in self._reads.values() if model_id is None or r.lm.id == model_id]

    def add(self, read: MediaRead) -> None:
        self._reads[read.output.job.id] = read

    def step(self, budget: int, idle: bool = False, decoding: Callable[[str], int] = lambda model_id: 0
             ) -> list[MediaRead]:
        """Advance the first read by one piece, in a `budget`-token step beside `decoding(model id)` rows; the
        reads now done (out of this set, for their batches). `idle`: nothing else runs this pass, so a read
        whose pixels are still being prepared is waited for a moment rather than the engine spinning."""
        if not self._reads:
            return []
        job_id, read = next(iter(self._reads.items()))
        waiting = read.waiting
        if waiting is not None and idle:
            concurrent.futures.wait([waiting], timeout=PIXELS_WAIT_S)
        try:
            read.advance(budget, decoding(read.lm.id))
        except Exception as e:  # this job's images or prompt fail it alone
            del self._reads[job_id]
            read.close()
            self._faults.append((read, e))
            return []
        if read.done:
            del self._reads[job_id]
            return [read]
        return []

    def faults(self) -> list[tuple[MediaRead, BaseException]]:
        out, self._faults = self._faults, []
        return out

    def cancel(self, job_id: str) -> MediaRead | None:
        read = self._reads.pop(job_id, None)
        if read is not None:
            read.close()
        return read

    def close(self) -> list[MediaRead]:
        out = list(self._reads.values())
        for read in out:
            read.close()
        self._reads.clear()
        return out
