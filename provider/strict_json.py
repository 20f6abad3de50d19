"""JSON as the node takes it from outside: no NaN or Infinity, and integers of at most MAX_INT_DIGITS digits.

CPython turns a decimal string into an int in quadratic time, inside json.loads's C scanner, holding the
interpreter: a 20 MiB body of 4,299-digit integers (under Python's own 4,300-digit limit, and few enough values
for json_bounds) held every thread for 1.5 s, the event loop's included. No field the node reads needs more than
a 64-bit id or seed (20 digits)."""

from __future__ import annotations

import json
from typing import Any

MAX_INT_DIGITS = 40


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS + 1:  # a sign
        raise ValueError(f"an integer of {len(text)} characters; integers are at most {MAX_INT_DIGITS} digits")
    return int(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes) -> Any:
    """json.loads under these rules: ValueError (RecursionError when nested past the stack) otherwise."""
    return json.loads(text, parse_int=_int, parse_constant=_constant)
