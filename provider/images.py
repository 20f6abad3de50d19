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

from .content import ImageInput
from .types import Cause, JobError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 32_000_000  # width x height of one decoded image (an 8k x 4k photo)
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
class VisionPrompt:
    """A prepared job's images, in prompt order; the prompt holds `soft_tokens` image tokens for each."""

    images: tuple[PreparedImage, ...]
    image_token_id: int


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


class ImageProcessor:
    """A model's image processor and image tokens, read from its checkpoint files."""

    def __init__(self, path: Path, config: dict, tokenizer: Any):
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

        settings = _processor_settings(path)
        self._processor = Gemma4ImageProcessor(**settings)
        self.default_budget = self._processor.max_soft_tokens
        self.image_token_id = config["image_token_id"]
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.boi = tokenizer.convert_ids_to_tokens(config["boi_token_id"])
        self.eoi = tokenizer.convert_ids_to_tokens(config["eoi_token_id"])

    def prepare(self, image: ImageInput) -> PreparedImage:
        budget = budget_for(image.detail, self.default_budget)
        data, counts = self._processor.preprocess([decode(image)], max_soft_tokens=budget)
        return PreparedImage(data["pixel_values"][0], int(counts[0]))

    def expand(self, text: str, images: list[PreparedImage]) -> str:
        """Each image placeholder the template wrote becomes boi + n image tokens + eoi, as the processor
        does; the count must match the images (a client's text holding the placeholder would not)."""
        found = text.count(self.image_token)
        if found != len(images):
            raise JobError(Cause.INVALID_REQUEST, f"the rendered prompt holds {found} image placeholders for "
                                                  f"{len(images)} images: remove {self.image_token!r} from "
                                                  "the text", "messages")
        parts = iter(f"{self.boi}{self.image_token * image.soft_tokens}{self.eoi}" for image in images)
        return re.sub(re.escape(self.image_token), lambda _: next(parts), text)


def budget_for(detail: str, default: int) -> int:
    """The soft-token budget an image's `detail` asks for: the supported budget nearest the scaled default."""
    want = default * DETAIL_SCALE.get(detail, 1.0)
    return min(SOFT_TOKEN_BUDGETS, key=lambda b: (abs(b - want), b))


def _processor_settings(path: Path) -> dict:
    """The image processor's settings: processor_config.json's image_processor, else
    preprocessor_config.json (both shapes are published)."""
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        f = path / name
        if f.is_file():
            data = json.loads(f.read_text())
            data = data.get(key, {}) if key else data
            if data:
                return {k: v for k, v in data.items() if k in _SETTINGS}
    return {}


_SETTINGS = ("do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
             "do_convert_rgb", "patch_size", "max_soft_tokens", "pooling_kernel_size")
