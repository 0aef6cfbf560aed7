"""What chat and completions share: SSE framing, collecting choices, usage, disconnects.

An endpoint supplies a `ResponseBuilder` (how its chunks and final body look); the functions
here drive child streams through it. The HTTP status is decided before the first byte: admission
errors are HTTP errors, anything later in a stream becomes an SSE error event and `[DONE]`.

Per request this path runs once per token, so it keeps to what each token needs: a single child
(n=1, the common case) is read directly, without `merge`'s task per delta; bodies and SSE
events are encoded by orjson when it is installed (the same JSON as `json.dumps` with
Starlette's JSONResponse settings); one task watches for the client leaving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from gateway.dispatch import (
    ChildStream,
    Dispatcher,
    PromptLogprobs,
    RequestOptions,
    TokenDelta,
    merge,
)
from gateway.errors import APIError
from gateway.logprobs import TokenTexts, prompt_logprobs_body
from gateway.preprocess import ChildJob
from protos import common_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
# nginx's "client closed request": only ever seen in our access log.
CLIENT_CLOSED = 499


try:
    import orjson
except ImportError:  # an optional speed-up: json gives the same text
    orjson = None


def json_bytes(data: Any) -> bytes:
    """`data` as compact UTF-8 JSON, as Starlette's JSONResponse writes it (non-ASCII kept).
    orjson when installed (~10x faster); json for what orjson refuses (integers beyond 64 bits,
    lone surrogates), so that those fail as before. One difference: orjson writes NaN as null
    where json raises; no body holds one (logprobs are clamped)."""
    if orjson is not None:
        try:
            return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:  # orjson.JSONEncodeError
            pass
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(data) + b"\n\n"


@dataclass
class Choice:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, d: TokenDelta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)


class ResponseBuilder(ABC):
    """One endpoint's response shapes. `prompt_lens[p]` is prompt p's length; choice `i`
    belongs to prompt `i // n`."""

    def __init__(self, request_id: str, model: str, prompt_lens: Sequence[int], n: int):
        self.request_id, self.model = request_id, model
        self.prompt_lens, self.n = list(prompt_lens), n
        self.created = int(time.time())
        self.choices = [Choice(i) for i in range(len(prompt_lens) * n)]

    chunk_object: str

    def opening_choices(self) -> list[dict[str, Any]]:
        """Choice entries sent before any token (chat: the assistant role)."""
        return []

    @abstractmethod
    def chunk_choice(self, d: TokenDelta, choice: Choice) -> dict[str, Any] | None:
        """The streamed entry for one delta (already added to `choice`); None: send nothing."""

    @abstractmethod
    def final_body(self) -> dict[str, Any]:
        """The non-streaming response, from `self.choices`."""

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def prompt_logprobs(self, texts: TokenTexts, index: int = 0) -> list | None:
        """vLLM's `prompt_logprobs` for choice `index`'s prompt; None unless requested."""
        lp = self.choices[index].prompt_logprobs
        return None if lp is None else prompt_logprobs_body(texts, lp.logprobs, lp.k)

    def usage(self) -> dict[str, Any]:
        num_prompt_tokens = sum(self.prompt_lens)
        num_completion_tokens = sum(len(c.token_ids) for c in self.choices)
        # Cached tokens once per prompt, from its first sample (siblings share the prompt).
        num_cached_tokens = sum(c.num_cached_tokens for c in self.choices if c.index % self.n == 0)
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        }


async def respond(
    request: Request,
    dispatcher: Dispatcher,
    jobs: Sequence[ChildJob],
    opts: RequestOptions,
    builder: ResponseBuilder,
    *,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Admit all children (errors here are HTTP errors), then stream or collect."""
    if not stream:
        body = await until_disconnect(request, _start_and_collect(dispatcher, jobs, opts, builder))
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        return Response(json_bytes(body), media_type="application/json")
    streams = await until_disconnect(request, dispatcher.start(jobs, opts))
    if streams is None:
        return Response(status_code=CLIENT_CLOSED)
    return StreamingResponse(
        stream_sse(streams, builder, include_usage), media_type="text/event-stream"
    )


async def _start_and_collect(
    dispatcher: Dispatcher,
    jobs: Sequence[ChildJob],
    opts: RequestOptions,
    builder: ResponseBuilder,
) -> dict[str, Any]:
    return await collect(await dispatcher.start(jobs, opts), builder)


async def stream_sse(
    streams: Sequence[ChildStream], builder: ResponseBuilder, include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE body. Cancellation (client gone) propagates into the children, cancelling calls."""
    try:
        opening = builder.opening_choices()
        if opening:
            yield sse(builder.chunk(opening))
        async for d in deltas(streams):
            choice = builder.choices[d.index]
            choice.add(d)
            entry = builder.chunk_choice(d, choice)
            if entry is not None:
                yield sse(builder.chunk([entry]))
        if include_usage:
            yield sse(builder.chunk([], usage=builder.usage()))
    except APIError as e:
        logger.warning("%s failed mid-stream: %s", builder.request_id, e.message)
        yield sse(e.body())
    yield SSE_DONE


async def collect(streams: Sequence[ChildStream], builder: ResponseBuilder) -> dict[str, Any]:
    async for d in deltas(streams):
        builder.choices[d.index].add(d)
    return builder.final_body()


async def deltas(streams: Sequence[ChildStream]) -> AsyncIterator[TokenDelta]:
    """The children's deltas as they arrive: `merge` for several; one child is read in place
    (no task per delta). Either way every child is cancelled when this ends early."""
    if len(streams) != 1:
        async for d in merge(streams):
            yield d
        return
    (child,) = streams
    try:
        async for d in child.deltas():
            yield d
    finally:
        child.cancel()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then return None).

    Starlette cancels streaming bodies on disconnect by itself, but not plain handlers; without
    this, a client that gives up on a long non-streamed completion would keep a decode busy.
    `work` runs in this task; a watcher task cancels this one when the client leaves (one task
    per request, where wrapping `work` in its own task and waiting on both took two and a wait).
    """
    task = asyncio.current_task()
    assert task is not None
    has_left = False

    async def watch() -> None:
        nonlocal has_left
        await _wait_for_disconnect(request)
        has_left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        # Ours (the client left) and nobody else's: the request ends quietly. Cancelled from
        # outside as well (shutdown): that cancellation goes on.
        if has_left and task.uncancel() == 0:
            return None
        raise
    finally:
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
