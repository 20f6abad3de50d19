"""Media files into frames, off the engine thread and bounded before they cost anything (Pillow).

Every file is hostile until decoded: only PNG, JPEG, WebP and GIF decoders are tried (never SVG, EPS or the
rest Pillow knows), the pixel count is checked from the header before a single pixel is decoded (a
decompression bomb costs nothing), a truncated or corrupt file is a 400 naming its part, and an animated file
gives its first frame. A video's frames are read in order with the canvas checked after every seek (a later
GIF frame at a large offset grows it; an MPO's next picture replaces it) and each frame is resized to the
processor's size as soon as it is decoded, so one request holds one full-size frame at a time. What the
frames become for the model is images.py's.
"""
from __future__ import annotations

import functools
import io
import warnings
from typing import Callable

from ..content import ImageInput, VideoInput
from ..types import Cause, JobError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 32_000_000  # width x height of one decoded image (an 8k x 4k photo)
MAX_SOURCE_FRAMES = 10_000  # frames of one animated file
# The canvas of an animated file read as a video: Pillow holds about 9 bytes a canvas pixel while it reads a
# frame (the previous canvas in RGB, the new frame's, and their conversions), 140 MiB at this bound
MAX_FRAME_PIXELS = 16_000_000
MAX_VIDEO_PIXELS = 400_000_000  # canvases decoded while seeking one animated file (each frame before the one asked)

def refused(where: str, why: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, f"{where}: {why}", where)


def _check_size(where: str, size: tuple[int, int], frame: int | None = None, most: int = MAX_PIXELS) -> None:
    """A canvas Pillow is about to fill: at most MAX_PIXELS, checked before the pixels exist (Pillow's own
    MAX_IMAGE_PIXELS is process-wide and only warns below twice itself, so it is never what bounds us)."""
    width, height = size
    if width < 1 or height < 1 or width * height > most:
        at = f" at frame {frame}" if frame is not None else ""
        raise refused(where, f"is {width}x{height} pixels{at}; at most {most:,} pixels are taken")


@functools.cache
def _bound_pillow() -> None:
    """Pillow checks every canvas and GIF disposal buffer it allocates (at open and at each seek) against its
    module-wide MAX_IMAGE_PIXELS, raising only past twice it and warning below: set so it raises past our
    MAX_PIXELS too (nothing else in the node opens image files), and its warnings, for sizes we take, hushed."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_PIXELS // 2
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def open_image(data: bytes, where: str):
    """The file opened (its header read, no pixel decoded) and its canvas checked."""
    from PIL import Image, UnidentifiedImageError

    _bound_pillow()
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise refused(where, "is not a PNG, JPEG, WebP or GIF image") from None
    except Image.DecompressionBombError:  # Pillow's own bound, far above ours
        raise refused(where, f"claims more pixels than the at most {MAX_PIXELS:,} pixels taken") from None
    except Exception as e:  # a header Pillow cannot parse
        raise refused(where, f"cannot be read as an image ({type(e).__name__})") from None
    _check_size(where, img.size)
    return img


def _rgb(img, where: str, frame: int = 0):
    """The decoded frame in RGB: the file's own canvas when it is RGB already (an animated file's is, after its
    first frame), not a second full-size copy of it."""
    try:
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")
    except Exception as e:  # truncated data, a corrupt stream, a decoder error
        at = f"frame {frame} " if frame else ""
        raise refused(where, f"{at}is truncated or corrupt ({type(e).__name__}: {str(e)[:80]})") from None


def decode(image: ImageInput):
    """The image's first frame as an RGB PIL image, or a 400 that names its part."""
    return _rgb(open_image(image.data, image.where), image.where)


def video_frames(video: VideoInput, cap: int, fit: Callable[[int, int], tuple[int, int]] | None = None
                 ) -> tuple[list, float]:
    """At most `cap` frames sampled evenly from the video, and the rate they were sampled at (frames per
    second of the video's time), so each frame's timestamp is its real time. With `fit` ((width, height) of
    the first frame -> the size the processor reads), each frame is resized to that size as soon as it is
    decoded, one at a time: no frame is ever held at another frame's size."""
    size = None

    def fitted(img):
        nonlocal size
        size = size or (fit(*img.size) if fit else img.size)
        # a copy either way: an animated file's canvas changes at its next seek
        return img.copy() if img.size == size else img.resize(size, resample=BICUBIC())

    if len(video.files) > 1:
        picked = _evenly(len(video.files), cap)
        fps = video.fps or 1.0
        frames = [fitted(decode(ImageInput(video.files[i], where=f"{video.where}[{i}]"))) for i in picked]
        return frames, len(picked) * fps / len(video.files)
    return _animated_frames(video, cap, fitted)


def BICUBIC():  # noqa: N802 (a constant of Pillow, imported late)
    from PIL import Image

    return Image.BICUBIC  # the processors' own resampling


def _animated_frames(video: VideoInput, cap: int, fitted: Callable) -> tuple[list, float]:
    """An animated file's frames, read in order: each seek can grow the canvas (a GIF frame at a large offset)
    or change it (an MPO's next picture), so the canvas is checked after every seek, before the frame is
    decoded, and the canvases decoded on the way (seeking decodes every frame before the one asked for) are
    counted."""
    from PIL.Image import DecompressionBombError

    where = video.where
    img = open_image(video.files[0], where)
    try:
        total = getattr(img, "n_frames", 1)
    except Exception as e:
        raise refused(where, f"is truncated or corrupt ({type(e).__name__})") from None
    if total > MAX_SOURCE_FRAMES:
        raise refused(where, f"holds {total:,} frames; at most {MAX_SOURCE_FRAMES:,} are taken")
    if total * img.size[0] * img.size[1] > MAX_VIDEO_PIXELS:  # the canvas only grows: refused before a decode
        raise refused(where, f"{total} frames of {img.size[0]}x{img.size[1]} are more than the at most "
                                f"{MAX_VIDEO_PIXELS:,} pixels taken")
    duration_ms = img.info.get("duration") or 0
    fps = video.fps or (1000.0 / duration_ms if duration_ms > 0 else 1.0)
    picked = _evenly(total, cap)
    wanted, frames, decoded = set(picked), [], 0
    for i in range(picked[-1] + 1):
        if i:
            try:
                img.seek(i)  # decodes frame i - 1 (if not yet) and reads frame i's header
            except DecompressionBombError:
                raise refused(where, f"frame {i} grows the canvas past the at most {MAX_PIXELS:,} pixels "
                                        "taken") from None
            except Exception as e:
                raise refused(where, f"frame {i} is truncated or corrupt ({type(e).__name__})") from None
        _check_size(where, img.size, i, MAX_FRAME_PIXELS)
        decoded += img.size[0] * img.size[1]
        if decoded > MAX_VIDEO_PIXELS:
            raise refused(where, f"decoding its frames up to frame {i} takes more than the at most "
                                    f"{MAX_VIDEO_PIXELS:,} pixels taken")
        if i in wanted:
            frames.append(fitted(_rgb(img, where, i)))
    return frames, len(frames) * fps / total


def _evenly(total: int, n: int) -> list[int]:
    import numpy as np

    return sorted(set(np.linspace(0, total - 1, num=min(n, total)).round().astype(int).tolist()))
