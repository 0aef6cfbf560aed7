from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "prompt_logprobs", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    structured_outputs: StructuredOutputs
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace", "reasoning_start_token_id", "reasoning_end_token_id")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    structural_tag: str
    disable_any_whitespace: bool
    reasoning_start_token_id: int
    reasoning_end_token_id: int
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., reasoning_start_token_id: _Optional[int] = ..., reasoning_end_token_id: _Optional[int] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "kv_transfer_bytes", "local_prefill", "prefill_instance", "remote_setup_s", "remote_rpc_s", "remote_compute_s", "remote_server_s", "kv_wait_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SETUP_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_RPC_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SERVER_S_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_transfer_bytes: int
    local_prefill: bool
    prefill_instance: str
    remote_setup_s: float
    remote_rpc_s: float
    remote_compute_s: float
    remote_server_s: float
    kv_wait_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., prefill_instance: _Optional[str] = ..., remote_setup_s: _Optional[float] = ..., remote_rpc_s: _Optional[float] = ..., remote_compute_s: _Optional[float] = ..., remote_server_s: _Optional[float] = ..., kv_wait_s: _Optional[float] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "block_ids", "first_block", "transfer_token", "block_bytes")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    transfer_token: str
    block_bytes: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., transfer_token: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[Error.Code]
        INVALID_ARGUMENT: _ClassVar[Error.Code]
        RESOURCE_EXHAUSTED: _ClassVar[Error.Code]
        PREFILL_FAILED: _ClassVar[Error.Code]
        DECODE_FAILED: _ClassVar[Error.Code]
        ABORTED: _ClassVar[Error.Code]
    UNKNOWN: Error.Code
    INVALID_ARGUMENT: Error.Code
    RESOURCE_EXHAUSTED: Error.Code
    PREFILL_FAILED: Error.Code
    DECODE_FAILED: Error.Code
    ABORTED: Error.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: Error.Code
    message: str
    def __init__(self, code: _Optional[_Union[Error.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("instance_id", "num_waiting", "num_running", "num_free_blocks", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_transfer_bytes", "kv_backend", "block_size", "max_model_len", "num_idle_free_blocks", "num_requests_total", "num_local_prefills", "num_remote_prefills", "epoch", "num_pending_prefill_tokens", "prefill_tokens_per_s", "kv_bytes_per_block", "max_num_batched_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_IDLE_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_waiting: int
    num_running: int
    num_free_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_transfer_bytes: int
    kv_backend: str
    block_size: int
    max_model_len: int
    num_idle_free_blocks: int
    num_requests_total: int
    num_local_prefills: int
    num_remote_prefills: int
    epoch: str
    num_pending_prefill_tokens: int
    prefill_tokens_per_s: float
    kv_bytes_per_block: int
    max_num_batched_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_backend: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_idle_free_blocks: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_local_prefills: _Optional[int] = ..., num_remote_prefills: _Optional[int] = ..., epoch: _Optional[str] = ..., num_pending_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., kv_bytes_per_block: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
        CLEARED: _ClassVar[KVEvent.Kind]
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    CLEARED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("instance_id", "epoch", "reset", "events", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    epoch: str
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    load: LoadResponse
    def __init__(self, instance_id: _Optional[str] = ..., epoch: _Optional[str] = ..., reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., load: _Optional[_Union[LoadResponse, _Mapping]] = ...) -> None: ...
