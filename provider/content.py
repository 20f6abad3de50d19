"""A chat message's content: a string, or text parts and images (the encoded files travel beside the messages,
each where an IMAGE_PART placeholder stands)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .types import Cause, JobError

MAX_IMAGES = 16  # images in one request, all turns together
MAX_IMAGE_BYTES = 12 << 20  # one encoded image file (16 MiB as base64, within the default body bound)
IMAGE_MEDIA = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")  # what a sender may call one
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


IMAGE_PART = {"type": "image"}  # where an image sits in a message's content parts: the job's next image


def content_text(content: str | list) -> str:
    """A message's text: its string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def check_content(param: str, content: Any) -> int:
    """A string, or a list of text parts and image placeholders; returns how many images it holds."""
    if not isinstance(content, list):
        check_text(param, content)
        return 0
    images = 0
    for j, part in enumerate(content):
        if part == IMAGE_PART:
            images += 1
        elif isinstance(part, dict) and part.get("type") == "text" and set(part) == {"type", "text"}:
            check_text(f"{param}[{j}].text", part["text"])
        else:
            raise _invalid(f"{param}[{j}]", "must be a text part or an image")
    return images


