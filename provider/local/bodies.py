"""Request bodies as the local API reads them: decompressed within the body limit, bounded in values and depth
(json_bounds), parsed as strict JSON, off the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import zlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from aiohttp import web

from .. import strict_json
from . import openai_api as api
from .json_bounds import MAX_JSON_DEPTH, MAX_JSON_VALUES, key_before, scan

# wbits for zlib: gzip, zlib-wrapped deflate (RFC 9110), and the raw deflate some clients send instead.
_DECODINGS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
              "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}
# Where bodies are bounded, parsed and translated into jobs: never on the event loop the coordinator session
# shares. One thread: the interpreter runs one of them at a time anyway, and each more would be one more holder
# of it for the loop to wait behind. A flood waits here, not in asyncio's default pool.
_PARSER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-parse")
T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the request parser's thread, the cycle collector paused meanwhile; what it raises (a
    RequestError) is raised here."""
    return await asyncio.get_running_loop().run_in_executor(_PARSER, _uncollected, fn, *args)


def _uncollected(fn: Callable[..., T], *args: Any) -> T:
    """What a parse and its translation build holds no cycles, and a collection started among them walks every
    container the node's requests hold with the interpreter held: over a node-sized heap, 20 chained Responses
    requests set off two full collections of 243 ms each. Only this thread turns it off and on."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if collecting:
            gc.enable()


@dataclass(frozen=True)
class Body:
    value: Any
    values: int  # JSON values and keys in it (json_bounds.scan)
    size: int  # bytes, decompressed


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, decoded here rather than in aiohttp's parser (whose errors on a bad body escape the
    handler as plain-text 400s, or hang the request), and never inflated past the body limit."""
    raw = await request.read()  # at most client_max_size bytes, as sent
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(raw) > limit:  # a route's own limit (a model control's 64 KiB), below the server's
            raise api.RequestError(f"request body exceeds {limit} bytes", status=413, code="body_too_large")
        return raw
    if encoding not in _DECODINGS:
        raise api.RequestError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none",
                               status=415, code="unsupported_media_type")
    return await off_loop(_inflate, raw, encoding, limit)


def _inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    for wbits in _DECODINGS[encoding]:
        inflater = zlib.decompressobj(wbits)
        try:
            body = inflater.decompress(raw, limit + 1)
        except zlib.error:
            continue
        if len(body) > limit:
            raise api.RequestError(f"request body exceeds {limit} bytes once decompressed", status=413,
                                   code="body_too_large")
        if inflater.eof and not inflater.unused_data:
            return body
    raise api.RequestError(f"the request body is not valid {encoding} data; check its Content-Encoding")


async def read_json(request: web.Request, limit: int) -> Any:
    """The body as JSON, read within `limit` bytes, bounded and parsed off the event loop."""
    return await read_parsed(request, limit, lambda value: value)


async def read_parsed(request: web.Request, limit: int, parse: Callable[[Any], T]) -> T:
    """The body read within `limit`, then bounded, parsed and given to `parse` on the parser thread: the parsed
    JSON never reaches the event loop, only what `parse` makes of it (freeing 131,072 values, or a collection
    walking them while a job runs, would be the loop's work otherwise)."""
    raw = await read_body(request, limit)
    return await off_loop(lambda: parse(parse_bounded(raw).value))


def parse_bounded(raw: bytes, most: int = MAX_JSON_VALUES, what: str = "the request body") -> Body:
    """Strict JSON within the bounds, counted before it is parsed: at most `most` values and keys, nested at most
    MAX_JSON_DEPTH deep (a 400: deeper nesting has no use here and exhausts the stack of whatever walks it)."""
    shape = scan(raw)
    if shape.depth > MAX_JSON_DEPTH:
        raise api.RequestError(f"{what} is nested too deeply: {shape.depth} levels of arrays and objects, at most "
                               f"{MAX_JSON_DEPTH}", key_before(raw, shape.too_deep_key))
    if shape.values > most:
        raise api.RequestError(f"{what} holds {shape.values} JSON values and keys, more than the {most} the node "
                               "parses in one request", status=413, code="body_too_large")
    return Body(_loads(raw), shape.values, len(raw))


def parse_json(raw: bytes) -> Any:
    """A small body (a model control's), bounded as any; on the caller's thread."""
    return parse_bounded(raw).value


def _loads(raw: bytes) -> Any:
    """JSON is UTF-8 (RFC 8259), parsed as strict_json says (no NaN or Infinity, no integer past 40 digits)."""
    try:
        return strict_json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise api.RequestError(f"the request body is not UTF-8 (byte {e.start}); send JSON as UTF-8") from None
    except RecursionError:
        raise api.RequestError("the request body is nested too deeply") from None
    except strict_json.IntegerTooLong as e:
        field = e.path[0] if e.path and isinstance(e.path[0], str) else None
        raise api.RequestError(f"the request body is not valid JSON: {e}", param=field) from None
    except ValueError as e:
        raise api.RequestError(f"the request body is not valid JSON: {e}") from None
