"""Images into pixels, off the engine thread: decode an image file (Pillow), bounded, and turn it into what the
checkpoint's vision tower reads with the checkpoint's own processor (mlx-vlm's Gemma 4 image processor).

Every image is hostile until decoded: only PNG, JPEG, WebP and GIF decoders are tried (never SVG, EPS or the
rest Pillow knows), the pixel count is checked from the header before a single pixel is decoded (a
decompression bomb costs nothing), a truncated or corrupt file is a 400 naming its part, and an animated file
gives its first frame.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .content import ImageInput, VideoInput
from .types import Cause, JobError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 32_000_000  # width x height of one decoded image (an 8k x 4k photo)
MAX_SOURCE_FRAMES = 10_000  # frames of one animated file
MAX_VIDEO_PIXELS = 400_000_000  # all frames of one animated file: seeking decodes the frames before it
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # Gemma 4's per-image budgets
# "detail": low is a quarter of the checkpoint's default budget, high four times it (Gemma 4's default of 280
# gives 70 and 1120, its least and most), auto the default itself.
DETAIL_SCALE = {"low": 0.25, "auto": 1.0, "high": 4.0}


@dataclass(frozen=True)
class PreparedImage:
    """One image as the tower reads it: channel-first float pixels [3, H, W], and its soft tokens."""

    pixels: Any  # numpy float32 array
    soft_tokens: int


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


def decode(image: ImageInput):
    """The image's first frame as an RGB PIL image, or a 400 that names its part."""
    from PIL import Image, UnidentifiedImageError

    def refused(why: str) -> JobError:
        return JobError(Cause.INVALID_REQUEST, f"{image.where}: {why}", image.where)

    try:
        img = Image.open(io.BytesIO(image.data), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise refused("is not a PNG, JPEG, WebP or GIF image") from None
    except Image.DecompressionBombError:  # Pillow's own bound, far above ours
        raise refused(f"claims more pixels than the at most {MAX_PIXELS:,} pixels taken") from None
    except Exception as e:  # a header Pillow cannot parse
        raise refused(f"cannot be read as an image ({type(e).__name__})") from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > MAX_PIXELS:
        raise refused(f"is {width}x{height} pixels; at most {MAX_PIXELS:,} pixels are taken")
    try:
        img.seek(0)
        img.load()
        return img.convert("RGB")
    except Exception as e:  # truncated data, a corrupt stream, a decoder error
        raise refused(f"is truncated or corrupt ({type(e).__name__}: {str(e)[:80]})") from None


def video_frames(video: VideoInput, cap: int) -> tuple[list, float]:
    """At most `cap` frames sampled evenly from the video, and the rate they were sampled at (frames per
    second of the video's time), so each frame's timestamp is its real time."""
    if len(video.files) > 1:
        picked = _evenly(len(video.files), cap)
        fps = video.fps or 1.0
        frames = [decode(ImageInput(video.files[i], where=f"{video.where}[{i}]")) for i in picked]
        return frames, len(picked) * fps / len(video.files)
    return _animated_frames(video, cap)


def _animated_frames(video: VideoInput, cap: int) -> tuple[list, float]:
    from PIL import Image

    first = decode(ImageInput(video.files[0], where=video.where))  # every check an image gets, on frame 0
    img = Image.open(io.BytesIO(video.files[0]), formats=FORMATS)
    total = getattr(img, "n_frames", 1)
    if total > MAX_SOURCE_FRAMES or total * img.size[0] * img.size[1] > MAX_VIDEO_PIXELS:
        raise JobError(Cause.INVALID_REQUEST, f"{video.where}: {total} frames of {img.size[0]}x{img.size[1]} are "
                                              f"more than the at most {MAX_VIDEO_PIXELS:,} pixels taken", video.where)
    duration_ms = img.info.get("duration") or 0
    fps = video.fps or (1000.0 / duration_ms if duration_ms > 0 else 1.0)
    frames = []
    for i in _evenly(total, cap):
        try:
            img.seek(i)
            frames.append(img.convert("RGB") if i else first)
        except Exception as e:
            raise JobError(Cause.INVALID_REQUEST, f"{video.where}: frame {i} is truncated or corrupt "
                                                  f"({type(e).__name__})", video.where) from None
    return frames, len(frames) * fps / total


def _evenly(total: int, n: int) -> list[int]:
    import numpy as np

    return sorted(set(np.linspace(0, total - 1, num=min(n, total)).round().astype(int).tolist()))


class ImageProcessor:
    """A model's image and video processors and its media tokens, read from its checkpoint files."""

    def __init__(self, path: Path, config: dict, tokenizer: Any):
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

    def prepare(self, image: ImageInput) -> PreparedImage:
        budget = budget_for(image.detail, self.default_budget)
        data, counts = self._processor.preprocess([decode(image)], max_soft_tokens=budget)
        return PreparedImage(data["pixel_values"][0], int(counts[0]))

    def prepare_video(self, video: VideoInput) -> PreparedVideo:
        if self.video_token is None:
            raise JobError(Cause.INVALID_REQUEST, "this model's config names no video token", video.where)
        frames, fps = video_frames(video, self._video.num_frames)
        import numpy as np

        clip = np.stack([np.asarray(f.resize(frames[0].size)).transpose(2, 0, 1) for f in frames])
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
