"""A chat message's content: a string, or text parts and images (the encoded files travel beside the messages,
each where an IMAGE_PART placeholder stands)."""

from __future__ import annotations

import json

from dataclasses import dataclass
from typing import Any

from .types import Cause, JobError

MAX_IMAGES = 16  # images in one request, all turns together
MAX_IMAGE_BYTES = 12 << 20  # one encoded image file (16 MiB as base64, within the default body bound)
IMAGE_MEDIA = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")  # what a sender may call one
MAX_VIDEOS = 4
MAX_VIDEO_FILES = 64  # frames sent as images; the node samples at most its processor's frame cap of them
MAX_VIDEO_BYTES = MAX_IMAGE_BYTES  # all of one video's files
DETAILS = ("auto", "low", "high")  # an image's soft-token budget: the model's default, the least, the most


def _invalid(param: str, rule: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, f"{param} {rule}", param)


def check_text(param: str, value: Any) -> str:
    """A string that is valid Unicode: a lone surrogate (legal in JSON escapes) crashes tokenizers."""
    if not isinstance(value, str):
        raise _invalid(param, "must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(param, f"is not valid Unicode text (a lone surrogate at character {e.start}); "
                              "send UTF-8 text") from None
    return value


@dataclass(frozen=True)
class ImageInput:
    """One image of a chat, as sent: the encoded file (never a URL: the node fetches nothing), decoded and
    checked when the prompt is prepared, off the engine thread."""

    data: bytes
    detail: str = "auto"  # one of DETAILS
    where: str = "messages"  # the part it came from, named in errors (messages[i].content[j])


@dataclass(frozen=True)
class VideoInput:
    """One video of a chat: its frames as image files, or one animated GIF/WebP file whose frames are the
    video; `fps` is the frames' rate (an animated file's own timing is used when it has one)."""

    files: tuple[bytes, ...]
    fps: float | None = None
    where: str = "messages"


IMAGE_PART = {"type": "image"}  # where an image sits in a message's content parts: the job's next image
VIDEO_PART = {"type": "video"}  # the same for the job's next video


def content_text(content: str | list) -> str:
    """A message's text: its string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def message_chars(message: dict) -> int:
    """Characters of text a chat message carries into its template: its content and its tool calls' names and
    arguments (a turn of 64 calls of 64 KiB arguments templated to a million tokens, uncounted)."""
    n = len(content_text(message.get("content") or ""))
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments") if isinstance(fn, dict) else None
        n += len(str(fn.get("name", ""))) + (len(args) if isinstance(args, str) else len(json.dumps(args))
                                             if args is not None else 0)
    return n


def check_content(param: str, content: Any) -> tuple[int, int]:
    """A string, or a list of text parts and image or video placeholders; returns how many images and videos
    it holds."""
    if not isinstance(content, list):
        check_text(param, content)
        return 0, 0
    images = videos = 0
    for j, part in enumerate(content):
        if part == IMAGE_PART:
            images += 1
        elif part == VIDEO_PART:
            videos += 1
        elif isinstance(part, dict) and part.get("type") == "text" and set(part) == {"type", "text"}:
            check_text(f"{param}[{j}].text", part["text"])
        else:
            raise _invalid(f"{param}[{j}]", "must be a text part, an image or a video")
    return images, videos


def check_media(images: Any, videos: Any, placeholders: tuple[int, int]) -> None:
    """The job's images and videos: as many as the messages place, within their bounds (decoding is later)."""
    for kind, items, want, cls in (("image", images, placeholders[0], ImageInput),
                                   ("video", videos, placeholders[1], VideoInput)):
        if not isinstance(items, tuple) or len(items) != want or not all(isinstance(i, cls) for i in items):
            raise _invalid("messages", f"hold {want} {kind} parts but the job does not carry as many {kind}s")
    if len(images) > MAX_IMAGES:
        raise _invalid("messages", f"may hold at most {MAX_IMAGES} images, got {len(images)}")
    if len(videos) > MAX_VIDEOS:
        raise _invalid("messages", f"may hold at most {MAX_VIDEOS} videos, got {len(videos)}")
    for image in images:
        _check_file(image.where, image.data)
        if image.detail not in DETAILS:
            raise _invalid(f"{image.where}.detail", f"must be one of {', '.join(DETAILS)}")
    for video in videos:
        if not 0 < len(video.files) <= MAX_VIDEO_FILES:
            raise _invalid(video.where, f"must hold 1 to {MAX_VIDEO_FILES} frames, got {len(video.files)}")
        for f in video.files:
            _check_file(video.where, f)
        if sum(len(f) for f in video.files) > MAX_VIDEO_BYTES:
            raise _invalid(video.where, f"must be at most {MAX_VIDEO_BYTES >> 20} MiB in all")
        if video.fps is not None and (isinstance(video.fps, bool) or not isinstance(video.fps, (int, float))
                                      or not 0.01 <= video.fps <= 120):
            raise _invalid(f"{video.where}.fps", "must be a number from 0.01 to 120")


def _check_file(where: str, data: Any) -> None:
    if not isinstance(data, bytes) or not 0 < len(data) <= MAX_IMAGE_BYTES:
        raise _invalid(where, f"must be an image file of 1 byte to {MAX_IMAGE_BYTES >> 20} MiB, got "
                              f"{len(data) if isinstance(data, bytes) else 'no'} bytes")
