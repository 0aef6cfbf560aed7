"""Authentication of internal gRPC traffic (gateway → decode → prefill): a shared token, and
optionally mutual TLS under it.

Token: from `TANDEM_INTERNAL_TOKEN` or the file named by `TANDEM_INTERNAL_TOKEN_FILE` (a mounted
secret), never from argv; at least 16 printable ASCII characters. `tandem serve` makes a random
one per launch and hands it to its children through the environment. Servers reject every call
without `authorization: Bearer <token>` (compared in constant time) with UNAUTHENTICATED, except
the gRPC health service (probes carry no secrets). Clients attach it to every call through a
channel interceptor.

mTLS: `TANDEM_INTERNAL_TLS_CERT`, `TANDEM_INTERNAL_TLS_KEY` and `TANDEM_INTERNAL_TLS_CA` name
PEM files (all three or none). A process uses its one certificate both to serve (clients must
present a certificate signed by the CA) and as the client certificate of its own calls, so it
needs the serverAuth and clientAuth usages (or none) and the names or IPs peers dial in its SAN.
The token is still checked on top of TLS; health probes, exempt from the token, need a client
certificate like every other call.

Every process that serves or calls internal gRPC runs `check_startup` before loading anything:
without a token or mTLS it refuses to start unless `--insecure-internal` was given.
`internal_channel` is the only way to open a channel to a Tandem service; `add_port` the only
way to listen for one.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import ssl
from dataclasses import dataclass

import grpc

logger = logging.getLogger(__name__)

ENV_TOKEN = "TANDEM_INTERNAL_TOKEN"
ENV_TOKEN_FILE = "TANDEM_INTERNAL_TOKEN_FILE"
ENV_TLS_CERT = "TANDEM_INTERNAL_TLS_CERT"
ENV_TLS_KEY = "TANDEM_INTERNAL_TLS_KEY"
ENV_TLS_CA = "TANDEM_INTERNAL_TLS_CA"
MIN_TOKEN_CHARS = 16
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_hex(32))'"


class InternalAuthError(ValueError):
    """Internal auth is missing or misconfigured; the message says what to set."""


@dataclass(frozen=True)
class TlsFiles:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def internal_token() -> str | None:
    """The configured token, validated; None when neither variable is set."""
    token, source = os.environ.get(ENV_TOKEN), ENV_TOKEN
    path = os.environ.get(ENV_TOKEN_FILE)
    if not token and path:
        token, source = _read(ENV_TOKEN_FILE, path).decode(errors="replace").strip(), path
        if not token:
            raise InternalAuthError(
                f"{ENV_TOKEN_FILE}={path} is empty; put the shared internal token in it "
                f"(make one with {_MAKE_TOKEN})"
            )
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise InternalAuthError(
            f"the internal token from {source} is too weak ({len(token)} characters); use at "
            f"least {MIN_TOKEN_CHARS} random printable ASCII characters, e.g. {_MAKE_TOKEN}"
        )
    if not (token.isascii() and token.isprintable()):
        raise InternalAuthError(
            f"the internal token from {source} holds characters other than printable ASCII, "
            f"which gRPC metadata cannot carry; make one with {_MAKE_TOKEN}"
        )
    return token


def internal_tls() -> TlsFiles | None:
    """The mTLS files' contents, or None when no TLS variable is set."""
    paths = {name: os.environ.get(name) for name in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA)}
    if not any(paths.values()):
        return None
    missing = [name for name, path in paths.items() if not path]
    if missing:
        raise InternalAuthError(
            f"internal mTLS needs all of {ENV_TLS_CERT}, {ENV_TLS_KEY} and {ENV_TLS_CA} but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} unset; set all "
            "three to PEM files, or none for no TLS"
        )
    return TlsFiles(*(_read(name, path) for name, path in paths.items()))


def _read(variable: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InternalAuthError(
            f"{variable}={path} cannot be read ({e.strerror}); it must name a mounted secret "
            "file readable by this process"
        ) from None


def _check_tls_files() -> None:
    """Fail at start-up, not at the first call, on a key that does not match its certificate
    or a CA file with no certificate in it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cert, key, ca = (os.environ[n] for n in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA))
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise InternalAuthError(
            f"{ENV_TLS_CERT}={cert} and {ENV_TLS_KEY}={key} are not a PEM certificate and its "
            f"private key ({e.reason or e}); point them at a matching pair"
        ) from None
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise InternalAuthError(
            f"{ENV_TLS_CA}={ca} holds no PEM CA certificate ({e.reason or e}); point it at the "
            "CA that signed the services' certificates"
        ) from None


def add_internal_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure-internal",
        action="store_true",
        help=f"start without {ENV_TOKEN}/{ENV_TOKEN_FILE}: internal gRPC is then "
        "unauthenticated (only for a trusted single host)",
    )


def check_startup(insecure: bool) -> None:
    """Validate the internal auth configuration; raise InternalAuthError (one line) if this
    process must not start. Warn loudly when it runs without authentication."""
    token, tls = internal_token(), internal_tls()
    if tls is not None:
        _check_tls_files()
    if token is None and tls is None and not insecure:
        raise InternalAuthError(
            "refusing to start: internal gRPC would be unauthenticated "
            f"({ENV_TOKEN} and {ENV_TOKEN_FILE} are unset). Set {ENV_TOKEN_FILE} to a mounted "
            "secret file holding the token shared by gateway, prefill and decode, or pass "
            "--insecure-internal on a trusted single host"
        )
    if token is None and tls is None:
        logger.warning(
            "INTERNAL gRPC IS UNAUTHENTICATED (--insecure-internal): no token or mTLS between "
            "gateway, decode and prefill, so anyone who can reach a service's gRPC port can "
            "call it. Set %s for any deployment beyond one trusted host",
            ENV_TOKEN_FILE,
        )
    elif token is None:
        logger.info("Internal gRPC authenticated by mTLS only (no %s)", ENV_TOKEN)
    elif insecure:
        logger.info("--insecure-internal has no effect: an internal token is configured")


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
    if handler.request_streaming and handler.response_streaming:  # Decode.GenerateMux
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    token = internal_token()
    return [_RequireToken(token)] if token else []


def add_port(server: grpc.aio.Server, address: str) -> int:
    """Listen on `address`: with mTLS when configured (client certificates required)."""
    tls = internal_tls()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem, require_client_auth=True
    )
    return server.add_secure_port(address, credentials)


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


class _AddTokenStreamStream(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def internal_channel(address: str, options=None) -> grpc.aio.Channel:
    """A channel to a Tandem service: mTLS when configured, the token on every call."""
    token = internal_token()
    interceptors = None
    if token:
        interceptors = [_AddTokenUnary(token), _AddTokenStream(token), _AddTokenStreamStream(token)]
    tls = internal_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca_pem, private_key=tls.key_pem, certificate_chain=tls.cert_pem
    )
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def frames_auth() -> tuple[bytes | None, ssl.SSLContext | None]:
    """The token and server TLS context of a framed GenerateMux listener (protos/mux_frames.py)."""
    token = internal_token()
    return (token.encode() if token else None), ssl_context(server=True)


def ssl_context(server: bool) -> ssl.SSLContext | None:
    """The mTLS files as an `ssl` context for transports other than gRPC (protos/mux_frames.py),
    with gRPC's rules: a server requires a client certificate signed by the CA; a client
    verifies the server's certificate and host name. None when no TLS is configured."""
    if internal_tls() is None:
        return None
    cert, key, ca = (os.environ[n] for n in (ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA))
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    context = ssl.create_default_context(purpose, cafile=ca)
    context.load_cert_chain(cert, key)
    if server:
        context.verify_mode = ssl.CERT_REQUIRED
    return context
