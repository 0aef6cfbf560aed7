"""`POST /v1/chat/completions` and `POST /v1/completions` without FastAPI's inner layers.

A pure ASGI middleware, the innermost of the gateway's own (gateway/app.py). Everything outside
it runs for these two routes as for any other: the 500 handler, the access log, CORS, the
edge (allowlist, body size, auth), load shedding. What it skips is what FastAPI adds inside
them for every request: the exception middleware, the router's match over every route, the
endpoint's exit stacks, dependency solving and a wrapper of `send` (bench/gateway_overhead.py,
a small chat completion on 2 cores: FastAPI's share 0.32 -> 0.08 ms of CPU, the whole request
-0.17 ms, ~5%; bench/results/gateway_overhead_cpu_vs_main-2026-12-03.json).

The endpoints are the functions FastAPI would call (gateway/routes/chat.py, completions.py),
given the state and principal their dependencies would give them (gateway/deps.py). They parse
their own bodies, so FastAPI never validated anything for them. An exception an endpoint raises
gets the response of the app's handler for it (`app.exception_handlers`, looked up by class as
Starlette does: APIError, validation errors, HTTPException, gateway/errors.py); any other
propagates to the outer 500 handler, as it would from the router. The routes stay registered
with FastAPI: the OpenAPI schema describes them, and `create_app(..., fast_routes=False)`
serves them the slow way (the reference the tests hold this path to).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import Principal
from gateway.deps import GatewayState

Endpoint = Callable[[Request, GatewayState, Principal], Awaitable[Response]]
Handler = Callable[[Request, Any], Response | Awaitable[Response]]


class FastRoutes:
    def __init__(
        self,
        app: ASGIApp,
        *,
        state: GatewayState,
        endpoints: Mapping[str, Endpoint],
        handlers: Mapping[Any, Handler],
    ):
        """`endpoints`: path → endpoint, for POST; `handlers`: the app's exception handlers (the
        dict itself: handlers added later count too)."""
        self.app, self.state, self.endpoints, self.handlers = app, state, endpoints, handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request, self.state, scope["state"]["principal"])
        except Exception as exc:
            handler = self._handler_for(exc)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception) -> Handler | None:
        """The handler Starlette's exception middleware would pick; None for the ones only the
        outer 500 handler takes (`Exception`, 500)."""
        if isinstance(exc, HTTPException):
            handler = self.handlers.get(exc.status_code)
            if handler is not None and exc.status_code != 500:
                return handler
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None
            handler = self.handlers.get(cls)
            if handler is not None:
                return handler
        return None
