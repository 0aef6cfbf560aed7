"""One line per request: method, path, status, latency, tenant. Never bodies, headers (keys,
prompts) or query strings. Paths outside the allowlist are not logged either: a client that
puts a key in a URL by mistake (`/v1/sk-...`) gets a 404 and the log gets `<not allowed>`.

A pure ASGI middleware rather than `BaseHTTPMiddleware`: the latter buffers differently around
streaming responses and interferes with disconnect-driven cancellation. Latency runs to the
last byte, so a streamed completion logs its full duration.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.allowlist import is_allowed_path

logger = logging.getLogger("gateway.access")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # if the app dies before starting a response

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            latency_ms = (time.perf_counter() - start) * 1000
            path = scope["path"] if is_allowed_path(scope["path"]) else "<not allowed>"
            principal = scope.get("state", {}).get("principal")
            tenant = principal.tenant if principal is not None else "-"
            logger.info(
                "%s %s %d %.1fms tenant=%s", scope["method"], path, status, latency_ms, tenant
            )
