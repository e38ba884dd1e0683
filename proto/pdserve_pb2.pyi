from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queue_ms", "bootstrap_ms", "prefill_ms", "transfer_ms", "decode_ms", "ttft_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    bootstrap_ms: float
    prefill_ms: float
    transfer_ms: float
    decode_ms: float
    ttft_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., bootstrap_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "input_ids", "sampling", "stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stream: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "text", "finish_reason", "usage", "timings", "prefill_worker", "decode_worker")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    text: str
    finish_reason: str
    usage: Usage
    timings: StageTimings
    prefill_worker: str
    decode_worker: str
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "room", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_pages_total", "kv_pages_free", "kv_pages_cached", "kv_pages_in_use", "num_inflight", "max_running")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int
    kv_pages_in_use: int
    num_inflight: int
    max_running: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_pages_cached: _Optional[int] = ..., kv_pages_in_use: _Optional[int] = ..., num_inflight: _Optional[int] = ..., max_running: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "bootstrap_addr", "model", "state", "load", "page_size", "max_context_len", "transfer_backend", "transfer_backends", "warmup_s", "session")
    class WarmupSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    bootstrap_addr: str
    model: str
    state: str
    load: WorkerLoad
    page_size: int
    max_context_len: int
    transfer_backend: str
    transfer_backends: _containers.RepeatedScalarFieldContainer[str]
    warmup_s: _containers.ScalarMap[str, float]
    session: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., bootstrap_addr: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., page_size: _Optional[int] = ..., max_context_len: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., transfer_backends: _Optional[_Iterable[str]] = ..., warmup_s: _Optional[_Mapping[str, float]] = ..., session: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker", "secret")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    secret: str
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "lease_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    lease_s: float
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "secret", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: WorkerLoad
    secret: str
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., secret: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    secret: str
    def __init__(self, worker_id: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "room", "decode_addr")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    room: int
    decode_addr: str
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., room: _Optional[int] = ..., decode_addr: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "cached_tokens", "finish_reason", "timings", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cached_tokens: int
    finish_reason: str
    timings: StageTimings
    first_token: TokenChunk
    def __init__(self, request_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., first_token: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "room", "bootstrap_addr")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    room: int
    bootstrap_addr: str
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., room: _Optional[int] = ..., bootstrap_addr: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "finish_reason", "usage", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    finish_reason: str
    usage: Usage
    timings: StageTimings
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("call_id", "prefill", "decode", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    prefill: PrefillRequest
    decode: DecodeRequest
    cancel: bool
    def __init__(self, call_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SessionCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[SessionCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[SessionCall, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("call_id", "prefill", "decode", "end", "code", "details")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    prefill: PrefillResponse
    decode: DecodeResponse
    end: bool
    code: int
    details: str
    def __init__(self, call_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., decode: _Optional[_Union[DecodeResponse, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...
