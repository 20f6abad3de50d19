"""A job's images and videos between its prompt and the vision tower: prepared once off the engine thread for
their shape (soft tokens, frames) and bytes, and prepared again only when the job is admitted.

Why late (docs/memory.md, "Media"): a high-detail image becomes up to 28.7 MiB of float32 pixels on a real
Gemma 4 (1,120 soft tokens), so a queue of `max_queued_jobs` (256) jobs of 16 images each would hold 115 GiB
while it waits, none of it booked; preparing an image costs 2-90 ms on this CPU, against a 2.5 s time to first
token for one 280-token image. A queued job holds its encoded files; the pixels exist from admission, booked
(`nbytes`) until the tower has read each one.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, replace
from typing import Any, Callable

from .content import ImageInput, VideoInput
from .images import ImageProcessor, PreparedImage, PreparedVideo, VisionPrompt
from .types import Cause, JobError

Submit = Callable[..., concurrent.futures.Future]  # an executor's submit: the prompt workers'


def media_bytes(item: PreparedImage | PreparedVideo) -> int:
    """The bytes a prepared image's or video's arrays hold (the whole buffer a view keeps alive)."""
    arrays = (item.pixels,) if isinstance(item, PreparedImage) else (item.patches, item.positions)
    return sum(_held(a) for a in arrays if a is not None)


def _held(a: Any) -> int:
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return int(getattr(a, "nbytes", 0))


def _bare(item: PreparedImage | PreparedVideo) -> PreparedImage | PreparedVideo:
    """Its shape without its arrays: what the prompt's text needs (soft tokens, frame times)."""
    if isinstance(item, PreparedImage):
        return replace(item, pixels=None)
    return replace(item, patches=None, positions=None)


def _same_shape(a: PreparedImage | PreparedVideo, b: PreparedImage | PreparedVideo) -> bool:
    if isinstance(a, PreparedImage):
        return isinstance(b, PreparedImage) and a.soft_tokens == b.soft_tokens
    return isinstance(b, PreparedVideo) and (a.tokens_per_frame, a.timestamps) == (b.tokens_per_frame, b.timestamps)


@dataclass(frozen=True)
class MediaPlan:
    """A prepared job's media: their shape (a VisionPrompt without arrays), the bytes each item's arrays will
    hold (images first, then videos: `shape.encodes()` order), and how to make them again (`load`)."""

    shape: VisionPrompt
    item_bytes: tuple[int, ...]
    _processor: ImageProcessor
    _sources: tuple[ImageInput | VideoInput, ...]
    _submit: Submit

    @property
    def nbytes(self) -> int:
        return sum(self.item_bytes)

    def encodes(self) -> list[tuple[int, int]]:
        return self.shape.encodes()

    def items(self) -> list[tuple[int, PreparedImage | PreparedVideo]]:
        """(media token id, bare item) of each item, in `item_bytes` order."""
        s = self.shape
        return [(s.image_token_id, i) for i in s.images] + [(s.video_token_id, v) for v in s.videos]

    def load(self) -> list[concurrent.futures.Future]:
        """Each item prepared again on the prompt workers, in order: futures of PreparedImage / PreparedVideo."""
        return [self._submit(_again, self._processor, source, bare)
                for source, (_, bare) in zip(self._sources, self.items())]


def _again(processor: ImageProcessor, source: ImageInput | VideoInput, bare) -> PreparedImage | PreparedVideo:
    item = processor.prepare(source) if isinstance(source, ImageInput) else processor.prepare_video(source)
    if not _same_shape(bare, item):  # the prompt was built for the first preparation's soft tokens
        raise JobError(Cause.INTERNAL, "an image prepared again differs from its first preparation")
    return item


def plan_media(processor: ImageProcessor, images: tuple[ImageInput, ...], videos: tuple[VideoInput, ...],
               submit: Submit) -> MediaPlan:
    """Prepare each item once, one at a time (a worker holds one item's pixels at most), keeping its shape and
    bytes; raises the JobError that refuses a hostile one."""
    bare, sizes = [], []
    for source in (*images, *videos):
        item = processor.prepare(source) if isinstance(source, ImageInput) else processor.prepare_video(source)
        sizes.append(media_bytes(item))
        bare.append(_bare(item))
        del item
    n = len(images)
    shape = VisionPrompt(tuple(bare[:n]), processor.image_token_id, tuple(bare[n:]), processor.video_token_id)
    return MediaPlan(shape, tuple(sizes), processor, (*images, *videos), submit)
