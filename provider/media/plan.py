"""A job's images and videos between its prompt and the vision tower: prepared once off the engine thread for
their shape (soft tokens, frames) and bytes, and prepared again only when the job is admitted.

Why late (docs/memory.md, "Media"): a high-detail image becomes up to 28.7 MiB of float32 pixels on a real
Gemma 4 (1,120 soft tokens), so a queue of `max_queued_jobs` (256) jobs of 16 images each would hold 115 GiB
while it waits, none of it booked; preparing an image costs 2-90 ms on this CPU, against a 2.5 s time to first
token for one 280-token image. A queued job holds its encoded files; the pixels exist from admission, booked
(`nbytes`) until the tower has read each one. The first preparation decodes each image (every check an
image gets) but computes its soft tokens and bytes by the processor's resize rule, without making its pixels.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, replace
from typing import Callable

from ..content import ImageInput, VideoInput
from .images import ImageProcessor, PreparedImage, PreparedVideo, VisionPrompt, budget_for
from .decode import decode
from ..types import Cause, JobError

Submit = Callable[..., concurrent.futures.Future]  # an executor's submit: the prompt workers'


def media_bytes(item: PreparedImage | PreparedVideo) -> int:
    """The bytes a prepared image's or video's arrays hold (the whole buffer a view keeps alive)."""
    return item.nbytes


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
        return [self._submit(_again, self._processor, source, bare, size)
                for source, (_, bare), size in zip(self._sources, self.items(), self.item_bytes)]


def _again(processor: ImageProcessor, source: ImageInput | VideoInput, bare, planned: int):
    item = processor.prepare(source) if isinstance(source, ImageInput) else processor.prepare_video(source)
    # The prompt was built for the first preparation's soft tokens, and the job booked `planned` bytes for it.
    if not _same_shape(bare, item) or item.nbytes > planned:
        raise JobError(Cause.INTERNAL, "an image prepared again differs from its first preparation")
    return item


def _sized_image(processor: ImageProcessor, source: ImageInput) -> tuple[PreparedImage, int]:
    """An image's soft tokens and the bytes its float32 pixels will take, by the processor's own resize rule, from
    the decoded image's size: decoded for every check an image gets (a corrupt one is refused now, not once it is
    admitted), but never made into float32 pixels here."""
    img = decode(source)
    budget = budget_for(source.detail, processor.default_budget)
    width, height = processor._fit(*img.size, budget)
    del img
    # prepare resizes to that size, then the processor fits the result again (a long thin image moves once more)
    width, height = processor._fit(width, height, budget)
    p = processor._processor
    soft = (height // p.patch_size) * (width // p.patch_size) // p.pooling_kernel_size ** 2
    return PreparedImage(None, soft), 3 * width * height * 4


def plan_media(processor: ImageProcessor, images: tuple[ImageInput, ...], videos: tuple[VideoInput, ...],
               submit: Submit) -> MediaPlan:
    """Each item's shape and bytes, one at a time (a worker holds one item's decoded pixels at most); raises the
    JobError that refuses a hostile one, or a request whose media as the model reads them exceed the bound (from
    the headers, before anything is decoded)."""
    processor.check_media(images, videos)
    bare, sizes = [], []
    for source in images:
        item, size = _sized_image(processor, source)
        bare.append(item)
        sizes.append(size)
    for source in videos:  # a video's soft tokens and frame times need its frames: prepared once, then dropped
        item = processor.prepare_video(source)
        sizes.append(item.nbytes)
        bare.append(_bare(item))
        del item
    n = len(images)
    shape = VisionPrompt(tuple(bare[:n]), processor.image_token_id, tuple(bare[n:]), processor.video_token_id)
    return MediaPlan(shape, tuple(sizes), processor, (*images, *videos), submit)
