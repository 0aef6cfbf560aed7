"""One line per request: method, path, status, latency, tenant. Never bodies, headers (keys,
prompts) or query strings. Paths outside the allowlist are not logged either: a client that
puts a key in a URL by mistake (`/v1/sk-...`) gets a 404 and the log gets `<not allowed>`.

A pure ASGI middleware rather than `BaseHTTPMiddleware`: the latter buffers differently around
streaming responses and interferes with disconnect-driven cancellation. Latency runs to the
last byte, so a streamed completion logs its full duration.

Lines are written in batches (gateway/bookkeeping.py): up to 0.1 s after the request ends,
stamped with the time it ended.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.allowlist import is_allowed_path
from gateway.bookkeeping import Bookkeeping

logger = logging.getLogger("gateway.access")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, bookkeeping: Bookkeeping):
        self.app, self.bookkeeping = app, bookkeeping

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
            if logger.isEnabledFor(logging.INFO):
                args = (scope["method"], path, status, latency_ms, tenant)
                self.bookkeeping.defer(_write_line, time.time(), args)


def _write_line(created_s: float, args: tuple) -> None:
    """The access-log record of a request that ended at `created_s` (time.time())."""
    record = logger.makeRecord(
        logger.name, logging.INFO, __file__, 0, "%s %s %d %.1fms tenant=%s", args, None
    )
    record.created = created_s
    record.msecs = int((created_s - int(created_s)) * 1000) + 0.0  # as LogRecord computes it
    logger.handle(record)
