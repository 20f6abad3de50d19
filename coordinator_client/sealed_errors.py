"""What a sealed job's JobError may say in the clear: one fixed message per cause, and the field at fault when it
is a field's name. The node's own messages quote values ("got 'x'", a tool's name, a chat template's complaint),
which helps the sender of a plain job and leaks a sealed one's body to the coordinator that relays the error.
Pure."""

from __future__ import annotations

import re

from provider.types import Cause

from .pb import provider_pb2 as pb

GENERIC = {
    Cause.INVALID_REQUEST: "a field of the sealed request is out of range or malformed",
    Cause.UNKNOWN_MODEL: "this node does not serve the model the job names",
    Cause.CONTEXT_LENGTH_EXCEEDED: "the prompt and max_tokens do not fit the model's context",
    Cause.MODEL_LOAD_FAILED: "the model could not be loaded",
    Cause.INSUFFICIENT_MEMORY: "the job can never fit in this node's memory",
    Cause.SPECULATION_UNAVAILABLE: "speculation ON was asked for and is impossible here",
    Cause.OVERLOADED: "the node's queue is full",
    Cause.DRAINING: "the node is draining and accepts no new jobs",
    Cause.COORDINATOR_LOST: "the coordinator stream died while the job ran; it was cancelled",
    Cause.DEADLINE_EXCEEDED: "the job's deadline passed",
    Cause.DUPLICATE_JOB: "the job id is already in use",
    Cause.INTERNAL: "serving the job failed on the node",
    Cause.WEIGHTS_MISMATCH: "the pinned model_sha256 does not match this node's files",
    # Said about the envelope, never its content, and raised before any of the body is read: kept as it is.
    Cause.SEALING_FAILED: "",
    Cause.GROUP_LOST: "the node group lost a machine while the job ran",
}
assert set(GENERIC) == set(Cause), "every cause needs a message a sealed job may carry"

# A field's name is identifiers and indices ("chat.messages[2].parts[0]", "sampling.top_p"), rooted in a field of
# the request (the JobRequest's, its sampling's, or the name the Job gives one). Anything else may be a value.
_FIELD = re.compile(r"[a-z_]+(\[\d+\])*(\.[a-z_]+(\[\d+\])*)*")
FIELD_ROOTS = frozenset(pb.JobRequest.DESCRIPTOR.fields_by_name) | frozenset(
    pb.SamplingParams.DESCRIPTOR.fields_by_name) | {"messages", "top_logprobs"}


def field_name(param: str | None) -> str | None:
    """`param` if it names a request field, else None."""
    if not param or len(param) > 100 or not _FIELD.fullmatch(param):
        return None
    return param if re.split(r"[.\[]", param, maxsplit=1)[0] in FIELD_ROOTS else None


def sealed_message(cause: Cause, message: str, param: str | None) -> str:
    """The message a sealed job's JobError carries instead of `message`."""
    if cause is Cause.SEALING_FAILED:
        return message
    field = field_name(param)
    return GENERIC[cause] + (f" (field {field})" if field else "")
