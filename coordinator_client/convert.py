"""proto <-> Job/Event translation. Pure: no I/O, no MLX."""

from __future__ import annotations

import dataclasses
import json

from provider.constraints import (MAX_SCHEMA_BYTES, MAX_TOOLS, TOOL_CHOICE_MODES, ConstraintError, OutputRules,
                                  ResponseFormat, Tool, ToolChoice)
from provider.content import IMAGE_MEDIA, IMAGE_PART, MAX_IMAGES, ImageInput
from provider.jobs import (
    MAX_PROMPT_IDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_COMMITMENT_BYTES, Claim, Job, JobError, PrefixScope,
    SamplingParams, resolve_max_tokens,
)
from provider.outputs import (
    GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER, Done, Error, Proof, ToolCall, Tokens, Usage,
)
from provider.types import Cause, Policy

from provider.telemetry import Telemetry
from provider.proofs.verdicts import Tolerance, VerdictSummary

from .pb import provider_pb2 as pb
from .sealed_errors import sealed_message
from .sealing import JobKeys, padded

MAX_JOB_ID = 128
# Messages, their content parts and their tool calls together, in one chat. The local API's body bound holds
# this count; a 64 MiB frame would hold eight million empty messages, each a dict once converted.
MAX_CHAT_ITEMS = 1 << 16
MAX_CACHE_SCOPE = 128

POLICY = {pb.SPECULATION_POLICY_AUTO: Policy.AUTO, pb.SPECULATION_POLICY_ON: Policy.ON,
          pb.SPECULATION_POLICY_OFF: Policy.OFF}
CAUSE_TO_PB = {
    Cause.INVALID_REQUEST: pb.ERROR_CAUSE_INVALID_REQUEST,
    Cause.UNKNOWN_MODEL: pb.ERROR_CAUSE_UNKNOWN_MODEL,
    Cause.CONTEXT_LENGTH_EXCEEDED: pb.ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED,
    Cause.MODEL_LOAD_FAILED: pb.ERROR_CAUSE_MODEL_LOAD_FAILED,
    Cause.INSUFFICIENT_MEMORY: pb.ERROR_CAUSE_INSUFFICIENT_MEMORY,
    Cause.SPECULATION_UNAVAILABLE: pb.ERROR_CAUSE_SPECULATION_UNAVAILABLE,
    Cause.OVERLOADED: pb.ERROR_CAUSE_OVERLOADED,
    Cause.DRAINING: pb.ERROR_CAUSE_DRAINING,
    Cause.COORDINATOR_LOST: pb.ERROR_CAUSE_COORDINATOR_LOST,
    Cause.DEADLINE_EXCEEDED: pb.ERROR_CAUSE_DEADLINE_EXCEEDED,
    Cause.DUPLICATE_JOB: pb.ERROR_CAUSE_DUPLICATE_JOB,
    Cause.INTERNAL: pb.ERROR_CAUSE_INTERNAL,
    Cause.WEIGHTS_MISMATCH: pb.ERROR_CAUSE_WEIGHTS_MISMATCH,
    Cause.SEALING_FAILED: pb.ERROR_CAUSE_SEALING_FAILED,
    Cause.GROUP_LOST: pb.ERROR_CAUSE_GROUP_LOST,
}
assert set(CAUSE_TO_PB) == set(Cause), "every cause needs a wire value"


def valid_job_id(job_id: str) -> bool:
    return 0 < len(job_id) <= MAX_JOB_ID


def check_job_id(job_id: str) -> None:
    """First of all, before a sealed body is opened (its keys and associated data hash the id)."""
    if not valid_job_id(job_id):
        raise JobError(Cause.INVALID_REQUEST, f"job_id must be 1 to {MAX_JOB_ID} characters", "job_id")


def _invalid(message: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, message)


def check_counts(req: pb.JobRequest, max_tokens_limit: int = 1 << 20) -> None:
    """Every repeated field's length against its bound, before any element becomes a Python object: `len` of a
    repeated field is free, and building a tuple of a 15 MiB frame's prompt ids held 122 MiB. The bounds are the
    Job's (the local API's), and MAX_CHAT_ITEMS for a chat."""
    for param, n, limit in (("prompt", len(req.prompt_ids.ids), MAX_PROMPT_IDS),
                            ("stop", len(req.stop), MAX_STOP_STRINGS),
                            ("stop_token_ids", len(req.stop_token_ids), MAX_STOP_TOKEN_IDS),
                            ("tools", len(req.tools), MAX_TOOLS),
                            ("chat.messages", len(req.chat.messages), MAX_CHAT_ITEMS),
                            ("verify.output_ids", len(req.verify.output_ids), max_tokens_limit)):
        if n > limit:
            raise JobError(Cause.INVALID_REQUEST, f"{param} may hold at most {limit} items, got {n}", param)
    items = sum(1 + len(m.parts) + len(m.tool_calls) for m in req.chat.messages)
    if items > MAX_CHAT_ITEMS:
        raise JobError(Cause.INVALID_REQUEST, f"chat may hold at most {MAX_CHAT_ITEMS} messages, content parts and "
                       f"tool calls together, got {items}", "chat.messages")


def job_from_request(req: pb.JobRequest, *, max_tokens_limit: int, default_max_tokens: int,
                     sealed: bool = False) -> Job:
    """Validate a JobRequest and build the Job; a bad field raises JobError(INVALID_REQUEST) naming it.
    The value bounds are SamplingParams' and Job's, the same as the local API's; counts come first."""
    check_job_id(req.job_id)
    check_counts(req, max_tokens_limit)
    which = req.WhichOneof("input")
    if which is None:
        raise _invalid("the job has neither chat messages nor a prompt")
    prompt = messages = prompt_ids = None
    images: list[ImageInput] = []
    if which == "prompt":
        if not req.prompt:
            raise _invalid("prompt is empty")
        prompt = req.prompt
    elif which == "prompt_ids":
        prompt_ids = tuple(req.prompt_ids.ids)  # counted above; the vocabulary is checked when prepared
    else:
        if not req.chat.messages:
            raise _invalid("chat.messages is empty")
        messages = tuple(_message(m, i, images) for i, m in enumerate(req.chat.messages))
    if req.speculation not in POLICY:
        raise _invalid(f"unknown speculation policy {req.speculation}")
    s = req.sampling
    present = {name: getattr(s, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed")
               if s.HasField(name)}
    if req.prompt_logprobs and not req.HasField("logprobs"):
        raise _invalid("prompt_logprobs needs logprobs (how many alternatives per token, 0 to 20)")
    sampling = SamplingParams(
        max_tokens=resolve_max_tokens(req.max_tokens or None, default_max_tokens, max_tokens_limit),
        stop=tuple(req.stop),
        stop_token_ids=tuple(req.stop_token_ids),
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        prompt_logprobs=req.prompt_logprobs,
        **present,
    )
    verify = None
    if req.HasField("verify"):  # bounded by check_counts; each id and the proof checked by Claim, the vocabulary
        if len(req.verify.proof.commitment) > MAX_COMMITMENT_BYTES:  # when prepared
            raise _invalid("verify.proof.commitment is longer than any commitment")
        if not req.max_tokens:  # a claim's length is judged against it: another node's default is not the producer's
            raise _invalid("a verify job names the max_tokens its claim was made under")
        verify = Claim(tuple(req.verify.output_ids), proof_from_pb(req.verify.proof),
                       tolerance_from_pb(req.verify.tolerance) if req.verify.HasField("tolerance") else None)
    if len(req.cache_scope.encode()) > MAX_CACHE_SCOPE:
        raise _invalid(f"cache_scope has at most {MAX_CACHE_SCOPE} bytes")
    # The coordinator's tenants apart from the local API's, and from each other; only a named tenant's unsealed
    # prompts go to disk; a sealed job's are not kept at all, nor is anything kept served to it.
    scope = PrefixScope("coordinator:" + req.cache_scope, to_disk=bool(req.cache_scope) and not sealed, kept=not sealed)
    return Job(id=req.job_id, model=req.model, sampling=sampling, prompt=prompt, messages=messages,
               prompt_ids=prompt_ids, speculation=POLICY[req.speculation], rules=output_rules(req),
               images=tuple(images), verify=verify, prefix_scope=scope)


def _message(m: pb.ChatMessage, i: int, images: list[ImageInput]) -> dict:
    out = {"role": m.role, "content": _content(m, i, images) if m.parts else m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _content(m: pb.ChatMessage, i: int, images: list[ImageInput]) -> list[dict]:
    """Parts off the wire: text and images in order; each image's bounds are Job's, its decoding the node's."""
    where = f"chat.messages[{i}]"
    if m.content:
        raise JobError(Cause.INVALID_REQUEST, f"{where}: content must be empty when parts are given", where)
    out = []
    for j, part in enumerate(m.parts):
        if part.WhichOneof("part") == "text":
            out.append({"type": "text", "text": part.text})
        elif part.WhichOneof("part") == "image":
            image, at = part.image, f"{where}.parts[{j}]"
            if image.mime_type and image.mime_type.lower() not in IMAGE_MEDIA:
                raise JobError(Cause.INVALID_REQUEST, f"{at}.image.mime_type must be one of {', '.join(IMAGE_MEDIA)}",
                               at)
            if len(images) == MAX_IMAGES:  # before copying one more image's bytes
                raise JobError(Cause.INVALID_REQUEST, f"messages may hold at most {MAX_IMAGES} images", "messages")
            images.append(ImageInput(image.data, image.detail or "auto", at))
            out.append(dict(IMAGE_PART))
        else:
            raise JobError(Cause.INVALID_REQUEST, f"{where}.parts[{j}] is empty", where)
    return out


def output_rules(req: pb.JobRequest) -> OutputRules:
    """response_format, tools and tool_choice off the wire; OutputRules checks every value (the local API's
    bounds). Schemas arrive as JSON text: bounded in bytes before they are parsed."""
    rf = req.response_format if req.HasField("response_format") else None
    tools = tuple(Tool(t.name, _schema("tools", t.parameters_json or '{"type": "object", "properties": {}}'),
                       t.description) for t in req.tools)
    choice = req.tool_choice or ("auto" if tools else "none")
    named = choice not in TOOL_CHOICE_MODES
    return OutputRules(
        None if rf is None or not rf.type else
        ResponseFormat(rf.type, _schema("response_format", rf.schema_json) if rf.type == "json_schema" else None,
                       rf.schema_name),
        tools, ToolChoice("function", choice) if named else ToolChoice(choice),
        req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True)


def _schema(param: str, text: str) -> dict:
    if len(text) > MAX_SCHEMA_BYTES:
        raise ConstraintError(param, f"{param}: a schema must be at most {MAX_SCHEMA_BYTES} bytes")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ConstraintError(param, f"{param}: the schema is not valid JSON") from None


def chunk_body(batch: list[Tokens]) -> pb.TokenChunk:
    """What coalesced token events say: text, token ids, tool calls, logprobs (a scored prompt's on the first)."""
    prompt = next((ev.prompt_logprobs for ev in batch if ev.prompt_logprobs), ())
    return pb.TokenChunk(text="".join(ev.text for ev in batch), token_ids=[t for ev in batch for t in ev.token_ids],
                         tool_calls=tool_calls_to_pb([c for ev in batch for c in ev.tool_calls]),
                         logprobs=logprobs_to_pb([lp for ev in batch for lp in ev.logprobs]),
                         prompt_logprobs=logprobs_to_pb(prompt))


def chunk_frame(job_id: str, seq: int, body: pb.TokenChunk, keys: JobKeys | None = None) -> pb.ProviderFrame:
    """One TokenChunk; its body sealed back to the sender for a sealed job, padded to the bucket first (a
    review matched a sealed job's chunk lengths against a guessed prompt's, chunk by chunk)."""
    if keys is not None:
        return pb.ProviderFrame(token_chunk=pb.TokenChunk(job_id=job_id, seq=seq,
                                                          sealed=keys.seal_chunk(job_id, seq, padded(body))))
    chunk = pb.TokenChunk(job_id=job_id, seq=seq)
    chunk.MergeFrom(body)
    return pb.ProviderFrame(token_chunk=chunk)


def logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=lp.token, text=lp.text, logprob=lp.logprob, raw=lp.raw,
                            top=[pb.TopLogprob(token=t, text=text, logprob=v, raw=raw) for t, text, v, raw in lp.top])
            for lp in lps]


def tool_calls_to_pb(calls: list[ToolCall]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def telemetry_to_pb(t: Telemetry) -> pb.Telemetry:
    out = pb.Telemetry(queue_ms=t.queue_ms, total_ms=t.total_ms, peak_memory_bytes=t.peak_memory_bytes,
                       finish_reason=t.finish_reason.value, constraint=t.constraint or "",
                       prefix_tier=t.prefix_tier)
    for name in ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "mask_ms_per_token"):
        if getattr(t, name) is not None:  # optional on the wire: absent, not zero, when unknown
            setattr(out, name, getattr(t, name))
    spec = t.speculation.as_dict()
    decision = spec.pop("decision", None)
    out.speculation.CopyFrom(pb.SpeculationTelemetry(**{k: v for k, v in spec.items()
                                                        if k in pb.SpeculationTelemetry.DESCRIPTOR.fields_by_name}))
    if decision:
        out.speculation.decision.CopyFrom(decision_to_pb(decision))
    return out


def decision_to_pb(d: dict) -> pb.SpeculationDecision:
    speedups = d["expected_speedup"]
    return pb.SpeculationDecision(k=d["k"], acceptance=d["acceptance"],
                                  expected_speedup=[speedups[k] for k in sorted(speedups, key=int)])


def usage_to_pb(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    total_tokens=u.total_tokens, cached_prompt_tokens=u.cached_prompt_tokens)


PROOF_SAMPLER_TO_PB = {GREEDY_SAMPLER: pb.PROOF_SAMPLER_GREEDY, REPLAYABLE_SAMPLER: pb.PROOF_SAMPLER_REPLAYABLE,
                       SPECULATIVE_SAMPLER: pb.PROOF_SAMPLER_SPECULATIVE}
PROOF_SAMPLER_FROM_PB = {v: k for k, v in PROOF_SAMPLER_TO_PB.items()}


def proof_to_pb(proof: Proof | None) -> pb.Proof | None:
    if proof is None:
        return None
    out = pb.Proof(commitment=proof.commitment or b"", sampler=PROOF_SAMPLER_TO_PB[proof.sampler])
    if proof.seed is not None:
        out.seed = proof.seed
    if proof.end_token is not None:
        out.end_token = proof.end_token
    return out


def proof_from_pb(proof: pb.Proof) -> Proof:
    """A Proof as a verifier reads it; JobError(INVALID_REQUEST) for a sampler it does not know."""
    if proof.sampler not in PROOF_SAMPLER_FROM_PB:
        raise JobError(Cause.INVALID_REQUEST, "the proof names no sampler this node knows", "proof")
    return Proof(proof.commitment or None, PROOF_SAMPLER_FROM_PB[proof.sampler],
                 proof.seed if proof.HasField("seed") else None,
                 proof.end_token if proof.HasField("end_token") else None)


def tolerance_to_pb(t: Tolerance) -> pb.Tolerance:
    return pb.Tolerance(**dataclasses.asdict(t))


def tolerance_from_pb(t: pb.Tolerance) -> Tolerance:
    """As a verifier takes it: jobs.Claim holds it to the loosest profile this node knows."""
    return Tolerance(**{f.name: getattr(t, f.name) for f in dataclasses.fields(Tolerance)})


def done_frame(ev: Done) -> pb.ProviderFrame:
    frame = pb.ProviderFrame(job_done=pb.JobDone(
        job_id=ev.job_id, finish_reason=ev.finish_reason.value, usage=usage_to_pb(ev.usage),
        telemetry=telemetry_to_pb(ev.telemetry)))
    if ev.verdict is not None:
        frame.job_done.verdict.CopyFrom(verdict_to_pb(ev.verdict))
    return frame


def verdict_to_pb(v: VerdictSummary) -> pb.Verdict:
    out = pb.Verdict(passed=v.passed, reason=v.reason, tokens=v.tokens, chunks=v.chunks, ties=v.ties)
    for name in ("first_failure", "min_overlap", "max_rel_err", "max_gap"):
        if getattr(v, name) is not None:
            setattr(out, name, getattr(v, name))
    for c in v.per_chunk:
        out.per_chunk.add(start=c.start, overlap=c.overlap, max_rel_err=c.max_rel_err, mean_rel_err=c.mean_rel_err,
                          ties=c.ties,
                          **({} if c.max_gap is None else {"max_gap": c.max_gap}))
    return out


def error_frame(job_id: str, cause: Cause, message: str, usage: Usage | None = None, *, sealed: bool = False,
                param: str | None = None) -> pb.ProviderFrame:
    """A JobError; a sealed job's carries its cause's fixed message instead (sealed_errors), never a value."""
    text = sealed_message(cause, message, param) if sealed else message
    frame = pb.ProviderFrame(job_error=pb.JobError(job_id=job_id, cause=CAUSE_TO_PB[cause], message=text))
    if usage is not None:
        frame.job_error.usage.CopyFrom(usage_to_pb(usage))
    return frame


def event_error_frame(ev: Error, *, sealed: bool = False) -> pb.ProviderFrame:
    return error_frame(ev.job_id, ev.cause, ev.message, sealed=sealed, param=ev.param)
