"""One request's bookkeeping after validation: quota reservation, settlement, metrics.

`reserve_estimate(...)` reserves the request's quota from an estimate (429 when refused) before
tokenizing; `metered(...)` runs the route's `respond`, and
returns its response wrapped so that `close` runs exactly once when the ASGI call ends, however
it ends: last byte sent, error, client disconnect (streamed or not), cancellation. `close`
settles the reservation with the tokens actually used (taken from the response builder) and
records vLLM's request metrics. Doing this around the response, not in the body generator,
matters: a streaming body that never started (client gone before the first byte) never runs
its generator's `finally`, but the response call always returns.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.auth import Principal
from gateway.edge import Edge
from gateway.quota_service import Ticket
from gateway.serving import ResponseBuilder

T = TypeVar("T")


class _Meter:
    def __init__(self, edge: Edge, ticket: Ticket, builder: ResponseBuilder, start_s: float):
        self.edge, self.ticket, self.builder, self.start_s = edge, ticket, builder, start_s
        self._is_closed = False

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        usage = self.builder.usage()
        choices = self.builder.choices
        num_completion_tokens = usage["completion_tokens"]
        was_served = num_completion_tokens > 0 or any(c.finish_reason for c in choices)
        # The prompts are charged whatever happened after validation (refused, failed, client
        # gone): they were sent to decodes and may have been prefilled; a caller must not be
        # able to keep the cluster busy with requests that cost it nothing.
        self.edge.quota.release(self.ticket, usage["total_tokens"])
        finished = [c.finish_reason for c in choices if c.finish_reason is not None]
        e2e_s = None
        if choices and len(finished) == len(choices):
            e2e_s = time.perf_counter() - self.start_s
        tokens = (usage["prompt_tokens"], num_completion_tokens) if was_served else (0, 0)
        observe = self.edge.metrics.of_model.observe_request
        self.edge.bookkeeping.defer(observe, *tokens, finished, e2e_s)

    async def timed(self, body: AsyncIterator) -> AsyncIterator:
        """The streamed body, observing the time to its first chunk (first tokens are in hand:
        admission waits for every child's first message)."""
        try:
            is_first = True
            async for chunk in body:
                if is_first:
                    is_first = False
                    elapsed_s = time.perf_counter() - self.start_s
                    self.edge.bookkeeping.defer(self.edge.metrics.of_model.ttft.observe, elapsed_s)
                yield chunk
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()


class MeteredResponse(Response):
    """Delegates to `inner`, then calls `on_done` whatever way the call ends."""

    def __init__(self, inner: Response, on_done: Callable[[], None]):
        self.inner, self.on_done = inner, on_done
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers
        self.background = inner.background

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.inner.background = self.background  # FastAPI may have set ours
        try:
            await self.inner(scope, receive, send)
        finally:
            self.on_done()


async def reserve_estimate(
    edge: Edge,
    principal: Principal,
    request_id: str,
    num_tokens_estimate: int,
    prepare: Callable[[], Awaitable[T]],
) -> tuple[Ticket, T]:
    """Reserve the estimate (429 when refused) *before* `prepare` (tokenizing) runs, so a key
    over its quota costs no tokenizer time; a `prepare` that fails releases it uncharged (the
    request never reached a decode). `metered` then settles on the exact count."""
    ticket = await edge.quota.reserve(principal, request_id, num_tokens_estimate)
    try:
        return ticket, await prepare()
    except BaseException:
        edge.quota.release(ticket, 0)
        raise


async def metered(
    edge: Edge,
    request: Request,
    ticket: Ticket,
    builder: ResponseBuilder,
    run: Callable[[], Awaitable[Response]],
) -> Response:
    """Run the request under `ticket` (from `reserve_estimate`); settle it at the end with the
    tokens actually used."""
    now_s = time.perf_counter()
    start_s = request.scope.get("state", {}).get("arrival_s", now_s)
    edge.bookkeeping.defer(edge.metrics.of_model.prepare.observe, now_s - start_s)
    meter = _Meter(edge, ticket, builder, start_s)
    try:
        response = await run()
    except BaseException:
        meter.close()
        raise
    if isinstance(response, StreamingResponse):
        response.body_iterator = meter.timed(response.body_iterator)
    return MeteredResponse(response, meter.close)
