"""The words every layer shares: ids, policies, modes, reasons, causes. A leaf: it imports nothing of the
project, so decisions (provider.speculation, provider.memory) and both transports can use it without pulling
in the engine, and the import graph stays acyclic."""

from __future__ import annotations

import enum
from typing import NewType

JobId = NewType("JobId", str)  # as the front end received it (an HTTP request id, a coordinator job id)
ModelId = NewType("ModelId", str)  # a served model's canonical id (provider.models.catalog)


class Policy(str, enum.Enum):
    """Speculation policy, per node and per job."""

    AUTO = "auto"  # speculate when eligible and memory allows
    ON = "on"  # fail loudly, with the reason, when a job cannot speculate
    OFF = "off"


class SpecMode(str, enum.Enum):
    OFF = "off"
    DRAFT = "draft"  # a smaller model with the same vocabulary proposes k tokens
    MTP = "mtp"  # a Gemma 4 assistant reads the target's K/V and hidden state and proposes k tokens


class SpecReason(enum.StrEnum):
    """Why a job speculates or not: the stable reasons telemetry carries. A StrEnum, so each member is
    its text wherever it is compared, formatted or serialised."""

    OK = "ok"
    NOT_MTP_CAPABLE = "not_mtp_capable"  # the target cannot use an assistant, and no draft model pairs with it
    NO_DRAFTER = "no_drafter"  # it could, but no drafter is configured or found (or the one named does not pair)
    INSUFFICIENT_HEADROOM = "insufficient_headroom"  # the drafter does not fit beside the target
    POLICY_OFF = "policy_off"
    BATCH_TOO_LARGE = "batch_too_large"  # the model runs speculation_max_batch jobs already: plain batch decoding
    NOT_PROFITABLE = "not_profitable"  # auto: on this machine, at the acceptance seen, no k beats plain decoding
    PROFILE_PENDING = "profile_pending"  # auto: the pair's costs are being measured (first load on this machine)
    INELIGIBLE_LOGITS_PROCESSORS = "ineligible_request:logits_processors"  # logit_bias or penalties
    INELIGIBLE_SEED = "ineligible_request:seed"  # auto keeps a seeded sampled job on one (plain) path
    INELIGIBLE_PROMPT_LOGPROBS = "ineligible_request:prompt_logprobs"  # a scored prompt (echo) decodes plain
    NOT_STARTED = "not_started"  # the job ended before it ran
    GROUP_MODE = "group_mode"  # the model runs across a node group, whose steps are plain batched steps


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token or a stop string
    LENGTH = "length"  # max_tokens, or the context
    CANCELLED = "cancelled"  # the client left, the coordinator cancelled, the deadline passed, or a drain ran out
    TOOL_CALLS = "tool_calls"  # the model called tools and ended its turn


class Cause(str, enum.Enum):
    """Closed set of reasons a job fails. Front ends map these to HTTP codes or proto enums."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_LOAD_FAILED = "model_load_failed"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    SPECULATION_UNAVAILABLE = "speculation_unavailable"
    OVERLOADED = "overloaded"
    DRAINING = "draining"
    COORDINATOR_LOST = "coordinator_lost"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    DUPLICATE_JOB = "duplicate_job"
    INTERNAL = "internal"
    WEIGHTS_MISMATCH = "weights_mismatch"  # the files do not match a pin (the node's own or the job's)
    SEALING_FAILED = "sealing_failed"  # a sealed job did not open, or came in plaintext where sealing is required
    GROUP_LOST = "group_lost"  # a node group's rank was lost, stalled or diverged: the group stops


class JobError(Exception):
    """A typed failure of one job. The node keeps serving. `param` names the request field at fault, if one is."""

    def __init__(self, cause: Cause, message: str, param: str | None = None):
        super().__init__(message)
        self.cause = cause
        self.message = message
        self.param = param
