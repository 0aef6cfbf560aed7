from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "params", "cache_salt", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    cache_salt: str
    target: _common_pb2.KVTarget
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., target: _Optional[_Union[_common_pb2.KVTarget, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "kv_transfer_bytes", "kv_transfer_s", "num_descriptors", "compute_s", "server_s", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    num_cached_tokens: int
    kv_transfer_bytes: int
    kv_transfer_s: float
    num_descriptors: int
    compute_s: float
    server_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ..., num_descriptors: _Optional[int] = ..., compute_s: _Optional[float] = ..., server_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
