"""Images into pixels, off the engine thread: decoded frames (decode.py, bounded) turned into what the
checkpoint's vision tower reads with the checkpoint's own processor (mlx-vlm's Gemma 4 image processor). What a
job's media become (float32, images scaled up or down to fill their budget, as the processor does) is counted from
the headers against MAX_MEDIA_BYTES before any is decoded.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..content import ImageInput, VideoInput
from .decode import BICUBIC, MAX_SOURCE_FRAMES, decode, open_image, refused, video_frames
from ..types import Cause, JobError

# One request's media as the model reads them (float32 pixels and patches, counted from the headers before any
# is decoded): eight images at the largest budget (1120 soft tokens: 29.5 MiB each) or four full videos
# (32 frames at 70 soft tokens: 59 MiB each).
MAX_MEDIA_BYTES = 256 << 20
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # Gemma 4's per-image budgets
# "detail": low is a quarter of the checkpoint's default budget, high four times it (Gemma 4's default of 280
# gives 70 and 1120, its least and most), auto the default itself.
DETAIL_SCALE = {"low": 0.25, "auto": 1.0, "high": 4.0}


def _held(a: Any) -> int:
    """The bytes an array keeps alive: a view's whole buffer (the processor's outputs are views of a batch)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return int(getattr(a, "nbytes", 0))


@dataclass(frozen=True)
class PreparedImage:
    """One image as the tower reads it: channel-first float pixels [3, H, W], and its soft tokens."""

    pixels: Any  # numpy float32 array
    soft_tokens: int

    @property
    def nbytes(self) -> int:
        """The bytes the prepared pixels hold until the tower has read them."""
        return _held(self.pixels)


@dataclass(frozen=True)
class PreparedVideo:
    """One video as the tower reads it: each sampled frame's patches and their positions (padded), the soft
    tokens a frame gives, and each frame's time in seconds."""

    patches: Any  # numpy float32 [frames, max_patches, patch_dim]
    positions: Any  # numpy int [frames, max_patches, 2]; -1 marks padding
    tokens_per_frame: int
    timestamps: tuple[float, ...]

    @property
    def soft_tokens(self) -> int:
        return self.tokens_per_frame * len(self.timestamps)

    @property
    def nbytes(self) -> int:
        """The bytes the prepared patches and positions hold until the tower has read them."""
        return _held(self.patches) + _held(self.positions)


@dataclass(frozen=True)
class VisionPrompt:
    """A prepared job's images and videos, each in prompt order; the prompt holds an image's `soft_tokens`
    image tokens for each image and a video's for each video."""

    images: tuple[PreparedImage, ...]
    image_token_id: int
    videos: tuple[PreparedVideo, ...] = ()
    video_token_id: int | None = None

    def encodes(self) -> list[tuple[int, int]]:
        """(soft tokens of one frame or image, how many the tower reads at once) for each tower call."""
        return [(i.soft_tokens, 1) for i in self.images] + [(v.tokens_per_frame, len(v.timestamps))
                                                             for v in self.videos]

    @property
    def nbytes(self) -> int:
        """The bytes all of the job's prepared media hold."""
        return sum(m.nbytes for m in (*self.images, *self.videos))


class ImageProcessor:
    """A model's image and video processors and its media tokens, read from its checkpoint files."""

    def __init__(self, path: Path, config: dict, tokenizer: Any, max_media_bytes: int = MAX_MEDIA_BYTES):
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4VideoProcessor

        settings = _processor_settings(path)
        self._processor = Gemma4ImageProcessor(**settings)
        self._video = Gemma4VideoProcessor(**_processor_settings(path, "video_processor", _VIDEO_SETTINGS))
        self.video_token_id = config.get("video_token_id")
        self.video_token = tokenizer.convert_ids_to_tokens(self.video_token_id) if self.video_token_id is not None \
            else None
        self.default_budget = self._processor.max_soft_tokens
        self.image_token_id = config["image_token_id"]
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.boi = tokenizer.convert_ids_to_tokens(config["boi_token_id"])
        self.eoi = tokenizer.convert_ids_to_tokens(config["eoi_token_id"])
        self.max_media_bytes = max_media_bytes

    def _fit(self, width: int, height: int, soft_tokens: int) -> tuple[int, int]:
        """(width, height) the processor resizes a width x height image to for a budget: aspect kept, the
        largest within the budget's patches (up or down), by mlx-vlm's own rule."""
        from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        p = self._processor
        h, w = get_aspect_ratio_preserving_size(height, width, p.patch_size, soft_tokens * p.pooling_kernel_size ** 2,
                                                p.pooling_kernel_size)
        return w, h

    def image_bytes(self, image: ImageInput) -> int:
        """The bytes `prepare(image)` will hold (float32 [3, H, W]), from the file's header alone."""
        img = open_image(image.data, image.where)
        w, h = self._fit(*img.size, budget_for(image.detail, self.default_budget))
        return 3 * w * h * 4

    def video_bytes(self, video: VideoInput) -> int:
        """The bytes `prepare_video(video)` will hold at most: every sampled frame's patches, padded to the
        budget's, and their positions (a frame count the header does not tell is counted at the cap)."""
        v = self._video
        patches = v.max_soft_tokens * v.pooling_kernel_size ** 2
        frames = min(len(video.files) if len(video.files) > 1 else MAX_SOURCE_FRAMES, v.num_frames)
        return frames * patches * (v.patch_size ** 2 * 3 * 4 + 2 * 8)

    def check_media(self, images: tuple[ImageInput, ...], videos: tuple[VideoInput, ...] = ()) -> tuple[int, ...]:
        """The bytes each of a job's images and videos will hold once prepared (images first), counted from the
        files' headers before any pixel is decoded; a 4xx naming the part that takes the job past
        `max_media_bytes`. Call it before preparing any of them."""
        total, sizes = 0, []
        for item in (*images, *videos):
            sizes.append(self.image_bytes(item) if isinstance(item, ImageInput) else self.video_bytes(item))
            total += sizes[-1]
            if total > self.max_media_bytes:
                raise self._over(item.where, total)
        return tuple(sizes)

    def _over(self, where: str, total: int) -> JobError:
        return refused(where, f"brings this request's media to {total / 2**20:.1f} MiB of pixels as the model "
                              f"reads them (float32), more than the at most {self.max_media_bytes / 2**20:.0f} MiB "
                              "taken; send fewer images or frames, or a lower detail")

    def prepare(self, image: ImageInput) -> PreparedImage:
        budget = budget_for(image.detail, self.default_budget)
        img = decode(image)
        size = self._fit(*img.size, budget)
        if img.size != size:  # resized here, in Pillow, as the processor would: it then has nothing to resize
            img = img.resize(size, resample=BICUBIC())
        data, counts = self._processor.preprocess([img], max_soft_tokens=budget)
        return PreparedImage(data["pixel_values"][0], int(counts[0]))

    def prepare_video(self, video: VideoInput) -> PreparedVideo:
        if self.video_token is None:
            raise JobError(Cause.INVALID_REQUEST, "this model's config names no video token", video.where)
        v = self._video
        frames, fps = video_frames(video, v.num_frames, lambda w, h: _fit_video(v, w, h))
        import numpy as np

        clip = np.stack([np.asarray(f).transpose(2, 0, 1) for f in frames])  # each already at the processor's size
        del frames
        out = self._video([clip], fps=[fps])
        return PreparedVideo(out["pixel_values_videos"][0], out["video_position_ids"][0],
                             int(out["num_soft_tokens_per_frame"][0]), tuple(out["frame_timestamps"][0]))

    def expand(self, text: str, images: list[PreparedImage], videos: list[PreparedVideo] = ()) -> str:
        """Each image placeholder the template wrote becomes boi + n image tokens + eoi, and each video's a
        timestamped run of those per frame, as mlx-vlm's processor does; the counts must match the media (a
        client's text holding a placeholder would not)."""
        for token, items, kind in ((self.image_token, images, "image"), (self.video_token, videos, "video")):
            found = text.count(token) if token else 0
            if found != len(items):
                raise JobError(Cause.INVALID_REQUEST, f"the rendered prompt holds {found} {kind} placeholders for "
                                                      f"{len(items)} {kind}s: remove {token!r} from the text",
                               "messages")
        parts = iter(f"{self.boi}{self.image_token * image.soft_tokens}{self.eoi}" for image in images)
        text = re.sub(re.escape(self.image_token), lambda _: next(parts), text)
        if videos:
            runs = iter(" ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {self.boi}"
                                 f"{self.video_token * v.tokens_per_frame}{self.eoi}" for t in v.timestamps)
                        for v in videos)
            text = re.sub(re.escape(self.video_token), lambda _: next(runs), text)
        return text


def _fit_video(v: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) the video processor resizes a frame to (its own rule, in `_resize_frames`)."""
    from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    h, w = get_aspect_ratio_preserving_size(height, width, v.patch_size,
                                            v.max_soft_tokens * v.pooling_kernel_size ** 2, v.pooling_kernel_size)
    return w, h


def budget_for(detail: str, default: int) -> int:
    """The soft-token budget an image's `detail` asks for: the supported budget nearest the scaled default."""
    want = default * DETAIL_SCALE.get(detail, 1.0)
    return min(SOFT_TOKEN_BUDGETS, key=lambda b: (abs(b - want), b))


def _processor_settings(path: Path, key: str = "image_processor", known: tuple = ()) -> dict:
    """A processor's settings: processor_config.json's `key`, else (images) preprocessor_config.json (both
    shapes are published)."""
    known = known or _SETTINGS
    names = (("processor_config.json", key), ("preprocessor_config.json", None)) if key == "image_processor" \
        else (("processor_config.json", key), ("video_preprocessor_config.json", None))
    for name, part in names:
        f = path / name
        if f.is_file():
            data = json.loads(f.read_text())
            data = data.get(part, {}) if part else data
            if data:
                return {k: v for k, v in data.items() if k in known}
    return {}


_VIDEO_SETTINGS = ("patch_size", "max_soft_tokens", "pooling_kernel_size", "num_frames", "do_resize", "do_rescale",
                   "rescale_factor", "do_normalize", "image_mean", "image_std", "default_fps")
_SETTINGS = ("do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
             "do_convert_rgb", "patch_size", "max_soft_tokens", "pooling_kernel_size")
