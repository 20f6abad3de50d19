"""A `provider generate` job as JSON: the shape the command builds and the daemon's control socket reads
(`POST /provider/v1/generate`, provider/local/cli_jobs.py), turned into a `Job` by one function on both sides,
and the telemetry line the command prints from a finished job's JSON."""

from __future__ import annotations

from typing import Any

from .content import check_text
from .jobs import Job, SamplingParams
from .types import Cause, JobError

JOB_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "speculation",
                        "json_schema", "schema_name"})
MAX_MODEL_NAME = 4096
MAX_MESSAGES = 4096


def _invalid(param: str, rule: str) -> JobError:
    return JobError(Cause.INVALID_REQUEST, f"{param} {rule}", param)


def job_of(body: Any, job_id: str, max_tokens_limit: int | None = None) -> Job:
    """A generate job from its JSON shape: {model, prompt (raw, no chat template) | messages, max_tokens,
    temperature, top_p, seed, speculation, json_schema, schema_name}. Every value is taken as hostile (the
    daemon reads it from a socket); a bad one is a JobError (invalid_request) naming the field."""
    from .constraints import OutputRules, ResponseFormat, short

    if not isinstance(body, dict):
        raise _invalid("job", "must be a JSON object")
    unknown = sorted(k for k in body if k not in JOB_FIELDS)
    if unknown:
        known = ", ".join(sorted(JOB_FIELDS))
        raise _invalid(str(unknown[0])[:64], f"is not a field of a generate job; known: {known}")
    model = body.get("model", "")
    if not isinstance(model, str) or len(model) > MAX_MODEL_NAME:
        raise _invalid("model", f"must be a string of at most {MAX_MODEL_NAME} characters")
    check_text("model", model)
    sampling = SamplingParams(max_tokens=body.get("max_tokens", 256), temperature=body.get("temperature", 0.0),
                              top_p=body.get("top_p", 1.0), seed=body.get("seed"))
    if max_tokens_limit is not None and sampling.max_tokens > max_tokens_limit:
        raise _invalid("max_tokens", f"must be at most {max_tokens_limit} on this node (max_tokens_limit), "
                                     f"got {short(sampling.max_tokens)}")
    rules = OutputRules()
    if body.get("json_schema") is not None:
        rules = OutputRules(ResponseFormat("json_schema", body["json_schema"], body.get("schema_name", "schema")))
    elif "schema_name" in body:
        raise _invalid("schema_name", "needs json_schema")
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
            raise _invalid("messages", f"must be a non-empty array of at most {MAX_MESSAGES} messages")
        if not all(isinstance(m, dict) for m in messages):
            raise _invalid("messages", "must hold objects ({role, content})")
        messages = tuple(messages)
    return Job(job_id, model, sampling, prompt=body.get("prompt"), messages=messages,
               speculation=body.get("speculation", "auto"), rules=rules)


def summary_of(finish_reason: str, usage: dict[str, Any], telemetry: dict[str, Any]) -> str:
    """The telemetry line, from the job's usage and telemetry as JSON (`Usage.as_dict`, `Telemetry.as_dict`)."""
    t, s = telemetry, telemetry["speculation"]
    parts = [f"{usage['completion_tokens']} tokens, finish {finish_reason}"]
    if t.get("ttft_ms") is not None:
        parts.append(f"ttft {t['ttft_ms']:.0f} ms")
    if t.get("decode_tokens_per_s") is not None:
        parts.append(f"{t['decode_tokens_per_s']:.1f} tok/s")
    if s["mode"] != "off":
        parts.append(f"speculation {s['mode']} k={s['k']}: acceptance {s['acceptance_rate']:.2f}, "
                     f"{s['tokens_per_target_forward']:.2f} tokens per target forward")
    else:
        parts.append(f"speculation off ({s['reason']})")
    profile = (s.get("decision") or {}).get("profile")  # auto decided from costs kept from an earlier run, or now
    if profile is not None:
        parts.append(f"costs {'from the kept profile' if profile['source'] == 'file' else 'measured'} "
                     f"{profile['measured_at']}")
    return "; ".join(parts)
