"""A request's `keep_alive` as Ollama reads it: how long its model stays loaded once idle after it.

A number is seconds; a string is a number of seconds or a Go duration ("30s", "5m", "1h30m", "250ms"); 0 unloads
the model once the request ends; any negative value keeps it loaded until another request or the operator says
otherwise. Read at the edge into seconds (FOREVER for a negative), or None when not given.
"""

from __future__ import annotations

import math
import re

from .memory.admission import FOREVER
from .types import Cause, JobError

MAX_SECONDS = 365 * 86400.0  # a year; past it, ask for for ever (-1)
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+")
HINT = 'a duration ("5m", "1h30m"), seconds, 0 to unload the model after this request, or -1 to keep it loaded'


def parse_keep_alive(raw: object) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _invalid(f"must be {HINT}")
    if isinstance(raw, str):
        text = raw.strip()
        if len(text) > 64:
            raise _invalid(f"must be {HINT}")
        if text.startswith("-"):  # Ollama: any negative duration keeps the model
            if not (_DURATION.fullmatch(text[1:]) or _number(text[1:]) is not None):
                raise _invalid(f"must be {HINT}")
            return FOREVER
        seconds = _number(text)
        if seconds is None:
            if not _DURATION.fullmatch(text):
                raise _invalid(f"must be {HINT}, not {raw!r}")
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    elif raw == FOREVER:  # already read (a job copied with dataclasses.replace is read again)
        return FOREVER
    else:
        seconds = float(raw)
    if math.isnan(seconds):
        raise _invalid(f"must be {HINT}")
    if seconds < 0:
        return FOREVER
    if seconds > MAX_SECONDS:
        raise _invalid(f"must be at most {MAX_SECONDS:.0f} seconds; -1 keeps the model loaded")
    return seconds


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) or value < 0 else None


def _invalid(message: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, f"keep_alive {message}", param="keep_alive")
