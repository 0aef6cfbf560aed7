"""The gateway's OpenAPI schema: what each route answers, stated once, served to operators.

FastAPI derives request bodies from the routes (each route inlines its request model,
`offload.openapi_body`), but not what comes back: routes return plain dicts, errors come from
handlers and the edge middleware. `ROUTE_RESPONSES` states every status each route can answer
(200 bodies and the error statuses with `errors.ErrorResponse`, the shape `APIError.body`
writes), and `install(app)` makes `app.openapi()` return the schema with them, without FastAPI's
422 (validation errors are 400s here, `errors.install_handlers`).

Where: not on the public port (its allowlist serves the API only), but at `/openapi.json` on
the internal metrics port (`--metrics-port`, `Edge.start`), next to `/metrics`. The 200 models
name the fields clients rely on and allow more (`extra="allow"`), so a new field in a response
does not make the schema lie; tests/gateway/test_fuzz.py checks real responses against it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from gateway.errors import ErrorResponse


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(_Open):
    index: int
    delta: dict[str, Any]
    finish_reason: str | None


class ChatCompletionChunk(_Open):
    """One `data:` event of a streamed chat completion (the last may carry only `usage`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Open):
    """200 with at least one reachable decode, else 503 (same body)."""

    status: Literal["ok", "degraded", "unavailable"]
    num_decodes: int
    num_decodes_reachable: int


class Version(_Open):
    version: str


class Tokenized(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None


class Detokenized(_Open):
    prompt: str


_MODELS = (
    ErrorResponse, ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, ModelCard,
    ModelList, Health, Version, Tokenized, Detokenized,
)  # fmt: skip

_ERRORS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range, an "
    "unsupported parameter, a prompt longer than the context, a request over the key's caps, "
    "or more than one Authorization header.",
    401: "Missing or wrong API key (when keys are configured and the route is not public).",
    404: "The model named in the request is not served.",
    413: "The body is larger than max_request_body_bytes.",
    429: "The key's requests, tokens or concurrency limit is reached; retry after Retry-After "
    "seconds.",
    500: "A model server failed to run the request; retry it.",
    503: "No decode instance can take the request now; retry after Retry-After seconds.",
}
_HEADERS = {
    401: {"WWW-Authenticate": "`Bearer`: send the key as `Authorization: Bearer KEY`."},
    429: {"Retry-After": "Seconds to wait before retrying."},
    503: {"Retry-After": "Seconds to wait before retrying."},
}
_SSE = (
    "With `stream: true`: `data: {chunk}` events, then `data: [DONE]`; a failure after the "
    "first byte is an event holding the error body, then `data: [DONE]`."
)
_AUTH = (400, 401)
_GENERATION = (*_AUTH, 404, 413, 429, 500, 503)

# (path, method) -> (200 body, streamed chunk or None, error statuses). The allowlist's paths.
ROUTE_RESPONSES: dict[tuple[str, str], tuple[type[BaseModel], type[BaseModel] | None, tuple]] = {
    ("/v1/chat/completions", "post"): (ChatCompletion, ChatCompletionChunk, _GENERATION),
    ("/v1/completions", "post"): (Completion, CompletionChunk, _GENERATION),
    ("/v1/models", "get"): (ModelList, None, _AUTH),
    ("/v1/models/{model}", "get"): (ModelCard, None, (*_AUTH, 404)),
    ("/health", "get"): (Health, None, (*_AUTH, 503)),
    ("/version", "get"): (Version, None, _AUTH),
    ("/tokenize", "post"): (Tokenized, None, (*_AUTH, 404, 413)),
    ("/detokenize", "post"): (Detokenized, None, (*_AUTH, 404, 413)),
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: `schema` describes each event): its `data` is a
    JSON chunk, an error body, or the closing `[DONE]`."""
    as_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    return {
        "type": "object",
        "description": _SSE,
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, as_json]}},
    }


def _responses(
    body: type[BaseModel], chunk: type[BaseModel] | None, statuses: tuple[int, ...]
) -> dict[str, Any]:
    ok_content: dict[str, Any] = {"application/json": {"schema": _ref(body)}}
    if chunk is not None:
        ok_content["text/event-stream"] = {"schema": _event_schema(chunk)}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok_content}}
    for status in statuses:
        error_body = Health if body is Health and status == 503 else ErrorResponse
        responses[str(status)] = {
            "description": "No decode is reachable." if error_body is Health else _ERRORS[status],
            "content": {"application/json": {"schema": _ref(error_body)}},
        }
        headers = _HEADERS.get(status, {})
        if headers:
            responses[str(status)]["headers"] = {
                name: {"description": text, "schema": {"type": "string"}}
                for name, text in headers.items()
            }
    return responses


def build_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema with `ROUTE_RESPONSES` in place of its guesses (and no 422)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, defs = models_json_schema(
        [(m, "serialization") for m in _MODELS], ref_template="#/components/schemas/{model}"
    )
    for name, definition in defs["$defs"].items():
        # A response model must not replace a request model of the same name.
        assert components.get(name, definition) == definition, f"two schemas named {name}"
        components[name] = definition
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            declared = ROUTE_RESPONSES.get((path, method))
            assert declared is not None, f"{method.upper()} {path}: add it to ROUTE_RESPONSES"
            operation["responses"] = _responses(*declared)
    return schema


def install(app: FastAPI) -> None:
    """`app.openapi()` returns `build_schema(app)` (computed once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def schema_bytes(app: FastAPI) -> bytes:
    return json.dumps(app.openapi(), ensure_ascii=False).encode()
