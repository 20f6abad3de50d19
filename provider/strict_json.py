"""JSON as the node takes it from outside: no NaN or Infinity, and integers of at most MAX_INT_DIGITS digits.

CPython turns a decimal string into an int in quadratic time, inside json.loads's C scanner, holding the
interpreter: a 20 MiB body of 4,299-digit integers (under Python's own 4,300-digit limit, and few enough values
for json_bounds) held every thread for 1.5 s, the event loop's included. No field the node reads needs more than
a 64-bit id or seed (20 digits)."""

from __future__ import annotations

import json
from typing import Any

MAX_INT_DIGITS = 40


class IntegerTooLong(ValueError):
    """An integer past MAX_INT_DIGITS; `path` names where it stood (["temperature"], ["tools", 0, ...])."""

    def __init__(self, characters: int, path: list[str | int]):
        self.characters, self.path = characters, path
        where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))
        super().__init__(f"{where or 'the body'} is an integer of {characters} characters; integers are at most "
                         f"{MAX_INT_DIGITS} digits")


class _TooLong:
    """Stands where a too-long integer was, so the error can name its field once the parse is done."""

    def __init__(self, characters: int):
        self.characters = characters


def _path_to(value: Any, path: list[str | int]) -> list[str | int] | None:
    # Bounded by what was parsed (json_bounds counts values first); depth by the parser's own recursion limit.
    if isinstance(value, _TooLong):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _path_to(item, path + [key])) is not None:
            return found
    return None


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes) -> Any:
    """json.loads under these rules: ValueError (IntegerTooLong naming the field; RecursionError when nested past
    the stack) otherwise."""
    too_long: list[_TooLong] = []

    def _int(digits: str) -> Any:
        if len(digits) > MAX_INT_DIGITS + 1:  # a sign
            too_long.append(_TooLong(len(digits)))
            return too_long[-1]
        return int(digits)

    value = json.loads(text, parse_int=_int, parse_constant=_constant)
    if too_long:
        raise IntegerTooLong(too_long[0].characters, _path_to(value, []) or [])
    return value
