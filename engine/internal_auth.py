"""Authentication of internal gRPC traffic (gateway → decode → prefill) with a shared token.

The token comes from `TANDEM_INTERNAL_TOKEN` or the file named by `TANDEM_INTERNAL_TOKEN_FILE`
(a mounted secret), never from argv; `tandem serve` makes a random one per launch and hands it
to its children through the environment. When a token is configured, servers reject every call
without `authorization: Bearer <token>` (compared in constant time) with UNAUTHENTICATED,
except the gRPC health service (probes carry no secrets). Clients attach it to every call
through a channel interceptor. Without a token (tests, a trusted single host) nothing changes.
"""

from __future__ import annotations

import hmac
import os

import grpc

ENV_TOKEN = "TANDEM_INTERNAL_TOKEN"
ENV_TOKEN_FILE = "TANDEM_INTERNAL_TOKEN_FILE"
_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def internal_token() -> str | None:
    token = os.environ.get(ENV_TOKEN)
    path = os.environ.get(ENV_TOKEN_FILE)
    if not token and path:
        with open(path) as f:
            token = f.read().strip()
    return token or None


class _RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_HEALTH_PREFIX):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(got, str):
            got = got.encode()
        if hmac.compare_digest(got, self._expected):
            return await continuation(details)
        return _deny(await continuation(details))


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")
        yield  # pragma: no cover - makes this an async generator

    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    token = internal_token()
    return [_RequireToken(token)] if token else []


class _TokenMetadata:
    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, details):
        return details._replace(metadata=list(details.metadata or ()) + [self._md])


# Separate classes: grpc.aio files each interceptor under the first call type it matches.
class _AddTokenUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddTokenStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def insecure_channel(address: str, options=None) -> grpc.aio.Channel:
    """A loopback/cluster channel that carries the internal token when one is configured."""
    token = internal_token()
    interceptors = [_AddTokenUnary(token), _AddTokenStream(token)] if token else None
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
