"""One `GenerateMux` stream per decode, which all the requests to that decode ride.

A unary-stream call costs the gateway ~0.8 ms of CPU per request (call set-up, its interceptor
task, a completion per message); on one long-lived stream a request costs a write and its share
of the batched reads (protos/decode_mux.py batches the server's side).

Lifecycle of a stream (`MuxStream`), one per channel:
  opened by the first request to its decode; grpc's task writes the starts and cancels queued
    in `outbox`, and a reader task hands each MuxItem to its request's `MuxCall`;
  breaks (the decode died, the connection dropped, it drained) → every request on it gets the
    stream's status, as its own broken call would have; the next request opens a new stream;
  UNIMPLEMENTED (a decode without GenerateMux) → its requests, and those to that decode for
    `UNARY_FALLBACK_S`, are unary `Generate` calls.
The framed transport (protos/mux_frames.py: the same messages on a socket the event loop reads
itself, without grpc.aio's threads: 0.23-0.68 ms less of the gateway's CPU per request, 0.17 ms
less at the decode, bench/README.md "The gateway's requests on framed TCP instead of gRPC"): a
decode that has it advertises its port in the stream's initial metadata; `DecodeGenerate` then
connects (`FramedStream`: mTLS and the internal token as gRPC) and sends new requests there
while it is open. A framed connection that cannot be made, or breaks, sends requests back to
the gRPC stream, and is tried again after `FRAMES_RETRY_S` (doubling up to a minute while it
keeps failing). Requests on a broken connection get UNAVAILABLE, as on a broken stream.
A `MuxCall` reads like the unary call it replaces: `read()` gives a GenerateResponse or EOF, or
raises the `grpc.aio.AioRpcError` that call would have; `cancel()` (or cancelling a `read()`)
sends a MuxCancel, which aborts the request at the decode as cancelling the call did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from engine import internal_auth
from protos import decode_mux, decode_pb2, decode_pb2_grpc
from protos.mux_frames import FRAMES_VERSION, MAX_HELLO_BYTES, FrameError, FrameReader, frame

logger = logging.getLogger(__name__)

UNARY_FALLBACK_S = 60.0  # a decode without GenerateMux: unary calls, then ask again
FRAMES_RETRY_S = 2.0  # a framed connection failed or broke: gRPC until then (doubling, to 60 s)
FRAMES_CONNECT_TIMEOUT_S = 5.0  # connection, TLS and the hello's answer
MAX_RESPONSE_FRAME_BYTES = 64 * 1024 * 1024  # as the channels' max_receive_message_length
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_CANCEL = decode_pb2.MuxCancel()
_WRITE_FAILED = "Internal error from Core"  # grpc.aio's status for a failed write


class GenerateCall(Protocol):
    """What the dispatcher needs of a `Generate` call, unary or on a stream."""

    async def read(self) -> decode_pb2.GenerateResponse | Any: ...  # or grpc.aio.EOF

    def cancel(self) -> bool: ...


def poll(call: GenerateCall) -> decode_pb2.GenerateResponse | None:
    """The call's next response if it has already arrived, else None (always None for a unary
    call, which cannot tell): what a reader that fell behind may take without waiting."""
    take = getattr(call, "poll", None)
    return None if take is None else take()


class _Waitable:
    """A deque with one waiter: a wake-up without an asyncio.Queue per request."""

    __slots__ = ("items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: deque = deque()
        self._loop = loop  # not asyncio.get_running_loop() per wait: it calls getpid (3.11)
        self._waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until an item is there (returns at once when one is)."""
        while not self.items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class MuxCall:
    """One request on a stream."""

    __slots__ = ("_stream", "id", "request", "_inbox", "_unary")

    def __init__(self, stream: MuxStream, rid: int, request: decode_pb2.GenerateRequest):
        self._stream, self.id, self.request = stream, rid, request
        self._inbox = _Waitable(stream.loop)  # GenerateResponse, EOF, AioRpcError, _FALLBACK
        self._unary: grpc.aio.UnaryStreamCall | None = None

    async def read(self) -> decode_pb2.GenerateResponse | Any:
        if self._unary is not None:
            return await self._unary.read()
        inbox = self._inbox
        if not inbox.items:
            try:
                await inbox.wait()
            except asyncio.CancelledError:  # as grpc's read(): a cancelled read cancels the call
                self.cancel()
                raise
        entry = inbox.items.popleft()
        if isinstance(entry, grpc.aio.AioRpcError):
            raise entry
        if entry is _FALLBACK:
            self._unary = self._stream.stub.Generate(self.request)
            return await self._unary.read()
        return entry

    def poll(self) -> decode_pb2.GenerateResponse | None:
        """The next response if it is here already; an end (EOF, an error) is left for read."""
        items = self._inbox.items
        if self._unary is None and items and type(items[0]) is decode_pb2.GenerateResponse:
            return items.popleft()
        return None

    def cancel(self) -> bool:
        if self._unary is not None:
            return self._unary.cancel()
        return self._stream.cancel(self.id)


_FALLBACK = object()  # the stream is UNIMPLEMENTED: this call goes unary


class MuxStream:
    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str, on_frames_port=None):
        self.stub, self.address = stub, address
        self._on_frames_port = on_frames_port  # called with the port the decode advertises
        self.calls: dict[int, MuxCall] = {}  # in flight: started, not ended nor cancelled
        self.error: grpc.aio.AioRpcError | None = None  # why the stream ended; None while open
        self._next_id = 1
        self.loop = asyncio.get_running_loop()
        self._outbox = _Waitable(self.loop)
        self._call = stub.GenerateMux(self._requests())
        self._reader = asyncio.create_task(self._read())

    @property
    def is_open(self) -> bool:
        return self.error is None

    @property
    def is_unimplemented(self) -> bool:
        return self.error is not None and self.error.code() == grpc.StatusCode.UNIMPLEMENTED

    def start(self, request: decode_pb2.GenerateRequest) -> MuxCall:
        assert self.error is None, "start on a closed stream"
        rid, self._next_id = self._next_id, self._next_id + 1
        call = self.calls[rid] = MuxCall(self, rid, request)
        self._outbox.put(decode_pb2.MuxRequest(id=rid, start=request))
        return call

    def cancel(self, rid: int) -> bool:
        """Forget request `rid` and tell the decode to abort it; False if it had ended."""
        if self.calls.pop(rid, None) is None:
            return False
        if self.error is None:
            self._outbox.put(decode_pb2.MuxRequest(id=rid, cancel=_CANCEL))
        return True

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()

    async def _requests(self) -> AsyncIterator[decode_pb2.MuxRequest]:
        """grpc's writer task takes the stream's messages from here, in order."""
        metadata = list(await self._call.initial_metadata() or ())
        if ("tandem-mux", "1") not in metadata:
            # Refused at once (trailers only): a write now could fail and, in grpc.aio, replace
            # the refusal's status (UNIMPLEMENTED, UNAUTHENTICATED) with INTERNAL.
            return
        if self._on_frames_port is not None:  # None when the decode has none (any more)
            ports = [int(v) for k, v in metadata if k == decode_mux.FRAMES_METADATA_KEY]
            self._on_frames_port(ports[0] if ports else None)
        outbox = self._outbox
        while True:
            await outbox.wait()
            message = outbox.items.popleft()
            if message is None:  # the stream ended
                return
            yield message

    async def _read(self) -> None:
        calls = self.calls
        try:
            while True:
                batch = await self._call.read()
                if batch is grpc.aio.EOF:  # the decode ended it (drained) without an error
                    error = _error(grpc.StatusCode.UNAVAILABLE, "the GenerateMux stream ended")
                    break
                deliver(calls, batch)
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.INTERNAL and e.details() == _WRITE_FAILED:
                # A write failed as the stream broke, and grpc.aio put its own INTERNAL in place
                # of the stream's status: the connection went, as UNAVAILABLE says.
                error = _error(grpc.StatusCode.UNAVAILABLE, f"broke: {e.debug_error_string()}")
        except asyncio.CancelledError:  # closed
            error = _error(grpc.StatusCode.CANCELLED, "the GenerateMux stream was closed")
        except Exception as e:  # never leave the requests on it waiting
            logger.exception("GenerateMux stream to %s failed", self.address)
            error = _error(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        self.error = error
        self._outbox.put(None)  # ends _requests
        self._call.cancel()
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            logger.info("%s has no GenerateMux: unary Generate calls", self.address)
            error = _FALLBACK
        elif calls:
            logger.info("GenerateMux stream to %s ended: %s", self.address, error.code().name)
        for call in calls.values():
            call._inbox.put(error)
        calls.clear()


def deliver(calls: dict[int, MuxCall], batch) -> None:
    """One MuxResponse's items into their calls' inboxes: a response, or the end of a call (EOF
    when OK, else its error), which also forgets the call. Ids not in `calls` (cancelled, or
    never sent on this stream) are dropped."""
    for item in batch.items:
        call = calls.get(item.id)
        if call is None:
            continue
        if item.HasField("response"):
            call._inbox.put(item.response)
            continue
        del calls[item.id]
        code = _STATUS.get(item.end.code, grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.OK:
            call._inbox.put(grpc.aio.EOF)
        else:
            call._inbox.put(_error(code, item.end.details, item.id))


def _error(code: grpc.StatusCode, details: str, rid: int | None = None) -> grpc.aio.AioRpcError:
    where = "GenerateMux stream" if rid is None else f"GenerateMux request {rid}"
    return grpc.aio.AioRpcError(code, None, None, details, where)


class FramedStream(asyncio.Protocol):
    """`GenerateMux` on a framed connection (protos/mux_frames.py): what `MuxStream` is to its
    calls (`loop`, `calls`, `start`, `cancel`), so that `MuxCall` serves the dispatcher as is."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.loop = asyncio.get_running_loop()
        self.calls: dict[int, MuxCall] = {}
        self.error: grpc.aio.AioRpcError | None = None  # why it ended; None while open
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader(MAX_HELLO_BYTES)
        self._welcomed = self.loop.create_future()
        self._next_id = 1

    async def connect(self, host: str, port: int) -> None:
        """Connect, say hello and wait for the welcome; raises OSError (refused, TLS, timeout)
        or ConnectionError (the decode closed it: a wrong token) on failure."""
        context = internal_auth.ssl_context(server=False)
        hello = decode_pb2.MuxHello(token=internal_auth.internal_token() or "")
        hello.version = FRAMES_VERSION

        async def handshake() -> None:
            await self.loop.create_connection(
                lambda: self, host, port, ssl=context, server_hostname=host if context else None
            )
            self.transport.write(frame(hello))
            await self._welcomed

        await asyncio.wait_for(handshake(), FRAMES_CONNECT_TIMEOUT_S)

    @property
    def is_open(self) -> bool:
        transport = self.transport
        return (
            self.error is None
            and self._welcomed.done()
            and transport is not None
            and not transport.is_closing()
        )

    def start(self, request: decode_pb2.GenerateRequest) -> MuxCall:
        rid, self._next_id = self._next_id, self._next_id + 1
        call = self.calls[rid] = MuxCall(self, rid, request)  # type: ignore[arg-type]
        self.transport.write(frame(decode_pb2.MuxRequest(id=rid, start=request)))
        return call

    def cancel(self, rid: int) -> bool:
        if self.calls.pop(rid, None) is None:
            return False
        if self.is_open:
            self.transport.write(frame(decode_pb2.MuxRequest(id=rid, cancel=_CANCEL)))
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost ends the calls on it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self._reader.feed(data):
                if self._welcomed.done():
                    deliver(self.calls, decode_pb2.MuxResponse.FromString(payload))
                else:
                    decode_pb2.MuxWelcome.FromString(payload)
                    self._reader.max_bytes = MAX_RESPONSE_FRAME_BYTES
                    self._welcomed.set_result(None)
        except (FrameError, DecodeError) as e:
            logger.error("framed GenerateMux from %s: a bad frame (%s); closing", self.address, e)
            self.error = _error(grpc.StatusCode.INTERNAL, f"bad frame from the decode: {e}")
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._welcomed.done():
            self._welcomed.set_exception(ConnectionError(f"closed before the welcome ({exc!r})"))
            self._welcomed.exception()  # retrieved: connect() may have timed out already
        why = "ended" if exc is None else f"broke: {exc!r}"
        if self.error is None:
            self.error = _error(grpc.StatusCode.UNAVAILABLE, f"the framed connection {why}")
        if self.calls:
            logger.info("framed GenerateMux to %s ended: %s", self.address, self.error.details())
        for call in self.calls.values():
            call._inbox.put(self.error)
        self.calls.clear()
        self.transport = None


class DecodeGenerate:
    """`Generate` on one decode: on its framed connection while one is open, else on its gRPC
    stream, or unary where it has none."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str):
        self.stub, self.address = stub, address
        self.stream: MuxStream | None = None
        self.frames: FramedStream | None = None
        self._frames_port: int | None = None  # as the decode's gRPC stream advertised it
        self._frames_task: asyncio.Task | None = None
        self._frames_after_s = 0.0  # no framed connection tried before this
        self._frames_retry_s = FRAMES_RETRY_S
        self._unary_until_s = 0.0

    def __call__(self, request: decode_pb2.GenerateRequest) -> GenerateCall:
        frames = self.frames
        if frames is not None:
            if frames.is_open:
                return frames.start(request)
            self.frames = None  # it broke: gRPC now, a new connection after the back-off
            self._back_off()
        self._connect_frames()
        stream = self.stream
        if stream is None or not stream.is_open:
            if stream is not None and stream.is_unimplemented:
                self._unary_until_s = time.monotonic() + UNARY_FALLBACK_S
                self.stream = None
            if time.monotonic() < self._unary_until_s:
                return self.stub.Generate(request)
            stream = self.stream = MuxStream(self.stub, self.address, self._on_frames_port)
        return stream.start(request)

    def _on_frames_port(self, port: int | None) -> None:
        self._frames_port = port
        self._connect_frames()

    def _back_off(self) -> None:
        self._frames_after_s = time.monotonic() + self._frames_retry_s
        self._frames_retry_s = min(2 * self._frames_retry_s, 60.0)

    def _connect_frames(self) -> None:
        if (
            self._frames_port is None
            or self._frames_task is not None
            or time.monotonic() < self._frames_after_s
        ):
            return
        host, sep, _ = self.address.rpartition(":")
        if not sep:  # not host:port; gRPC's other target forms stay on gRPC
            self._frames_port = None
            return
        task = asyncio.create_task(self._connect(host.strip("[]"), self._frames_port))
        self._frames_task = task

    async def _connect(self, host: str, port: int) -> None:
        stream = FramedStream(self.address)
        try:
            await stream.connect(host, port)
        except OSError as e:  # refused, reset, closed (a wrong token), TLS, timed out
            stream.close()
            self._back_off()
            logger.warning(
                "framed GenerateMux to %s (port %d) failed: %r; its requests stay on gRPC, "
                "next try in %.0f s",
                self.address,
                port,
                e,
                self._frames_after_s - time.monotonic(),
            )
            return
        finally:
            self._frames_task = None
        self._frames_retry_s = FRAMES_RETRY_S
        self.frames = stream
        logger.info("framed GenerateMux to %s (port %d) open", self.address, port)

    def close(self) -> None:
        if self._frames_task is not None:
            self._frames_task.cancel()
        if self.frames is not None:
            self.frames.close()
        if self.stream is not None:
            self.stream.close()
