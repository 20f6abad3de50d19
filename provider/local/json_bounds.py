"""What a JSON body would cost to parse, read off its bytes before it is parsed: how many values it holds and
how deeply they nest.

`json.loads` is C that holds the interpreter until it returns, on any thread: a 20 MiB body of tiny values
(`[[],[],...]`, `{"0":0,"1":0,...}`) took 2-13 s on a shared 2-core machine, during which neither /health nor the
coordinator session could run. This scan reads the bytes with numpy (whose array operations let the
interpreter go: other threads run beside it) and counts what the parse would build, so a body past its bounds
is refused before it is parsed; one within them parses in at most tens of milliseconds.

Counted: every `,` `:` `[` `{` outside strings, plus one (the root): each value and each key of a valid
document follows one of them, and an empty container counts once too (it costs a list or a dict). Strings are
told apart by their quotes, a quote escaped by an odd run of backslashes being text. A body that is not valid
JSON is counted as far as it is valid, which is as far as the parser reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

MAX_JSON_VALUES = 1 << 17  # values and keys in one body (or one stored conversation): ~50 ms to parse at worst
MAX_JSON_DEPTH = 64  # arrays and objects nested (a tool's schema nests at most 24, under tools[i].function...)
_CHUNK = 4 << 20
_QUOTE, _BACKSLASH = 34, 92
_COMMA, _COLON, _OPEN_ARRAY, _OPEN_OBJECT, _CLOSE_ARRAY, _CLOSE_OBJECT = 44, 58, 91, 123, 93, 125


@dataclass(frozen=True)
class Shape:
    values: int  # values and keys (and empty containers), as counted above
    depth: int  # the deepest nesting of arrays and objects
    too_deep_key: int | None = None  # where too deep first: the offset of the colon after its top-level key


def scan(raw: bytes, max_depth: int = MAX_JSON_DEPTH, chunk: int = _CHUNK) -> Shape:
    """The shape of the JSON document `raw`. Linear in its length; its memory is a few times `chunk`."""
    values, depth, deepest, in_string, backslashes = 1, 0, 0, False, 0  # the last two carried across chunks
    key, too_deep_key = None, None  # the last colon at the top level; it, once past max_depth
    for start in range(0, len(raw), chunk):
        a = np.frombuffer(raw, np.uint8, count=min(chunk, len(raw) - start), offset=start)
        quotes = np.flatnonzero(a == _QUOTE)
        quotes, backslashes = _unescaped(a, quotes, backslashes)
        marks = np.flatnonzero((a == _COMMA) | (a == _COLON) | (a == _OPEN_ARRAY) | (a == _OPEN_OBJECT)
                               | (a == _CLOSE_ARRAY) | (a == _CLOSE_OBJECT))
        # A mark is outside strings when an even number of real quotes (with the state carried in) precede it.
        outside = marks[(np.searchsorted(quotes, marks) + in_string) % 2 == 0]
        kinds = a[outside]
        closing = (kinds == _CLOSE_ARRAY) | (kinds == _CLOSE_OBJECT)
        opening = (kinds == _OPEN_ARRAY) | (kinds == _OPEN_OBJECT)
        values += int(outside.size - np.count_nonzero(closing))
        if outside.size:
            levels = np.cumsum(opening.astype(np.int64) - closing.astype(np.int64)) + depth
            deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
            if too_deep_key is None:
                past = np.flatnonzero(levels > max_depth)
                end = past[0] if past.size else levels.size
                keys = np.flatnonzero((kinds[:end] == _COLON) & (levels[:end] == 1))
                key = start + int(outside[keys[-1]]) if keys.size else key
                too_deep_key = key if past.size else None
        in_string = bool((quotes.size + in_string) % 2)
    return Shape(values, deepest, too_deep_key)


def key_before(raw: bytes, colon: int | None) -> str | None:
    """The object key (a JSON string) that the colon at `colon` follows, cut at 64 characters; None if none."""
    if colon is None:
        return None
    end = raw.rfind(b'"', 0, colon)
    begin = end - 1
    while begin >= 0 and (raw[begin] != _QUOTE or raw[begin - 1] == _BACKSLASH):
        begin -= 1
    try:
        key = json.loads(raw[begin:end + 1])
    except ValueError:
        return None
    return key[:64] if isinstance(key, str) else None


def _unescaped(a: np.ndarray, quotes: np.ndarray, carried: int) -> tuple[np.ndarray, int]:
    """The quotes of chunk `a` that are not escaped (after an odd run of backslashes, `carried` of them ending
    the chunk before), and how many backslashes end this chunk."""
    slashes = np.flatnonzero(a == _BACKSLASH)
    if not slashes.size:
        if carried % 2 and quotes.size and quotes[0] == 0:
            return quotes[1:], 0
        return quotes, 0
    breaks = np.flatnonzero(np.diff(slashes) != 1)
    starts = np.concatenate((slashes[:1], slashes[breaks + 1]))
    ends = np.concatenate((slashes[breaks], slashes[-1:]))
    runs = ends - starts + 1  # each run of backslashes: where it ends and how long it is
    if starts[0] == 0:
        runs[0] += carried
    at = np.minimum(np.searchsorted(ends, quotes - 1), ends.size - 1)
    escaped = (ends[at] == quotes - 1) & (runs[at] % 2 == 1)
    if carried % 2 and quotes.size and quotes[0] == 0:
        escaped[0] = True
    return quotes[~escaped], int(runs[-1]) if ends[-1] == a.size - 1 else 0
