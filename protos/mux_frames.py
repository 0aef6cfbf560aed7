"""`GenerateMux` on a framed TCP connection: the gateway's requests to a decode without gRPC's
threads on the path.

Why: grpc.aio's threads wake ~6 times per request on the gateway's `GenerateMux` stream, and
each message's completion wakes the event loop again (bench/README.md, "What gRPC costs the
gateway per request"). The same messages as length-prefixed frames on a socket that the event
loop reads itself cost one wake-up each way: 0.23-0.68 ms less of the gateway's CPU per
request, and 0.17 ms less at the decode (bench/README.md, "The gateway's requests on framed TCP
instead of gRPC").

Wire: each frame is a 4-byte big-endian length and a protobuf message of protos/decode.proto.
  client → server: MuxHello (the internal token), then MuxRequest frames;
  server → client: MuxWelcome once the hello is accepted, then MuxResponse frames.
Semantics are `GenerateMux`'s (protos/decode_mux.py, whose `_AsyncMux` runs each connection):
a start runs the servicer's `Generate` as its own task, a cancel aborts it, items ready together
go out in one MuxResponse, a drain refuses new starts with UNAVAILABLE and closes the connection
once its requests have ended, and a closed or broken connection cancels every request on it.

Trust, as gRPC's (engine/internal_auth.py, which hands the listener its token and TLS context):
mutual TLS when configured (a client certificate signed by the CA is required), and the
internal token in the hello, compared in constant time.
A connection that sends anything else first, a hello over `MAX_HELLO_BYTES`, a wrong token, or
no hello within `HELLO_TIMEOUT_S` is closed without a reply; at most `MAX_HANDSHAKES` may be in
that state at once (more are closed at once). After the hello, a frame over
`MAX_REQUEST_FRAME_BYTES` (grpc's default receive limit) or one that is not a MuxRequest closes
that connection only. Each refusal is counted in the servicer's
`num_rejected_frame_connections` (the decode's metric `tandem:num_rejected_frame_connections`);
no frame on this port can stop the event loop or another connection.

Discovery: the decode's gRPC `GenerateMux` stream advertises the port in its initial metadata
(`FRAMES_METADATA_KEY`); the gateway connects to the host it already dials for gRPC and keeps
the gRPC stream as the fallback (gateway/mux.py `DecodeGenerate`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import struct
from typing import Any

from google.protobuf.message import DecodeError

from protos import decode_mux, decode_pb2

logger = logging.getLogger(__name__)

FRAMES_VERSION = 1
HEADER = struct.Struct(">I")
MAX_HELLO_BYTES = 4096
HELLO_TIMEOUT_S = 10.0
MAX_HANDSHAKES = 64  # connections not yet authenticated, at once
MAX_REQUEST_FRAME_BYTES = 4 * 1024 * 1024  # grpc.aio.server()'s default receive limit


class FrameError(ValueError):
    """The peer broke the framing (a frame over the limit): the connection must close."""


class FrameReader:
    """Splits a byte stream into frames' payloads (bytes), refusing any over `max_bytes`.

    Data holding whole frames is sliced as it comes; a partial frame is kept in a bytearray
    that later data extends in place, so a large frame arriving in many reads is copied about
    once, not once per read."""

    __slots__ = ("max_bytes", "_partial")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._partial = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buffer: bytes | bytearray = data
        if self._partial:
            self._partial += data
            buffer = self._partial
        frames, start, size = [], 0, len(buffer)
        while size - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            if length > self.max_bytes:
                raise FrameError(f"a frame of {length} bytes (at most {self.max_bytes})")
            end = start + HEADER.size + length
            if end > size:
                break
            frames.append(bytes(buffer[start + HEADER.size : end]))
            start = end
        if buffer is self._partial:
            del self._partial[:start]
        elif start < size:
            self._partial = bytearray(data[start:])
        return frames


def frame(message: Any) -> bytes:
    data = message.SerializeToString()
    return HEADER.pack(len(data)) + data


class _StreamContext:
    """What a request's sub-context (decode_mux._AsyncSubContext) reads of its stream's."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return ()


class _FramedMux(decode_mux._AsyncMux):
    """`_AsyncMux` driven by a connection: messages arrive from `data_received`, and each change
    schedules one flush of the batch (no writer task)."""

    def __init__(self, servicer, context, connection: _Connection) -> None:
        super().__init__(servicer, context)
        self.connection = connection
        self._is_flush_due = False

    def wake(self) -> None:
        if not self._is_flush_due:
            self._is_flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._is_flush_due = False
        if self.batch.items:
            batch, self.batch = self.batch, decode_pb2.MuxResponse()
            self.connection.write(frame(batch))
        is_open = self.is_reading and not self.servicer.is_draining
        if not is_open and not self.tasks:
            self.connection.finish()

    def close(self) -> None:
        """The connection is gone: nobody reads the requests' outputs any more."""
        self.is_reading = False
        for task in list(self.tasks.values()):
            task.cancel()


class _Connection(asyncio.Protocol):
    """One client connection: the hello, then its `_FramedMux`."""

    def __init__(self, server: FramesServer) -> None:
        self.server = server
        self.reader = FrameReader(MAX_HELLO_BYTES)
        self.transport: asyncio.Transport | None = None
        self.mux: _FramedMux | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if server.num_handshakes >= MAX_HANDSHAKES:
            self._refuse(f"{MAX_HANDSHAKES} connections already in their hello")
            return
        server.num_handshakes += 1
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT_S, self._refuse, "no hello in time")

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self.reader.feed(data):
                if self.transport is None or self.transport.is_closing():
                    return  # refused, or ended: what follows is not read
                if self.mux is None:
                    self._hello(payload)
                else:
                    self.mux._on_message(decode_pb2.MuxRequest.FromString(payload))
        except (FrameError, DecodeError) as e:
            self._refuse(f"{type(e).__name__}: {e}")

    def eof_received(self) -> bool:
        """The client is gone: nobody will read its requests' outputs. The gateway never
        half-closes a framed connection (gateway/mux.py closes it by abort), so an EOF is a
        gateway that crashed, was killed or closed the connection. Returning False closes the
        transport, and `connection_lost` cancels the requests at once. Kept open, those still
        queued or waiting for a remote prefill would run on for nobody until their first
        output's write failed (tests/integration/test_faults.py)."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_handshake()
        if self.mux is not None:
            self.server.connections.discard(self)
            self.server.servicer._track(self.mux, False)
            self.mux.close()
        self.transport = None

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def finish(self) -> None:
        """Ended cleanly (drained): close once written."""
        if self.transport is not None:
            self.transport.close()

    def _hello(self, payload: bytes) -> None:
        hello = decode_pb2.MuxHello.FromString(payload)
        token = self.server.token
        if token is not None and not hmac.compare_digest(hello.token.encode(), token):
            self._refuse("missing or wrong internal token")
            return
        self._end_handshake()
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.mux = _FramedMux(self.server.servicer, _StreamContext(f"frames:{peer}"), self)
        self.reader.max_bytes = MAX_REQUEST_FRAME_BYTES
        self.server.connections.add(self)
        self.server.servicer._track(self.mux, True)
        self.write(frame(decode_pb2.MuxWelcome(version=FRAMES_VERSION)))

    def _end_handshake(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
            self.server.num_handshakes -= 1

    def _refuse(self, why: str) -> None:
        self.server.servicer.num_rejected_frame_connections += 1
        peer = self.transport.get_extra_info("peername") if self.transport else None
        logger.warning("framed GenerateMux connection from %s closed: %s", peer, why)
        if self.transport is not None:
            self.transport.abort()


class FramesServer:
    """The framed `GenerateMux` listener of one decode servicer (a `decode_mux.DecodeServicer`
    with an async `Generate`). `token` (bytes compared in constant time; None: no token) and
    `ssl` (a server context that requires client certificates; None: plain TCP) are the
    service's internal auth (engine/internal_auth.py `frames_auth`)."""

    def __init__(
        self,
        servicer: decode_mux.DecodeServicer,
        token: bytes | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.servicer = servicer
        self.token = token
        self.ssl = ssl_context
        self.connections: set[_Connection] = set()
        self.num_handshakes = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def num_rejected(self) -> int:
        """Connections closed for what they sent (or did not send) first, or a bad frame."""
        return self.servicer.num_rejected_frame_connections

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port, which the servicer then advertises to gRPC clients."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, ssl=self.ssl, reuse_address=True
        )
        port = self._server.sockets[0].getsockname()[1]
        self.servicer.frames_port = port
        return port

    def close(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled)."""
        self.servicer.frames_port = None
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
