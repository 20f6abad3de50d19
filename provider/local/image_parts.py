"""OpenAI content parts -> a message's content, its images and videos. Media come inline as `data:` URLs only:
the node makes no outbound request on a client's behalf, so http(s) and file URLs are refused, not fetched.

Videos take mlx-vlm's part shapes: {type: video, video: [frame data URLs...], fps} (frames as images), or
{type: video_url, video_url: {url}} holding an animated GIF or WebP."""

from __future__ import annotations

import base64
import binascii

from ..content import DETAILS, IMAGE_MEDIA, IMAGE_PART, MAX_IMAGE_BYTES, MAX_VIDEO_FILES, VIDEO_PART, ImageInput, \
    VideoInput
from ..types import Cause, JobError

def _refused(message: str, param: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, message, param)


TEXT_TYPES = ("text", "input_text")
IMAGE_TYPES = ("image_url", "input_image")
VIDEO_TYPES = ("video", "video_url")


def content_parts(parts: list, param: str, images: list[ImageInput], videos: list[VideoInput]) -> str | list[dict]:
    """A message's parts as the job holds them: a string when they are all text (as before parts existed),
    else text parts and IMAGE_PART / VIDEO_PART placeholders; each image or video is appended to its list."""
    out: list[dict] = []
    for j, part in enumerate(parts):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_TYPES and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_TYPES:
            images.append(image_input(part, where))
            out.append(dict(IMAGE_PART))
        elif kind in VIDEO_TYPES:
            videos.append(video_input(part, where))
            out.append(dict(VIDEO_PART))
        else:
            raise _refused(f"{where} must be a text part ({{type: text, text}}) or an image part "
                               "({type: image_url, image_url: {url: data:image/...;base64,...}}); audio and "
                               "files are not supported", f"{param}.content")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def image_input(part: dict, where: str) -> ImageInput:
    ref = part.get("image_url")
    if isinstance(ref, dict):
        url, detail = ref.get("url"), ref.get("detail", "auto")
    else:
        url, detail = ref, part.get("detail", "auto")
    if detail is None:
        detail = "auto"
    if detail not in DETAILS:
        raise _refused(f"{where}.image_url.detail must be one of {', '.join(DETAILS)}", f"{where}.detail")
    if not isinstance(url, str):
        raise _refused(f"{where}.image_url.url must be a string (a data: URL)", where)
    return ImageInput(data_url_bytes(url, where), detail, where)


def video_input(part: dict, where: str) -> VideoInput:
    if part.get("type") == "video_url":
        ref = part.get("video_url")
        urls = [ref.get("url") if isinstance(ref, dict) else ref]
    else:
        ref = part.get("video")
        urls = ref if isinstance(ref, list) else [ref]
    if not urls or len(urls) > MAX_VIDEO_FILES or not all(isinstance(u, str) for u in urls):
        raise _refused(f"{where} must be a data URL of an animated GIF or WebP, or a list of 1 to {MAX_VIDEO_FILES} "
                       "frame data URLs", where)
    fps = part.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0.01 <= fps <= 120):
        raise _refused(f"{where}.fps must be a number from 0.01 to 120", f"{where}.fps")
    return VideoInput(tuple(data_url_bytes(u, where) for u in urls), None if fps is None else float(fps), where)


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a base64 `data:image/...` URL, bounded before decoding."""
    head, sep, payload = url.partition(",")
    scheme = head.split(":", 1)[0].strip().lower() if ":" in head else ""
    if scheme != "data" or not sep:
        shown = scheme or url[:16]
        raise _refused(f"{where}: the node does not fetch URLs ({shown!r}); send the image inline as a "
                           "data:image/...;base64,... URL", where)
    media, *params = head[5:].split(";")
    media = media.strip().lower()
    if media == "image/svg+xml":
        raise _refused(f"{where}: SVG images are not supported; send PNG, JPEG, WebP or GIF", where)
    if media not in IMAGE_MEDIA:
        raise _refused(f"{where}: the data URL's type must be one of {', '.join(IMAGE_MEDIA)}, got "
                           f"{media[:40]!r}", where)
    if "base64" not in (p.strip().lower() for p in params):
        raise _refused(f"{where}: the data URL must be base64-encoded (data:{media};base64,...)", where)
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise _refused(f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(f"{where}: the data URL is not valid base64", where) from None
    if not data:
        raise _refused(f"{where}: the image is empty", where)
    return data
