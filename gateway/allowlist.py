"""The edge, in front of every route: path allowlist → body size → API key.

Deny by default: a request reaches the app only if its exact path (no trailing-slash or case
variants, no prefixes) is in `ROUTES` and its method is listed there; anything else is a 404 in
OpenAI's shape (405 for a known path with another method), whatever the app itself might route.
So `/docs`, `/openapi.json`, `/metrics` or a route someone adds later stay unreachable until they
are listed here. The one parameterised path, `/v1/models/{model}`, is matched by its prefix
(`route_of`) and listed under its template. `OPTIONAL_ROUTES` (vLLM's `/tokenize`,
`/detokenize`) are off unless the settings turn them on (`Edge.routes`). The allowlist runs
before auth: unknown paths cost no hashing, and the surface it reveals (the OpenAI routes) is
public anyway.

Auth: exactly one `Authorization: Bearer <key>` header (several are a 400, not "the last one
wins"); the principal is stored in `scope["state"]["principal"]` for routes
(`deps.PrincipalDep`) and the access log. With no keys configured every caller is
the anonymous principal. Bodies: Content-Length above the limit is refused up front; a chunked
body is read here, bounded, and replayed to the app.

A pure ASGI middleware, like the access log: no buffering of streamed responses.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import KeyStore, Principal
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

ROUTES: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/v1/models/{model}": frozenset({"GET"}),
    "/health": frozenset({"GET"}),
    "/version": frozenset({"GET"}),
}

_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG_KEY = "Incorrect API key provided."
_SEVERAL_KEYS = (
    "The request has more than one Authorization header. Send exactly one "
    "(Authorization: Bearer YOUR_KEY)."
)


# Off by default: they reveal the tokenizer and cost CPU without generating anything.
OPTIONAL_ROUTES: dict[str, frozenset[str]] = {
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
}

# Prefix → template for the paths that end in a parameter (a model name may hold slashes).
_PARAM_ROUTES = {"/v1/models/": "/v1/models/{model}"}


def route_of(path: str) -> str:
    """The allowlist key `path` is checked under: itself, or its template."""
    for prefix, template in _PARAM_ROUTES.items():
        if path.startswith(prefix) and len(path) > len(prefix):
            return template
    return path


def is_allowed_path(path: str) -> bool:
    """Whether the access log may print `path` (an allowlisted one, optional routes included)."""
    return route_of(path) in ROUTES or path in OPTIONAL_ROUTES


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyStore,
        anonymous: Principal,
        public_paths: frozenset[str],
        max_body_bytes: int,
        metrics: GatewayMetrics,
        routes: dict[str, frozenset[str]] = ROUTES,
    ):
        assert public_paths <= routes.keys(), "public paths must be allowlisted"
        self.app, self.keys, self.anonymous, self.routes = app, keys, anonymous, routes
        self.public_paths, self.max_body_bytes = public_paths, max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets: none are served
            await send({"type": "websocket.close", "code": 1008})
            return
        arrival_s = time.perf_counter()
        error = self._check_route(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        headers = dict(scope["headers"])  # raw bytes; the last value of a repeated header wins
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._too_large().response()(scope, receive, send)
            return
        principal = self.anonymous
        if self.keys.is_enabled and route_of(scope["path"]) not in self.public_paths:
            values = [v for k, v in scope["headers"] if k == b"authorization"]
            principal, error = self._authenticate(values)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        state = scope.setdefault("state", {})
        state["principal"], state["arrival_s"] = principal, arrival_s
        if length is None and scope["method"] == "POST":
            body = await self._read_bounded(receive)
            if body is None:
                await self._too_large().response()(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _check_route(self, scope: Scope) -> APIError | None:
        methods = self.routes.get(route_of(scope["path"]))
        if methods is None:
            return APIError("Not Found", 404)
        if scope["method"] not in methods:
            allow = ", ".join(sorted(methods))
            return APIError("Method Not Allowed", 405, headers={"Allow": allow})
        return None

    def _authenticate(self, values: list[bytes]) -> tuple[Principal, APIError | None]:
        """The principal, or the 401 (400: several headers) to send. Nothing about the presented
        values is echoed."""
        if len(values) > 1:
            # Which one would count depends on who reads the headers (the last wins in a dict, a
            # proxy may check the first): refuse the ambiguity instead of picking one.
            return self.anonymous, APIError(_SEVERAL_KEYS, 400)
        header = values[0] if values else None
        reason, message = "missing", _MISSING_KEY
        if header is not None:
            scheme, _, token = header.strip().partition(b" ")
            token = token.strip()
            reason, message = "malformed", _WRONG_KEY
            if scheme.lower() == b"bearer" and token:
                principal = self.keys.authenticate(token)
                if principal is not None:
                    return principal, None
                reason = "invalid"
        self.metrics.auth_failures.labels(reason).inc()
        error = APIError(message, 401, headers={"WWW-Authenticate": "Bearer"})
        return self.anonymous, error

    def _too_large(self) -> APIError:
        return APIError(f"Request body is larger than {self.max_body_bytes} bytes.", 413)

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnect: let the app see an empty body
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields `body` once, then defers to the real one (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
