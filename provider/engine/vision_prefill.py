"""A prompt with images read into mlx-lm caches: the images through the checkpoint's vision tower, their
features in place of the image tokens' embeddings, the text model over those embeddings.

What comes out is what a prefix-cache hit gives: caches holding every prompt token but the last. The row then
joins the batch (plain or speculating) as after a hit, and its last token's forward gives the first token
and, for MTP, the target's hidden state at the last prompt position, so the assistant sees the image through
the target's K/V like any other prompt token.

mlx-vlm's Gemma 4 does the same with its own copy of the language model: its scaled embeddings with the
features scattered in. mlx-lm's text model scales what it is given, so the features go in divided by that
scale, and the per-layer inputs are the text tokens' with image positions as token 0, as mlx-vlm computes them.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..images import VisionPrompt
from ..models.loader import LoadedModel
from ..types import Cause, JobError


def read_with_images(lm: LoadedModel, prompt: list[int], vision: VisionPrompt, cache: list | None, cached: int,
                     chunk: int, keep_at: int = 0, keep: Callable[[list], None] | None = None) -> list:
    """Caches holding prompt[:-1] (the first `cached` tokens already in `cache`, a text prefix's), read in
    forwards of at most `chunk` tokens; `keep` is given the caches once they hold the first `keep_at` tokens
    (a system prompt's, kept for other chats), when that is text read here."""
    if lm.vision is None:
        raise JobError(Cause.INVALID_REQUEST, f"model {lm.id} cannot read images: its vision tower is not loaded",
                       "messages")
    text = lm.model.language_model.model  # mlx-lm's Gemma4TextModel: hidden states, no logits
    ids = mx.array(prompt[:-1])[None]
    embeds = text.embed_tokens(ids)
    media = ids == vision.image_token_id
    first = len(prompt)
    # One image (or one video's frames) through the tower at a time: bounded scratch.
    for token, features in ((vision.image_token_id, [lm.vision.encode(i.pixels) for i in vision.images]),
                            (vision.video_token_id, [lm.vision.encode_frames(v.patches, v.positions)
                                                     for v in vision.videos])):
        if not features:
            continue
        features = mx.concatenate(features, axis=0) if len(features) > 1 else features[0]
        positions = [i for i, t in enumerate(prompt[:-1]) if t == token]
        if len(positions) != features.shape[0]:  # mlx-vlm's masked_scatter would wrap silently
            raise JobError(Cause.INTERNAL, f"{len(positions)} media tokens for {features.shape[0]} features")
        embeds[0, mx.array(positions)] = (features / text.embed_scale).astype(embeds.dtype)
        media = media | (ids == token)
        first = min(first, positions[0])
    if first < cached:
        raise JobError(Cause.INTERNAL, "a cached prefix reaches into an image")
    per_layer = None
    if text.hidden_size_per_layer_input:  # mlx-vlm's: image and video positions read as token 0
        per_layer = text._get_per_layer_inputs(mx.where(media, 0, ids))
    if cache is None:
        cache = make_prompt_cache(lm.model)
    end = len(prompt) - 1
    keep_at = keep_at if keep is not None and cached < keep_at <= first else 0
    bounds = sorted({*range(cached, end, max(1, chunk)), end} | ({keep_at} if keep_at else set()))
    for start, stop in zip(bounds, bounds[1:]):
        text(None, cache=cache, input_embeddings=embeds[:, start:stop],
             per_layer_inputs=None if per_layer is None else per_layer[:, start:stop])
        mx.eval([c.state for c in cache])
        if stop == keep_at:
            keep(cache)
    return cache
