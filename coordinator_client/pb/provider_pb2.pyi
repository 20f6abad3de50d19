from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_METAL: _ClassVar[Backend]
    BACKEND_CPU: _ClassVar[Backend]
    BACKEND_CUDA: _ClassVar[Backend]

class NodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATUS_UNSPECIFIED: _ClassVar[NodeStatus]
    NODE_STATUS_IDLE: _ClassVar[NodeStatus]
    NODE_STATUS_BUSY: _ClassVar[NodeStatus]
    NODE_STATUS_DRAINING: _ClassVar[NodeStatus]
    NODE_STATUS_UNHEALTHY: _ClassVar[NodeStatus]

class SpeculationPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_POLICY_AUTO: _ClassVar[SpeculationPolicy]
    SPECULATION_POLICY_ON: _ClassVar[SpeculationPolicy]
    SPECULATION_POLICY_OFF: _ClassVar[SpeculationPolicy]

class ProofSampler(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROOF_SAMPLER_UNSPECIFIED: _ClassVar[ProofSampler]
    PROOF_SAMPLER_GREEDY: _ClassVar[ProofSampler]
    PROOF_SAMPLER_REPLAYABLE: _ClassVar[ProofSampler]
    PROOF_SAMPLER_SPECULATIVE: _ClassVar[ProofSampler]

class ErrorCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CAUSE_UNSPECIFIED: _ClassVar[ErrorCause]
    ERROR_CAUSE_INVALID_REQUEST: _ClassVar[ErrorCause]
    ERROR_CAUSE_UNKNOWN_MODEL: _ClassVar[ErrorCause]
    ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED: _ClassVar[ErrorCause]
    ERROR_CAUSE_MODEL_LOAD_FAILED: _ClassVar[ErrorCause]
    ERROR_CAUSE_INSUFFICIENT_MEMORY: _ClassVar[ErrorCause]
    ERROR_CAUSE_SPECULATION_UNAVAILABLE: _ClassVar[ErrorCause]
    ERROR_CAUSE_OVERLOADED: _ClassVar[ErrorCause]
    ERROR_CAUSE_DRAINING: _ClassVar[ErrorCause]
    ERROR_CAUSE_COORDINATOR_LOST: _ClassVar[ErrorCause]
    ERROR_CAUSE_DEADLINE_EXCEEDED: _ClassVar[ErrorCause]
    ERROR_CAUSE_DUPLICATE_JOB: _ClassVar[ErrorCause]
    ERROR_CAUSE_INTERNAL: _ClassVar[ErrorCause]
    ERROR_CAUSE_WEIGHTS_MISMATCH: _ClassVar[ErrorCause]
    ERROR_CAUSE_SEALING_FAILED: _ClassVar[ErrorCause]
    ERROR_CAUSE_GROUP_LOST: _ClassVar[ErrorCause]
BACKEND_UNSPECIFIED: Backend
BACKEND_METAL: Backend
BACKEND_CPU: Backend
BACKEND_CUDA: Backend
NODE_STATUS_UNSPECIFIED: NodeStatus
NODE_STATUS_IDLE: NodeStatus
NODE_STATUS_BUSY: NodeStatus
NODE_STATUS_DRAINING: NodeStatus
NODE_STATUS_UNHEALTHY: NodeStatus
SPECULATION_POLICY_AUTO: SpeculationPolicy
SPECULATION_POLICY_ON: SpeculationPolicy
SPECULATION_POLICY_OFF: SpeculationPolicy
PROOF_SAMPLER_UNSPECIFIED: ProofSampler
PROOF_SAMPLER_GREEDY: ProofSampler
PROOF_SAMPLER_REPLAYABLE: ProofSampler
PROOF_SAMPLER_SPECULATIVE: ProofSampler
ERROR_CAUSE_UNSPECIFIED: ErrorCause
ERROR_CAUSE_INVALID_REQUEST: ErrorCause
ERROR_CAUSE_UNKNOWN_MODEL: ErrorCause
ERROR_CAUSE_CONTEXT_LENGTH_EXCEEDED: ErrorCause
ERROR_CAUSE_MODEL_LOAD_FAILED: ErrorCause
ERROR_CAUSE_INSUFFICIENT_MEMORY: ErrorCause
ERROR_CAUSE_SPECULATION_UNAVAILABLE: ErrorCause
ERROR_CAUSE_OVERLOADED: ErrorCause
ERROR_CAUSE_DRAINING: ErrorCause
ERROR_CAUSE_COORDINATOR_LOST: ErrorCause
ERROR_CAUSE_DEADLINE_EXCEEDED: ErrorCause
ERROR_CAUSE_DUPLICATE_JOB: ErrorCause
ERROR_CAUSE_INTERNAL: ErrorCause
ERROR_CAUSE_WEIGHTS_MISMATCH: ErrorCause
ERROR_CAUSE_SEALING_FAILED: ErrorCause
ERROR_CAUSE_GROUP_LOST: ErrorCause

class ProviderFrame(_message.Message):
    __slots__ = ("hello", "heartbeat", "job_accepted", "token_chunk", "job_done", "job_error", "pong", "drained", "protocol_error", "model_residency")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    JOB_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    JOB_ERROR_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    job_accepted: JobAccepted
    token_chunk: TokenChunk
    job_done: JobDone
    job_error: JobError
    pong: Pong
    drained: Drained
    protocol_error: ProtocolError
    model_residency: ModelResidency
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., job_accepted: _Optional[_Union[JobAccepted, _Mapping]] = ..., token_chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., job_done: _Optional[_Union[JobDone, _Mapping]] = ..., job_error: _Optional[_Union[JobError, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., drained: _Optional[_Union[Drained, _Mapping]] = ..., protocol_error: _Optional[_Union[ProtocolError, _Mapping]] = ..., model_residency: _Optional[_Union[ModelResidency, _Mapping]] = ...) -> None: ...

class CoordinatorFrame(_message.Message):
    __slots__ = ("challenge", "welcome", "reject", "job_request", "cancel", "drain", "ping", "job_ack", "warm_model", "release_model", "spot_check_result")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    JOB_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    JOB_ACK_FIELD_NUMBER: _ClassVar[int]
    WARM_MODEL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SPOT_CHECK_RESULT_FIELD_NUMBER: _ClassVar[int]
    challenge: Challenge
    welcome: Welcome
    reject: Reject
    job_request: JobRequest
    cancel: Cancel
    drain: Drain
    ping: Ping
    job_ack: JobAck
    warm_model: WarmModel
    release_model: ReleaseModel
    spot_check_result: SpotCheckResult
    def __init__(self, challenge: _Optional[_Union[Challenge, _Mapping]] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., job_request: _Optional[_Union[JobRequest, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., job_ack: _Optional[_Union[JobAck, _Mapping]] = ..., warm_model: _Optional[_Union[WarmModel, _Mapping]] = ..., release_model: _Optional[_Union[ReleaseModel, _Mapping]] = ..., spot_check_result: _Optional[_Union[SpotCheckResult, _Mapping]] = ...) -> None: ...

class Challenge(_message.Message):
    __slots__ = ("nonce", "server_time_ms")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    server_time_ms: int
    def __init__(self, nonce: _Optional[bytes] = ..., server_time_ms: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("registration", "signature")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    registration: bytes
    signature: bytes
    def __init__(self, registration: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("node_id", "protocol_version", "software_version", "backend", "hardware", "memory", "models", "max_concurrent_jobs", "public_key", "nonce", "timestamp_ms", "session_epoch", "sealing_key", "group", "verification")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_JOBS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEALING_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    protocol_version: int
    software_version: str
    backend: Backend
    hardware: Hardware
    memory: MemoryStatus
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    max_concurrent_jobs: int
    public_key: bytes
    nonce: bytes
    timestamp_ms: int
    session_epoch: int
    sealing_key: bytes
    group: NodeGroup
    verification: Verification
    def __init__(self, node_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., software_version: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., max_concurrent_jobs: _Optional[int] = ..., public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., session_epoch: _Optional[int] = ..., sealing_key: _Optional[bytes] = ..., group: _Optional[_Union[NodeGroup, _Mapping]] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("commits", "tolerance")
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    commits: bool
    tolerance: Tolerance
    def __init__(self, commits: _Optional[bool] = ..., tolerance: _Optional[_Union[Tolerance, _Mapping]] = ...) -> None: ...

class Tolerance(_message.Message):
    __slots__ = ("profile", "rel_tol", "min_overlap", "max_mean_err", "tie", "max_tie_share", "floor", "min_ties")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    REL_TOL_FIELD_NUMBER: _ClassVar[int]
    MIN_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_MEAN_ERR_FIELD_NUMBER: _ClassVar[int]
    TIE_FIELD_NUMBER: _ClassVar[int]
    MAX_TIE_SHARE_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    MIN_TIES_FIELD_NUMBER: _ClassVar[int]
    profile: str
    rel_tol: float
    min_overlap: float
    max_mean_err: float
    tie: float
    max_tie_share: float
    floor: float
    min_ties: int
    def __init__(self, profile: _Optional[str] = ..., rel_tol: _Optional[float] = ..., min_overlap: _Optional[float] = ..., max_mean_err: _Optional[float] = ..., tie: _Optional[float] = ..., max_tie_share: _Optional[float] = ..., floor: _Optional[float] = ..., min_ties: _Optional[int] = ...) -> None: ...

class NodeGroup(_message.Message):
    __slots__ = ("ranks", "backend", "rank_memory_bytes", "rank_budget_bytes")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RANK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ranks: int
    backend: str
    rank_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    rank_budget_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[int] = ..., backend: _Optional[str] = ..., rank_memory_bytes: _Optional[_Iterable[int]] = ..., rank_budget_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("machine", "chip", "os", "cpu_cores")
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    machine: str
    chip: str
    os: str
    cpu_cores: int
    def __init__(self, machine: _Optional[str] = ..., chip: _Optional[str] = ..., os: _Optional[str] = ..., cpu_cores: _Optional[int] = ...) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("total_bytes", "budget_bytes", "free_for_load_bytes", "active_bytes", "budget_source")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_FOR_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_SOURCE_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    budget_bytes: int
    free_for_load_bytes: int
    active_bytes: int
    budget_source: str
    def __init__(self, total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., free_for_load_bytes: _Optional[int] = ..., active_bytes: _Optional[int] = ..., budget_source: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "size_bytes", "sha256", "capabilities", "resident", "drafter_sha256")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_SHA256_FIELD_NUMBER: _ClassVar[int]
    id: str
    size_bytes: int
    sha256: str
    capabilities: Capabilities
    resident: bool
    drafter_sha256: str
    def __init__(self, id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., resident: _Optional[bool] = ..., drafter_sha256: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("family", "quantization", "context_length", "mtp_capable", "draft_compatible", "native_mtp_heads", "vision", "speculates_with")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MTP_CAPABLE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_MTP_HEADS_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    SPECULATES_WITH_FIELD_NUMBER: _ClassVar[int]
    family: str
    quantization: str
    context_length: int
    mtp_capable: bool
    draft_compatible: bool
    native_mtp_heads: bool
    vision: bool
    speculates_with: str
    def __init__(self, family: _Optional[str] = ..., quantization: _Optional[str] = ..., context_length: _Optional[int] = ..., mtp_capable: _Optional[bool] = ..., draft_compatible: _Optional[bool] = ..., native_mtp_heads: _Optional[bool] = ..., vision: _Optional[bool] = ..., speculates_with: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("session_id", "session_epoch", "heartbeat_interval_ms", "coordinator_version", "protocol_version", "routing_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_epoch: int
    heartbeat_interval_ms: int
    coordinator_version: str
    protocol_version: int
    routing_key: bytes
    def __init__(self, session_id: _Optional[str] = ..., session_epoch: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., coordinator_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., routing_key: _Optional[bytes] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("reason", "retry_after_s", "permanent")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    retry_after_s: int
    permanent: bool
    def __init__(self, reason: _Optional[str] = ..., retry_after_s: _Optional[int] = ..., permanent: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("status", "resident_models", "active_jobs", "queued_jobs", "memory", "counters", "timestamp_ms", "speculation", "group", "residency", "prefix_hashes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MODELS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_JOBS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_JOBS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    status: NodeStatus
    resident_models: _containers.RepeatedScalarFieldContainer[str]
    active_jobs: int
    queued_jobs: int
    memory: MemoryStatus
    counters: Counters
    timestamp_ms: int
    speculation: _containers.RepeatedCompositeFieldContainer[SpeculationProfile]
    group: NodeGroup
    residency: _containers.RepeatedCompositeFieldContainer[ModelResidency]
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Union[NodeStatus, str]] = ..., resident_models: _Optional[_Iterable[str]] = ..., active_jobs: _Optional[int] = ..., queued_jobs: _Optional[int] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., timestamp_ms: _Optional[int] = ..., speculation: _Optional[_Iterable[_Union[SpeculationProfile, _Mapping]]] = ..., group: _Optional[_Union[NodeGroup, _Mapping]] = ..., residency: _Optional[_Iterable[_Union[ModelResidency, _Mapping]]] = ..., prefix_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmModel(_message.Message):
    __slots__ = ("model", "keep_alive", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    keep_alive: str
    request_id: int
    def __init__(self, model: _Optional[str] = ..., keep_alive: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class ReleaseModel(_message.Message):
    __slots__ = ("model", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: int
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class ModelResidency(_message.Message):
    __slots__ = ("request_id", "model", "state", "unload_at_ms", "pinned", "keep_alive_s", "active_jobs", "error_cause", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_AT_MS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_JOBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CAUSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    model: str
    state: str
    unload_at_ms: int
    pinned: bool
    keep_alive_s: float
    active_jobs: int
    error_cause: ErrorCause
    error_message: str
    def __init__(self, request_id: _Optional[int] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., unload_at_ms: _Optional[int] = ..., pinned: _Optional[bool] = ..., keep_alive_s: _Optional[float] = ..., active_jobs: _Optional[int] = ..., error_cause: _Optional[_Union[ErrorCause, str]] = ..., error_message: _Optional[str] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("jobs_completed", "jobs_failed", "jobs_cancelled", "tokens_generated", "spec_drafted_tokens", "spec_accepted_tokens", "spec_target_forwards")
    JOBS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    JOBS_FAILED_FIELD_NUMBER: _ClassVar[int]
    JOBS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    jobs_completed: int
    jobs_failed: int
    jobs_cancelled: int
    tokens_generated: int
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    spec_target_forwards: int
    def __init__(self, jobs_completed: _Optional[int] = ..., jobs_failed: _Optional[int] = ..., jobs_cancelled: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_target_forwards: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "mime_type", "detail")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    detail: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "schema_name", "schema_json")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    type: str
    schema_name: str
    schema_json: str
    def __init__(self, type: _Optional[str] = ..., schema_name: _Optional[str] = ..., schema_json: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id", "model", "chat", "prompt", "prompt_ids", "sampling", "max_tokens", "stop", "stop_token_ids", "speculation", "deadline_ms", "model_sha256", "sealed", "response_format", "tools", "tool_choice", "parallel_tool_calls", "logprobs", "prompt_logprobs", "verify", "cache_scope")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    chat: ChatMessages
    prompt: str
    prompt_ids: PromptTokens
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: SpeculationPolicy
    deadline_ms: int
    model_sha256: str
    sealed: Sealed
    response_format: ResponseFormat
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    parallel_tool_calls: bool
    logprobs: int
    prompt_logprobs: bool
    verify: VerifyInput
    cache_scope: str
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[PromptTokens, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[_Union[SpeculationPolicy, str]] = ..., deadline_ms: _Optional[int] = ..., model_sha256: _Optional[str] = ..., sealed: _Optional[_Union[Sealed, _Mapping]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., verify: _Optional[_Union[VerifyInput, _Mapping]] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class VerifyInput(_message.Message):
    __slots__ = ("output_ids", "proof", "tolerance")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    proof: Proof
    tolerance: Tolerance
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ..., tolerance: _Optional[_Union[Tolerance, _Mapping]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("passed", "reason", "first_failure", "tokens", "chunks", "min_overlap", "max_rel_err", "max_gap", "ties", "per_chunk")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MIN_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_ERR_FIELD_NUMBER: _ClassVar[int]
    MAX_GAP_FIELD_NUMBER: _ClassVar[int]
    TIES_FIELD_NUMBER: _ClassVar[int]
    PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    reason: str
    first_failure: int
    tokens: int
    chunks: int
    min_overlap: float
    max_rel_err: float
    max_gap: float
    ties: int
    per_chunk: _containers.RepeatedCompositeFieldContainer[ChunkVerdict]
    def __init__(self, passed: _Optional[bool] = ..., reason: _Optional[str] = ..., first_failure: _Optional[int] = ..., tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., min_overlap: _Optional[float] = ..., max_rel_err: _Optional[float] = ..., max_gap: _Optional[float] = ..., ties: _Optional[int] = ..., per_chunk: _Optional[_Iterable[_Union[ChunkVerdict, _Mapping]]] = ...) -> None: ...

class SpotCheckResult(_message.Message):
    __slots__ = ("job_id", "passed", "reason", "first_failure")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    passed: bool
    reason: str
    first_failure: int
    def __init__(self, job_id: _Optional[str] = ..., passed: _Optional[bool] = ..., reason: _Optional[str] = ..., first_failure: _Optional[int] = ...) -> None: ...

class ChunkVerdict(_message.Message):
    __slots__ = ("start", "overlap", "max_rel_err", "max_gap", "ties", "mean_rel_err")
    START_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MAX_REL_ERR_FIELD_NUMBER: _ClassVar[int]
    MAX_GAP_FIELD_NUMBER: _ClassVar[int]
    TIES_FIELD_NUMBER: _ClassVar[int]
    MEAN_REL_ERR_FIELD_NUMBER: _ClassVar[int]
    start: int
    overlap: float
    max_rel_err: float
    max_gap: float
    ties: int
    mean_rel_err: float
    def __init__(self, start: _Optional[int] = ..., overlap: _Optional[float] = ..., max_rel_err: _Optional[float] = ..., max_gap: _Optional[float] = ..., ties: _Optional[int] = ..., mean_rel_err: _Optional[float] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Sealed(_message.Message):
    __slots__ = ("sender_key", "ciphertext")
    SENDER_KEY_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    sender_key: bytes
    ciphertext: bytes
    def __init__(self, sender_key: _Optional[bytes] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class JobAccepted(_message.Message):
    __slots__ = ("job_id", "model", "prompt_tokens", "seal_salt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEAL_SALT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    prompt_tokens: int
    seal_salt: bytes
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., seal_salt: _Optional[bytes] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("job_id", "seq", "text", "token_ids", "sealed", "tool_calls", "logprobs", "prompt_logprobs", "padding")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sealed: bytes
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    padding: bytes
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sealed: _Optional[bytes] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., padding: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "text", "logprob", "top", "raw")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    raw: bytes
    def __init__(self, token: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., raw: _Optional[bytes] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "text", "logprob", "raw")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: str
    logprob: float
    raw: bytes
    def __init__(self, token: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., raw: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SpeculationTelemetry(_message.Message):
    __slots__ = ("mode", "reason", "k", "rounds", "drafted", "accepted", "acceptance_rate", "target_forwards", "tokens_per_target_forward", "draft_ms", "verify_ms", "sampling_scheme", "decision", "mean_batch", "grammar_steered")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_TARGET_FORWARD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SCHEME_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_STEERED_FIELD_NUMBER: _ClassVar[int]
    mode: str
    reason: str
    k: int
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float
    target_forwards: int
    tokens_per_target_forward: float
    draft_ms: float
    verify_ms: float
    sampling_scheme: str
    decision: SpeculationDecision
    mean_batch: float
    grammar_steered: int
    def __init__(self, mode: _Optional[str] = ..., reason: _Optional[str] = ..., k: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., target_forwards: _Optional[int] = ..., tokens_per_target_forward: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., sampling_scheme: _Optional[str] = ..., decision: _Optional[_Union[SpeculationDecision, _Mapping]] = ..., mean_batch: _Optional[float] = ..., grammar_steered: _Optional[int] = ...) -> None: ...

class SpeculationDecision(_message.Message):
    __slots__ = ("k", "acceptance", "expected_speedup")
    K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    k: int
    acceptance: float
    expected_speedup: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, k: _Optional[int] = ..., acceptance: _Optional[float] = ..., expected_speedup: _Optional[_Iterable[float]] = ...) -> None: ...

class SpeculationProfile(_message.Message):
    __slots__ = ("model", "plain_token_ms", "round_ms", "greedy", "sampled", "rows", "plain_rows_ms", "round_rows_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_ROWS_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ROWS_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    plain_token_ms: float
    round_ms: _containers.RepeatedScalarFieldContainer[float]
    greedy: SpeculationDecision
    sampled: SpeculationDecision
    rows: int
    plain_rows_ms: float
    round_rows_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model: _Optional[str] = ..., plain_token_ms: _Optional[float] = ..., round_ms: _Optional[_Iterable[float]] = ..., greedy: _Optional[_Union[SpeculationDecision, _Mapping]] = ..., sampled: _Optional[_Union[SpeculationDecision, _Mapping]] = ..., rows: _Optional[int] = ..., plain_rows_ms: _Optional[float] = ..., round_rows_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("ttft_ms", "queue_ms", "total_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes", "finish_reason", "speculation", "constraint", "mask_ms_per_token", "prefix_tier")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    MASK_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TIER_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    queue_ms: float
    total_ms: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes: int
    finish_reason: str
    speculation: SpeculationTelemetry
    constraint: str
    mask_ms_per_token: float
    prefix_tier: str
    def __init__(self, ttft_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., finish_reason: _Optional[str] = ..., speculation: _Optional[_Union[SpeculationTelemetry, _Mapping]] = ..., constraint: _Optional[str] = ..., mask_ms_per_token: _Optional[float] = ..., prefix_tier: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("chunks", "token_ids_sha256", "text", "token_ids", "sealed", "tool_calls", "seal_salt", "logprobs", "prompt_logprobs", "proof", "sealed_proof", "proof_sha256", "padding")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    SEAL_SALT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SEALED_PROOF_FIELD_NUMBER: _ClassVar[int]
    PROOF_SHA256_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    token_ids_sha256: bytes
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sealed: bytes
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    seal_salt: bytes
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    proof: Proof
    sealed_proof: bytes
    proof_sha256: bytes
    padding: bytes
    def __init__(self, chunks: _Optional[int] = ..., token_ids_sha256: _Optional[bytes] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sealed: _Optional[bytes] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., seal_salt: _Optional[bytes] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ..., sealed_proof: _Optional[bytes] = ..., proof_sha256: _Optional[bytes] = ..., padding: _Optional[bytes] = ...) -> None: ...

class Proof(_message.Message):
    __slots__ = ("commitment", "sampler", "seed", "end_token")
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    commitment: bytes
    sampler: ProofSampler
    seed: int
    end_token: int
    def __init__(self, commitment: _Optional[bytes] = ..., sampler: _Optional[_Union[ProofSampler, str]] = ..., seed: _Optional[int] = ..., end_token: _Optional[int] = ...) -> None: ...

class JobDone(_message.Message):
    __slots__ = ("job_id", "finish_reason", "usage", "telemetry", "completion", "model_sha256", "signature", "signature_layout", "request_sha256", "verdict")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    finish_reason: str
    usage: Usage
    telemetry: Telemetry
    completion: Completion
    model_sha256: str
    signature: bytes
    signature_layout: int
    request_sha256: bytes
    verdict: Verdict
    def __init__(self, job_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ..., model_sha256: _Optional[str] = ..., signature: _Optional[bytes] = ..., signature_layout: _Optional[int] = ..., request_sha256: _Optional[bytes] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("job_id", "cause", "message", "usage", "completion")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    cause: ErrorCause
    message: str
    usage: Usage
    completion: Completion
    def __init__(self, job_id: _Optional[str] = ..., cause: _Optional[_Union[ErrorCause, str]] = ..., message: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobAck(_message.Message):
    __slots__ = ("job_ids",)
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Drained(_message.Message):
    __slots__ = ("jobs_finished",)
    JOBS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    jobs_finished: int
    def __init__(self, jobs_finished: _Optional[int] = ...) -> None: ...

class ProtocolError(_message.Message):
    __slots__ = ("reason", "frame_bytes", "frame_kind")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_KIND_FIELD_NUMBER: _ClassVar[int]
    reason: str
    frame_bytes: int
    frame_kind: str
    def __init__(self, reason: _Optional[str] = ..., frame_bytes: _Optional[int] = ..., frame_kind: _Optional[str] = ...) -> None: ...
