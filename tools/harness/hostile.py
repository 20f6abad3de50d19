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
          "response_format", "tool_choice", "parallel_tool_calls", "speculation", "user"]

numbers = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.sampled_from(HUGE),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(ODD_FLOATS),
                    st.floats(0, 2))
texts = st.one_of(st.text(max_size=40), st.sampled_from(TEXT_EDGES))
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
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
