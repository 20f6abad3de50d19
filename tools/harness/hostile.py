"""Hostile inputs as hypothesis strategies, shared by the fuzz tests (bounded) and tools/scripts/fuzz_campaign.py (long).

Every field of every request is assumed hostile: wrong types, huge and non-finite numbers, lone surrogates,
deep nesting, out-of-vocabulary token ids, odd content types and encodings, truncated and garbage frames.
Most cases stay close enough to a valid request to reach the node's deeper checks.
"""

from __future__ import annotations

import gzip
import json
import time
import zlib
from dataclasses import dataclass

from hypothesis import strategies as st

from coordinator_client.pb import provider_pb2 as pb

HUGE = [2**31, 2**32 - 1, 2**32, 2**63, 2**64, 10**400, -(10**400), -(2**63) - 1]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0]
TEXT_EDGES = ["", "\ud800", "a\udfffb", "\x00", "\u202e", "🙂" * 8, "word " * 4000, "<|eot|>", "\ufeff"]
ROLES = ["system", "user", "assistant", "developer", "tool", "", "wizard", "USER"]
# The fields whose values reach the model (native code indexes with token ids): drawn more often.
MODEL_FIELDS = ["logit_bias", "stop_token_ids", "top_k", "prompt", "messages", "response_format", "tools"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stop_token_ids", "logit_bias", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "tools",
          "response_format", "tool_choice", "parallel_tool_calls", "speculation", "user", "keep_alive"]

numbers = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.sampled_from(HUGE),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(ODD_FLOATS),
                    st.floats(0, 2))
texts = st.one_of(st.text(max_size=40), st.sampled_from(TEXT_EDGES))
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
# A request's keep_alive (Ollama's reading): durations, seconds, 0, negatives, and what is none of them.
KEEP_ALIVE_EDGES = ["5m", "0", "-1", "1h30m", "250ms", "0s", "-5m", "soon", "", "-", "1e400", "nan", "inf", "5",
                    "9999999999", "1.5h", "5 m", "1d"]
keep_alives = st.one_of(st.sampled_from(KEEP_ALIVE_EDGES), numbers)
json_values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(texts, inner, max_size=4)),
                           max_leaves=12)
# Ids around a small vocabulary's end (the fixture's is 512), a real one's (Gemma's 262144), and far past.
BOUNDARY_IDS = [0, 1, 511, 512, 513, 600, 2048, 70_000, 262_143, 262_144, 2**31 - 1, 2**31, 2**70]
token_ids = st.one_of(st.sampled_from(BOUNDARY_IDS), st.integers(0, 600), st.sampled_from(HUGE),
                      st.integers(-5, -1))
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES), json_values),
                                           "content": st.one_of(texts, json_values)}), max_size=4)


def _nested(depth: int, key: str = "properties") -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", key: {"a": schema}} if key == "properties" else {"type": "array", "items": schema}
    return schema


# Schemas built to hurt a grammar compiler: deep nesting (past the bound and just under it), enormous enums and
# unions, pathological patterns and counted repetitions, recursion, wide objects, keywords nothing enforces,
# wrong types where schemas go. Each must be a 4xx naming its field, or compile within its bound.
HOSTILE_SCHEMAS = [
    _nested(300), _nested(23), _nested(60, "items"),  # 600 levels: past the bound, still encodable
    {"enum": [f"v{i}" for i in range(9000)]},
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(800)]},
    {"type": "string", "pattern": "(a+)+(b|c)*d{1000}$"},
    {"type": "string", "pattern": "[\\s\\S]{100000}"},
    {"type": "string", "pattern": "(((((((((a*)*)*)*)*)*)*)*)*)*b"},
    {"type": "string", "minLength": 10**9},
    {"type": "array", "minItems": 10**9, "items": {"type": "integer"}},
    {"type": "integer", "minimum": 10**400, "maximum": -(10**400)},
    {"type": "number", "multipleOf": 1e-300},
    {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}},
     "$ref": "#/$defs/N"},
    {"$ref": "#/$defs/missing"}, {"$ref": "http://example.com/schema.json"},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 3} for i in range(3000)},
     "required": [f"p{i}" for i in range(3000)]},
    {"type": "object", "if": {}, "then": {}}, {"type": "object", "frobnicate": True}, {"x-guidance": {"lenient": True}},
    {"type": "nope"}, {"type": ["string", 5]}, {"properties": []}, {"anyOf": {}}, {"allOf": [{"type": "string"},
                                                                                          {"type": "integer"}]},
    {"type": "string", "format": "not-a-format"}, [], "schema", 5, None,
]
schemas = st.one_of(st.sampled_from(HOSTILE_SCHEMAS), json_values)
response_formats = st.one_of(
    st.builds(lambda schema, name: {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
              schemas, st.one_of(st.just("r"), texts)),
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"}, {"type": "json_schema"},
                     {"type": "json_schema", "json_schema": {"name": "r"}}]),
    json_values)
_tool = st.builds(lambda name, params, desc: {"type": "function", "function": {
    "name": name, "parameters": params, "description": desc}},
    st.one_of(st.sampled_from(["f", "get_weather", "a" * 65, "bad name", ""]), texts), schemas,
    st.one_of(st.just(""), st.just("d" * 20_000), texts))
tool_lists = st.one_of(st.lists(_tool, max_size=3),
                       st.integers(129, 300).map(lambda n: [{"type": "function", "function": {"name": f"t{i}"}}
                                                            for i in range(n)]),
                       st.just([{"type": "function", "function": {"name": "f"}}] * 2), json_values)
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required", "any", ""]),
                         st.builds(lambda n: {"type": "function", "function": {"name": n}},
                                   st.sampled_from(["f", "g", "get_weather"])), json_values)


def _field(name: str) -> st.SearchStrategy:
    plausible = {
        "model": st.sampled_from(["", "llama-tiny", "nope", "../../etc", "llama-tiny\x00"]),
        # Text, token ids (one prompt or many) around the vocabulary's end, batches of strings.
        "prompt": st.one_of(texts, st.lists(token_ids, min_size=1, max_size=6),
                            st.lists(st.lists(token_ids, max_size=4), max_size=4), st.lists(texts, max_size=70)),
        "n": st.one_of(st.integers(-1, 20), st.sampled_from(HUGE)),
        "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), st.sampled_from(HUGE)),
        "top_logprobs": st.one_of(st.integers(-1, 25), st.sampled_from(HUGE)),
        "echo": st.booleans(),
        "messages": messages,
        "max_tokens": st.one_of(st.integers(-2, 20), st.sampled_from(HUGE)),
        "top_k": st.one_of(st.integers(-2, 1000), st.sampled_from(HUGE)),
        "stop": st.one_of(texts, st.lists(texts, max_size=20)),
        "stop_token_ids": st.one_of(st.lists(st.sampled_from(BOUNDARY_IDS), min_size=1, max_size=3),
                                    st.lists(token_ids, min_size=1, max_size=6)),
        # Well-formed maps whose only fault is an id past the vocabulary, and maps wrong in any way.
        "logit_bias": st.one_of(
            st.dictionaries(st.sampled_from(BOUNDARY_IDS).map(str), st.floats(-100, 100), min_size=1, max_size=3),
            st.dictionaries(st.one_of(token_ids.map(str), texts), numbers, min_size=1, max_size=5)),
        "stream": st.booleans(),
        "speculation": st.sampled_from(["auto", "on", "off", "maybe"]),
        "keep_alive": keep_alives,
        "response_format": response_formats,
        "tools": tool_lists,
        "tool_choice": tool_choices,
    }.get(name, numbers)
    return st.one_of(plausible, plausible, json_values)


@st.composite
def _one_hostile_field(draw) -> dict:
    """A valid request with one field drawn hostile: reaches every check behind the ones it passes."""
    chat = draw(st.booleans())
    body = {"max_tokens": 3, "temperature": draw(st.sampled_from([0, 0.7, 1.0]))}
    body |= {"messages": [{"role": "user", "content": "The cache"}]} if chat else {"prompt": "The cache"}
    name = draw(st.sampled_from(FIELDS + MODEL_FIELDS * 4))
    return body | {name: draw(_field(name))}


# Half near-valid (one hostile field), half any combination of fields.
request_bodies = st.one_of(_one_hostile_field(),
                           st.fixed_dictionaries({}, optional={name: _field(name) for name in FIELDS}))


@dataclass(frozen=True)
class HttpCase:
    path: str
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # bytes, so a header may be non-UTF-8
    authorized: bool


def _encode(body, style: str) -> bytes:
    text = json.dumps(body, ensure_ascii=True, allow_nan=True)  # lone surrogates travel as \ud800 escapes
    if style == "truncated":
        return text[: len(text) // 2].encode()
    return text.encode()


@st.composite
def http_cases(draw, token: str | None) -> HttpCase:
    """One request to the local API: a body (mostly near-valid JSON), headers, and whether it carries the token."""
    kind = draw(st.sampled_from(["json", "json", "json", "json", "truncated", "deep", "binary", "not-object"]))
    if kind == "deep":
        depth = draw(st.integers(100, 50_000))
        body = b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "binary":
        body = draw(st.binary(max_size=200))
    elif kind == "not-object":
        body = _encode(draw(json_values), "json")
    else:
        body = _encode(draw(request_bodies), kind)
    plain = draw(st.integers(0, 9)) < 7  # most cases keep plain headers, so their bodies are read
    encoding = None if plain else draw(st.sampled_from(
        ["gzip", "gzip-garbage", "deflate", "deflate-garbage", "br", "identity", "GZIP"]))
    content_type = b"application/json" if plain else draw(st.sampled_from([
        b"application/json; charset=utf-8", b"application/json; charset=bogus",
        b"application/json; charset=latin-1", b"text/plain", b"multipart/form-data; boundary=x", b""]))
    headers = [(b"Content-Type", content_type)]
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if encoding is not None:
        headers.append((b"Content-Encoding", encoding.split("-")[0].encode()))
    auth = "token" if plain else draw(st.sampled_from(["token", "none", "wrong", "non-utf8"]))
    if token is None:
        auth = "none"
    value = {"token": f"Bearer {token}".encode(), "wrong": b"Bearer sk-wrong", "non-utf8": b"Bearer \xff\xfe\x80",
             "none": None}[auth]
    if value is not None:
        headers.append((b"Authorization", value))
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    return HttpCase(path, body, tuple(headers), token is None or auth == "token")


# --- coordinator frames ---------------------------------------------------------------

proto_texts = st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
                        st.sampled_from([t for t in TEXT_EDGES if "\ud800" not in t and "\udfff" not in t]))
proto_floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.7, 1.0, 2.0]))
uint32s = st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1))


PROTO_FIELDS = ["model", "input", "temperature", "top_p", "min_p", "top_k", "seed", "max_tokens", "stop",
                "stop_token_ids", "speculation", "deadline_ms", "response_format", "tools", "tool_choice", "logprobs"]
schema_texts = st.one_of(st.sampled_from([json.dumps(s) for s in HOSTILE_SCHEMAS if s is not None]), proto_texts,
                         st.just("{" * 100_000))


@st.composite
def job_requests(draw, model: str) -> pb.JobRequest:
    """A JobRequest with one field drawn hostile, or all of them (the job id is the caller's, so outcomes can
    be awaited). The other fields keep values a coordinator would send."""
    hostile = draw(st.sampled_from(PROTO_FIELDS + ["all"] * 4))

    def pick(name, normal, strategy):
        return draw(strategy) if hostile in (name, "all") else normal

    sampling = pb.SamplingParams(temperature=pick("temperature", 0.7, proto_floats))
    for name, strategy in (("top_p", proto_floats), ("min_p", proto_floats), ("top_k", uint32s),
                           ("seed", st.integers(0, 2**64 - 1))):
        if hostile in (name, "all") and draw(st.booleans()):
            setattr(sampling, name, draw(strategy))
    req = pb.JobRequest(model=pick("model", model, st.sampled_from(["", "nope", "../" + model, model + "\x00"])),
                        sampling=sampling, max_tokens=pick("max_tokens", 3, uint32s),
                        stop=pick("stop", [], st.lists(proto_texts, max_size=20)),
                        stop_token_ids=pick("stop_token_ids", [], st.lists(st.integers(0, 2**32 - 1), max_size=5)),
                        speculation=pick("speculation", 0, st.sampled_from([0, 1, 2, 3, 7, 2**31 - 1])),
                        deadline_ms=pick("deadline_ms", 0, st.sampled_from(
                            [1, int(time.time() * 1000) + 60_000, -5, 2**63 - 1])))
    if hostile in ("response_format", "all"):
        req.response_format.CopyFrom(pb.ResponseFormat(
            type=draw(st.sampled_from(["json_schema", "json_object", "text", "xml", ""])),
            schema_name=draw(st.one_of(st.just("r"), proto_texts)), schema_json=draw(schema_texts)))
    if hostile in ("tools", "all"):
        for _ in range(draw(st.sampled_from([1, 2, 129]))):
            req.tools.add(name=draw(st.one_of(st.just("f"), proto_texts)), parameters_json=draw(schema_texts))
    if hostile in ("tool_choice", "all"):
        req.tool_choice = draw(st.one_of(st.sampled_from(["none", "auto", "required", "f", "g"]), proto_texts))
    if hostile in ("logprobs", "all"):
        if draw(st.booleans()):
            req.logprobs = draw(st.one_of(st.integers(0, 25), uint32s))
        req.prompt_logprobs = draw(st.booleans())
    if hostile in ("tools", "tool_choice") and draw(st.booleans()):
        req.chat.messages.add(role="user", content="The cache")  # tools need a chat
    elif hostile not in ("input", "all"):
        req.prompt = "The cache"
    elif draw(st.booleans()):
        req.prompt = draw(proto_texts)
    elif draw(st.booleans()):  # token ids around the vocabulary's end, or none
        req.prompt_ids.ids.extend(draw(st.lists(st.one_of(st.sampled_from(BOUNDARY_IDS[:-1]), uint32s), max_size=6)))
    else:
        for role, content in draw(st.lists(st.tuples(st.one_of(st.sampled_from(ROLES), proto_texts), proto_texts),
                                           max_size=4)):
            req.chat.messages.add(role=role, content=content)
    return req


@st.composite
def residency_frames(draw, model: str) -> pb.CoordinatorFrame:
    """A WarmModel or ReleaseModel (request id left to the caller) naming the served model or not, with any
    keep_alive: what a coordinator may send to load or let go of a model."""
    name = draw(st.one_of(st.just(model), st.sampled_from(["", "nope", "../" + model, model + "\x00", "x" * 70_000]),
                          proto_texts))
    if draw(st.booleans()):
        keep = draw(st.one_of(st.sampled_from(KEEP_ALIVE_EDGES), proto_texts))
        return pb.CoordinatorFrame(warm_model=pb.WarmModel(model=name, keep_alive=keep))
    return pb.CoordinatorFrame(release_model=pb.ReleaseModel(model=name))


def garbage_frames() -> st.SearchStrategy[bytes]:
    """Bytes that are not a CoordinatorFrame, or are one cut short or with junk appended."""
    valid = pb.CoordinatorFrame(job_request=pb.JobRequest(job_id="garbage-probe", model="x", prompt="hi"))
    data = valid.SerializeToString()
    return st.one_of(st.binary(max_size=300),
                     st.integers(1, len(data) - 1).map(lambda n: data[:n]),
                     st.binary(min_size=1, max_size=20).map(lambda junk: data + junk),
                     st.just(b"\xff" * 64))


# --- coordinator attacks (issue 36): oversized requests and malformed results ------------------------------------

# Spellings of a weights hash no result may sign: the empty and short ones signed 32 zero bytes, case was ignored,
# and a 64-character non-hex one raised ValueError out of the verifier.
HASH_SPELLINGS = ["", "ab", "0" * 63, "0" * 65, "A" * 64, "g" * 64, " " * 64, "0x" + "0" * 62, "é" * 64,
                  "\x00" * 64, "0" * 64]


def oversized_requests(model: str, prefix: str) -> list[tuple[str, pb.JobRequest]]:
    """Requests past a count or a length, each refused before its elements are built (named, for the report).
    Ids from 129 characters to 4 MiB; repeated fields far past their bounds (a few MiB on the wire each)."""
    chat = pb.ChatMessages
    cases = [(f"job_id_{n}", pb.JobRequest(job_id=f"{prefix}-" + "i" * n, model=model, prompt="x"))
             for n in (129, 1 << 16, 4 << 20)]
    many = 400_000
    for name, req in (
            ("prompt_ids", pb.JobRequest(model=model, prompt_ids=pb.PromptTokens(ids=[1000] * (2 << 20)))),
            ("stop", pb.JobRequest(model=model, prompt="x", stop=[""] * many)),
            ("stop_token_ids", pb.JobRequest(model=model, prompt="x", stop_token_ids=[7] * many)),
            ("messages", pb.JobRequest(model=model, chat=chat(messages=[pb.ChatMessage(role="user")] * many))),
            ("parts", pb.JobRequest(model=model, chat=chat(messages=[pb.ChatMessage(
                role="user", parts=[pb.ContentPart(text="")] * many)]))),
            ("tool_calls", pb.JobRequest(model=model, chat=chat(messages=[pb.ChatMessage(
                role="assistant", tool_calls=[pb.ToolCall(name="f")] * many)]))),
            ("tools", pb.JobRequest(model=model, prompt="x", tools=[pb.Tool(name="f")] * many))):
        req.job_id = f"{prefix}-{name}"
        cases.append((name, req))
    return cases


def malformed_results(done: pb.JobDone) -> st.SearchStrategy[pb.JobDone]:
    """`done` (a real, signed JobDone) with one or more signed fields made malformed: a weights hash spelled
    wrong, digests of the wrong size, another layout, junk signatures, odd ids and counts. A verifier must
    refuse each with a typed error; none may raise anything else."""
    digests = st.one_of(st.binary(max_size=40), st.sampled_from([b"", bytes(31), bytes(33), bytes(32)]))
    mutations = {
        "model_sha256": lambda d, draw: setattr(d, "model_sha256", draw(st.one_of(st.sampled_from(HASH_SPELLINGS),
                                                                                  proto_texts))),
        "token_ids_sha256": lambda d, draw: setattr(d.completion, "token_ids_sha256", draw(digests)),
        "request_sha256": lambda d, draw: setattr(d, "request_sha256", draw(digests)),
        "signature_layout": lambda d, draw: setattr(d, "signature_layout", draw(uint32s)),
        "signature": lambda d, draw: setattr(d, "signature", draw(st.binary(max_size=100))),
        "job_id": lambda d, draw: setattr(d, "job_id", draw(st.one_of(proto_texts, st.just("j\x00" * 200)))),
        "counts": lambda d, draw: setattr(d.completion, "chunks", draw(st.integers(0, 2**64 - 1))),
        "completion": lambda d, draw: setattr(d.completion, "sealed", draw(st.binary(max_size=64))),
    }

    @st.composite
    def one(draw) -> pb.JobDone:
        out = pb.JobDone()
        out.CopyFrom(done)
        for name in draw(st.lists(st.sampled_from(sorted(mutations)), min_size=1, max_size=3, unique=True)):
            mutations[name](out, draw)
        return out

    return one()


# --- Media bombs (issue 37): a few kilobytes each that decode, or once decoded and scaled would, to gigabytes.
# Each is an OpenAI content part; the node must refuse it with a 4xx or serve it within its bounds.

def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, "PNG", optimize=True)
    return buf.getvalue()


def _gif_frame_data(w: int, h: int) -> bytes:
    """The LZW image data (code size byte and sub-blocks) of a w x h frame of colour 0, as Pillow writes it."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("P", (w, h), 0).save(buf, "GIF")
    data = buf.getvalue()
    at = data.index(b",", 13 + 3 * 2 ** ((data[10] & 7) + 1))  # the image descriptor, past the colour table
    return data[at + 10:-1]  # after the descriptor (no local table), before the trailer


def gif_with_frames(screen: tuple[int, int], frames: list[tuple[int, int, int, int]], delay_cs: int = 10) -> bytes:
    """A GIF of logical screen `screen` whose frames are (x, y, w, h) rectangles of colour 0: a frame may lie
    past the screen (Pillow grows the canvas when it seeks to it)."""
    import struct

    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff")
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\0\0\0"
    cache: dict = {}
    for x, y, w, h in frames:
        data = cache.setdefault((w, h), _gif_frame_data(w, h))
        out += b"\x21\xf9\x04\x00" + struct.pack("<H", delay_cs) + b"\0\0"
        out += b"," + struct.pack("<HHHHB", x, y, w, h, 0) + data
    return bytes(out + b";")


def _chunk(kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def apng_with_frames(size: tuple[int, int], frames: int) -> bytes:
    """An APNG of a 1-bit `size` canvas (its default image the first frame) and `frames - 1` more 1x1 frames:
    each read composites onto the whole canvas."""
    import struct
    import zlib

    w, h = size
    rows = zlib.compress((b"\0" + bytes((w + 7) // 8)) * h, 9)
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
    out += _chunk(b"acTL", struct.pack(">II", frames, 0))
    out += _chunk(b"fcTL", struct.pack(">IIIIIHHBB", 0, w, h, 0, 0, 1, 10, 0, 0)) + _chunk(b"IDAT", rows)
    one = zlib.compress(b"\0\x80")
    for i in range(1, frames):
        out += _chunk(b"fcTL", struct.pack(">IIIIIHHBB", 2 * i - 1, 1, 1, 0, 0, 1, 10, 0, 0))
        out += _chunk(b"fdAT", struct.pack(">I", 2 * i) + one)
    return out + _chunk(b"IEND", b"")


def webp_with_frames(canvas: tuple[int, int], frames: int) -> bytes:
    """An animated WebP of a `canvas` canvas and `frames` 1x1 lossless frames (the canvas is what each decoded
    frame fills)."""
    import io
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "WEBP", lossless=True)
    vp8l = buf.getvalue()[12:]  # the VP8L chunk of a still 1x1 image

    def u24(v: int) -> bytes:
        return struct.pack("<I", v)[:3]

    def riff(kind: bytes, data: bytes) -> bytes:
        return kind + struct.pack("<I", len(data)) + data + b"\0" * (len(data) % 2)

    body = riff(b"VP8X", b"\x02\0\0\0" + u24(canvas[0] - 1) + u24(canvas[1] - 1))
    body += riff(b"ANIM", b"\0\0\0\0\0\0")
    frame = riff(b"ANMF", u24(0) + u24(0) + u24(0) + u24(0) + u24(100) + b"\0" + vp8l)
    body += frame * frames
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, mime: str = "image/png", detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, mime), "detail": detail}}


def media_bombs() -> list[tuple[str, list[dict]]]:
    """(name, content parts) of each media bomb: findings 1-3 of issue 37 and their variants."""
    import io

    from PIL import Image

    def saved(frames: list, fmt: str, **kw) -> bytes:
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], **kw)
        return buf.getvalue()

    tiny = _png(Image.new("RGB", (1, 1)))  # 69 bytes
    one_bit = _png(Image.new("1", (5656, 5656)))  # 32M pixels in a few KB
    gif = "image/gif"
    return [
        # 1: a 10x10 GIF whose later frames sit at a large offset: the canvas grows on seek
        ("gif frame at a large offset", [{"type": "video_url", "video_url": {"url": data_url(gif_with_frames(
            (10, 10), [(0, 0, 10, 10)] + [(5600, 5600, 10, 10)] * 31), gif)}}]),
        ("gif frame past the pixel bound", [{"type": "video_url", "video_url": {"url": data_url(gif_with_frames(
            (10, 10), [(0, 0, 10, 10), (6000, 6000, 10, 10)]), gif)}}]),
        ("gif frame at an offset under the canvas bound", [{"type": "video_url", "video_url": {"url": data_url(
            gif_with_frames((10, 10), [(0, 0, 10, 10)] + [(3990, 3990, 10, 10)] * 23), gif)}}]),
        ("gif frame at an offset, medium", [{"type": "video_url", "video_url": {"url": data_url(gif_with_frames(
            (10, 10), [(0, 0, 10, 10)] + [(1490, 1490, 10, 10)] * 63), gif)}}]),
        ("gif frame at a large offset as an image", [image_part(gif_with_frames(
            (10, 10), [(0, 0, 10, 10), (6000, 6000, 10, 10)]), gif, "high")]),
        ("gif of many tiny frames", [{"type": "video_url", "video_url": {"url": data_url(gif_with_frames(
            (1, 1), [(0, 0, 1, 1)] * 12_000), gif)}}]),
        ("gif of many frames on a large screen", [{"type": "video_url", "video_url": {"url": data_url(
            gif_with_frames((5000, 5000), [(0, 0, 1, 1)] * 200), gif)}}]),
        ("apng of many large frames", [{"type": "video_url", "video_url": {"url": data_url(
            apng_with_frames((4000, 4000), 40))}}]),
        ("animated webp of many large frames", [{"type": "video_url", "video_url": {"url": data_url(
            webp_with_frames((3000, 3000), 60), "image/webp")}}]),
        ("mpo with a large second picture", [{"type": "video_url", "video_url": {"url": data_url(
            saved([Image.new("L", (16, 16)), Image.new("L", (6000, 6000))], "MPO", quality=1), "image/jpeg")}}]),
        ("huge palette png", [image_part(_png(Image.new("P", (5656, 5656), 7)), detail="high")]),
        ("16-bit png", [image_part(_png(Image.new("I;16", (5656, 5656), 40_000)), detail="high")]),
        ("1-bit png", [image_part(one_bit, detail="high")]),
        # 2: a 32M-pixel first frame and 31 1x1 frames: each frame resized up to the first's size
        ("video of a large frame and tiny frames", [{"type": "video", "video": [data_url(one_bit)] +
                                                     [data_url(tiny)] * 31, "fps": 2}]),
        # 3: 69-byte images scaled up to their budget: 29.5 MiB of float32 each at the most detail
        ("tiny images at high detail", [image_part(tiny, detail="high") for _ in range(16)]),
        ("tiny images and four videos", [image_part(tiny, detail="high") for _ in range(8)] +
         [{"type": "video", "video": [data_url(tiny)] * 32, "fps": 2} for _ in range(4)]),
    ]


@st.composite
def media_cases(draw) -> list[dict]:
    """Content parts of a hostile media request for the fuzz campaign: animated files with canvases, offsets and
    frame counts around the bounds, large and odd-mode stills, many tiny images, damaged bytes of each."""
    from PIL import Image

    side = st.one_of(st.integers(1, 64), st.sampled_from([1, 2, 47, 48, 1500, 4000, 5656, 5657, 6000]))
    kind = draw(st.sampled_from(["gif", "apng", "webp", "still", "tiny", "frames"]))
    detail = draw(st.sampled_from(["low", "auto", "high"]))
    if kind == "gif":
        n = draw(st.integers(1, 40))
        frames = [(draw(st.integers(0, 7000)), draw(st.integers(0, 7000)), draw(st.integers(1, 16)),
                   draw(st.integers(1, 16))) for _ in range(min(n, 4))] * (n // min(n, 4) or 1)
        data, mime = gif_with_frames((draw(side), draw(side)), frames), "image/gif"
    elif kind == "apng":
        data, mime = apng_with_frames((draw(side), draw(side)), draw(st.integers(1, 64))), "image/png"
    elif kind == "webp":
        data, mime = webp_with_frames((draw(side), draw(side)), draw(st.integers(1, 64))), "image/webp"
    elif kind == "still":
        mode = draw(st.sampled_from(["1", "L", "P", "I;16", "RGBA", "RGB"]))
        w, h = draw(side), draw(side)
        if w * h > 40_000_000:
            w = 40_000_000 // h
        data, mime = _png(Image.new(mode, (w, h))), "image/png"
    elif kind == "tiny":
        data = _png(Image.new("RGB", (draw(side) % 64 + 1, 1)))
        return [image_part(data, "image/png", detail) for _ in range(draw(st.integers(1, 16)))]
    else:  # frames of a video: a large first and tiny rest
        first = _png(Image.new("1", (draw(side), draw(side))))
        tiny = _png(Image.new("RGB", (1, 1)))
        return [{"type": "video", "video": [data_url(first)] + [data_url(tiny)] * draw(st.integers(0, 40))}]
    if draw(st.booleans()):  # damaged: cut short, or bytes flipped
        cut = draw(st.integers(1, len(data)))
        data = data[:cut] if draw(st.booleans()) else bytes(b ^ 0x5A if i % 97 == cut % 97 else b
                                                            for i, b in enumerate(data))
    if draw(st.booleans()):
        return [{"type": "video_url", "video_url": {"url": data_url(data, mime)}}]
    return [image_part(data, mime, detail)]
