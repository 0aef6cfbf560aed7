from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillTarget(_message.Message):
    __slots__ = ("address", "instance_id", "registration", "predicted_prefill_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    instance_id: str
    registration: bytes
    predicted_prefill_s: float
    def __init__(self, address: _Optional[str] = ..., instance_id: _Optional[str] = ..., registration: _Optional[bytes] = ..., predicted_prefill_s: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "params", "cache_salt", "priority", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillTarget]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillTarget, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "stop_token_id", "usage", "timings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    stop_token_id: int
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    def __init__(self, finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "final", "error")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    final: Final
    error: _common_pb2.Error
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class MuxRequest(_message.Message):
    __slots__ = ("id", "start", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    start: GenerateRequest
    cancel: MuxCancel
    def __init__(self, id: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[MuxCancel, _Mapping]] = ...) -> None: ...

class MuxCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MuxStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class MuxItem(_message.Message):
    __slots__ = ("id", "response", "end")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: GenerateResponse
    end: MuxStatus
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[MuxStatus, _Mapping]] = ...) -> None: ...

class MuxResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MuxItem]
    def __init__(self, items: _Optional[_Iterable[_Union[MuxItem, _Mapping]]] = ...) -> None: ...

class MuxHello(_message.Message):
    __slots__ = ("token", "version")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    token: str
    version: int
    def __init__(self, token: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class MuxWelcome(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
