"""Request bodies as the local API reads them: decompressed within the body limit, parsed as strict JSON."""

from __future__ import annotations

import json
import zlib
from typing import Any

from aiohttp import web

from . import openai_api as api

# wbits for zlib: gzip, zlib-wrapped deflate (RFC 9110), and the raw deflate some clients send instead.
_DECODINGS = {"gzip": (16 + zlib.MAX_WBITS,), "x-gzip": (16 + zlib.MAX_WBITS,),
              "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, decoded here rather than in aiohttp's parser (whose errors on a bad body escape the
    handler as plain-text 400s, or hang the request), and never inflated past the body limit."""
    raw = await request.read()  # at most client_max_size bytes, as sent
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _DECODINGS:
        raise api.RequestError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none",
                               status=415, code="unsupported_media_type")
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


def parse_json(raw: bytes) -> Any:
    """JSON is UTF-8 (RFC 8259). NaN and Infinity, which json.loads accepts by default, are refused; so is
    nesting deep enough to exhaust the stack."""
    def bad_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=bad_constant)
    except UnicodeDecodeError as e:
        raise api.RequestError(f"the request body is not UTF-8 (byte {e.start}); send JSON as UTF-8") from None
    except RecursionError:
        raise api.RequestError("the request body is nested too deeply") from None
    except ValueError as e:
        raise api.RequestError(f"the request body is not valid JSON: {e}") from None
