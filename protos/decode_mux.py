"""`GenerateMux` for any Decode servicer: many `Generate` calls over one bidirectional stream.

A servicer subclasses `DecodeServicer` here instead of the generated one and gets `GenerateMux`
built on its own `Generate`, on a grpc.aio server (`Generate` an async generator) or a
thread-pool one (`Generate` a plain generator). Lifecycle of one stream:
  MuxRequest(id, start) → `Generate(start, sub-context)` runs as its own task (thread) and each
    message it yields becomes MuxItem(id, response); when it returns, aborts or raises, a
    MuxItem(id, end=status) carries the status the unary call would have ended with (OK,
    `context.abort`'s code and details, UNKNOWN for an exception). One request's failure is
    only its own: the stream and the other requests go on.
  MuxRequest(id, cancel) → that request is cancelled as a cancelled `Generate` call would be
    (the decode aborts it); no end item follows.
  Items ready together go out in one MuxResponse (one write for several requests' chunks).
  The client half-closes → the stream ends once its requests have; the stream is cancelled or
    breaks → every request on it is cancelled.
  The service drains (`close_mux_streams`) → new starts are refused with UNAVAILABLE (the
    gateway tries another decode, as when a draining server refuses a call) and each stream
    ends (OK) once its requests have, so that the server's stop does not wait for it.
No message stops the stream: an id of 0, a duplicate of an id in flight, a start past
`MAX_REQUESTS_PER_STREAM` in flight or a message with neither start nor cancel gets an end item
for its id (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED); a cancel of an unknown id is
ignored (it may have just ended). Each is counted in `num_rejected_mux_messages`.
The server sends `MUX_METADATA` as the stream's initial metadata at once; a client waits for it
before its first write. The sub-context is the stream's context (metadata, peer, deadline) with
its own status, abort and termination callbacks; authentication is the stream's
(engine/internal_auth.py: a stream without the token is refused whole).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from protos import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

# Requests in flight on one stream; past it a start is refused like a full decode (the gateway
# tries another). Well above what one engine admits (its own limits refuse first).
MAX_REQUESTS_PER_STREAM = 4096
# Sent first, before any request: a client writes only once it has seen it, so that no write
# can race a stream refused at once (UNIMPLEMENTED, UNAUTHENTICATED) and mask its status.
MUX_METADATA = (("tandem-mux", "1"),)
FRAMES_METADATA_KEY = "tandem-mux-frames"  # the decode's framed-transport port, if it has one
_OK = decode_pb2.MuxStatus(code=grpc.StatusCode.OK.value[0])


class _Abort(Exception):
    """`context.abort` inside one request of a stream: ends that request only."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """The generated servicer plus `GenerateMux` on top of the subclass's `Generate`."""

    num_rejected_mux_messages = 0
    num_rejected_frame_connections = 0  # protos/mux_frames.py: connections it closed
    _mux_streams: set | None = None  # live streams (subclasses need not call __init__)
    is_draining = False
    frames_port: int | None = None  # set by protos/mux_frames.FramesServer.start

    def mux_metadata(self) -> tuple[tuple[str, str], ...]:
        """The stream's initial metadata: MUX_METADATA, and the port of the framed transport
        (protos/mux_frames.py) when this servicer has one, which a client may then prefer."""
        if self.frames_port is None:
            return MUX_METADATA
        return (*MUX_METADATA, (FRAMES_METADATA_KEY, str(self.frames_port)))

    def close_mux_streams(self) -> None:
        """Drain: refuse new requests on every stream and end each once its requests have."""
        self.is_draining = True
        for stream in list(self._mux_streams or ()):
            stream.wake()

    def _track(self, stream: _AsyncMux | _ThreadMux, is_live: bool) -> None:
        if self._mux_streams is None:
            self._mux_streams = set()
        if is_live:
            self._mux_streams.add(stream)
        else:
            self._mux_streams.discard(stream)

    @property
    def GenerateMux(self) -> Callable:
        if inspect.isasyncgenfunction(self.Generate):
            return self._generate_mux_async
        return self._generate_mux_threads

    async def _generate_mux_async(self, request_iterator, context):
        await context.send_initial_metadata(self.mux_metadata())
        async for response in _AsyncMux(self, context).responses(request_iterator):
            yield response

    def _generate_mux_threads(self, request_iterator, context):
        context.send_initial_metadata(self.mux_metadata())
        yield from _ThreadMux(self, context).responses(request_iterator)


def _end(status: grpc.StatusCode, details: str) -> decode_pb2.MuxStatus:
    return decode_pb2.MuxStatus(code=status.value[0], details=details)


def _check_start(
    servicer: DecodeServicer, message: decode_pb2.MuxRequest, in_flight: dict
) -> decode_pb2.MuxStatus | None:
    """Why this message cannot start a request (its end status), or None if it can."""
    rid, kind = message.id, message.WhichOneof("kind")
    if kind != "start":
        why = _end(grpc.StatusCode.INVALID_ARGUMENT, "GenerateMux message without start or cancel")
    elif rid == 0:
        why = _end(grpc.StatusCode.INVALID_ARGUMENT, "GenerateMux request id must be > 0")
    elif rid in in_flight:
        why = _end(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid} is already in flight")
    elif servicer.is_draining:
        return _end(grpc.StatusCode.UNAVAILABLE, "the decode is draining")
    elif len(in_flight) >= MAX_REQUESTS_PER_STREAM:
        why = _end(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{MAX_REQUESTS_PER_STREAM} requests in flight on this GenerateMux stream",
        )
    else:
        return None
    servicer.num_rejected_mux_messages += 1
    return why


def _unexpected(e: Exception) -> decode_pb2.MuxStatus:
    logger.exception("Generate failed on a GenerateMux stream")
    return _end(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e)}: {e}")  # as grpc reports it


class _SubContext:
    """A request's view of the stream's context: its own status and callbacks, the rest shared."""

    def __init__(self, stream_context):
        self._stream = stream_context
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._callbacks: list[Callable] = []
        self.is_cancelled = False

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def cancelled(self) -> bool:
        return self.is_cancelled

    def status(self) -> decode_pb2.MuxStatus:
        """What a handler that returned normally ended with (set_code, or OK)."""
        if self._code is None or self._code == grpc.StatusCode.OK:
            return _OK
        return _end(self._code, self._details)

    def terminate(self, *args: Any) -> None:
        """Run the termination callbacks (once), as grpc does when a call ends."""
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(*args)
            except Exception:
                logger.exception("a GenerateMux request's termination callback failed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _AsyncSubContext(_SubContext):
    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        raise _Abort(code, details)

    def done(self) -> bool:
        return self.is_cancelled

    def add_done_callback(self, callback: Callable) -> None:
        self._callbacks.append(callback)


class _AsyncMux:
    """One stream on a grpc.aio server: a task per request, one writer (the handler itself)."""

    def __init__(self, servicer: DecodeServicer, context):
        self.servicer, self.context = servicer, context
        self.tasks: dict[int, asyncio.Task] = {}
        self.batch = decode_pb2.MuxResponse()  # items not yet written
        self.is_ready = asyncio.Event()  # set when items or the end of the stream may be due
        self.is_reading = True

    def wake(self) -> None:
        self.is_ready.set()

    async def responses(self, request_iterator) -> AsyncIterator[decode_pb2.MuxResponse]:
        reader = asyncio.create_task(self._read(request_iterator))
        self.servicer._track(self, True)
        try:
            while True:
                if self.batch.items:
                    batch, self.batch = self.batch, decode_pb2.MuxResponse()
                    yield batch
                    continue
                is_open = self.is_reading and not self.servicer.is_draining
                if not is_open and not self.tasks:
                    return
                self.is_ready.clear()
                await self.is_ready.wait()
        finally:  # ended, cancelled or broken: nobody reads the requests' outputs any more
            self.servicer._track(self, False)
            reader.cancel()
            for task in self.tasks.values():
                task.cancel()

    async def _read(self, request_iterator) -> None:
        try:
            async for message in request_iterator:
                self._on_message(message)
        except Exception as e:  # the stream broke; the handler is being cancelled too
            logger.debug("GenerateMux stream stopped reading: %r", e)
        finally:
            self.is_reading = False
            self.is_ready.set()

    def _on_message(self, message: decode_pb2.MuxRequest) -> None:
        if message.WhichOneof("kind") == "cancel":
            task = self.tasks.get(message.id)
            if task is None:  # unknown, or it ended meanwhile
                self.servicer.num_rejected_mux_messages += 1
            else:
                task.cancel()
            return
        why = _check_start(self.servicer, message, self.tasks)
        if why is not None:
            self._put(message.id, end=why)
            return
        rid, context = message.id, _AsyncSubContext(self.context)
        task = self.tasks[rid] = asyncio.create_task(self._run(rid, message.start, context))
        task.add_done_callback(lambda t: self._forget(rid, context, t))

    def _put(self, rid: int, **kind) -> None:
        self.batch.items.add(id=rid, **kind)
        self.wake()

    async def _run(self, rid: int, request, context: _AsyncSubContext) -> None:
        try:
            async for response in self.servicer.Generate(request, context):
                self._put(rid, response=response)
            end = context.status()
        except _Abort as e:
            end = _end(e.code, e.details)
        except Exception as e:
            end = _unexpected(e)
        self._put(rid, end=end)

    def _forget(self, rid: int, context: _AsyncSubContext, task: asyncio.Task) -> None:
        """A request's task is done (cancelled ones too, even before they started)."""
        del self.tasks[rid]
        context.is_cancelled = task.cancelled()
        context.terminate(context)
        self.wake()  # the stream may be due to end


class _SyncSubContext(_SubContext):
    def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Abort(code, details)

    def is_active(self) -> bool:
        return not self.is_cancelled and self._stream.is_active()

    def add_callback(self, callback: Callable) -> bool:
        self._callbacks.append(callback)
        return True


class _ThreadMux:
    """One stream on a thread-pool server: a thread per request and one reading requests; the
    handler's thread writes. Every change of state puts something on `out`, so it wakes."""

    def __init__(self, servicer: DecodeServicer, context):
        self.servicer, self.context = servicer, context
        self.lock = threading.Lock()
        self.contexts: dict[int, _SyncSubContext] = {}  # requests in flight
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # MuxItem kwargs, or None: wake up
        self.is_reading = True
        self.has_ended = False
        context.add_callback(self._on_stream_end)

    def wake(self) -> None:
        self.out.put(None)

    def responses(self, request_iterator) -> Iterator[decode_pb2.MuxResponse]:
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True).start()
        self.servicer._track(self, True)
        try:
            yield from self._responses()
        finally:
            self.servicer._track(self, False)

    def _responses(self) -> Iterator[decode_pb2.MuxResponse]:
        while True:
            batch = decode_pb2.MuxResponse()
            entry = self.out.get()
            while True:
                if entry is not None:
                    batch.items.add(**entry)
                try:
                    entry = self.out.get_nowait()
                except queue.Empty:
                    break
            if self.has_ended:
                return
            if batch.items:
                yield batch
            with self.lock:
                is_open = self.is_reading and not self.servicer.is_draining
                if not is_open and not self.contexts and self.out.empty():
                    return

    def _on_stream_end(self) -> None:
        with self.lock:
            self.has_ended = True
            contexts = list(self.contexts.values())
        for context in contexts:
            self._cancel(context)
        self.out.put(None)

    def _cancel(self, context: _SyncSubContext) -> None:
        context.is_cancelled = True
        context.terminate()

    def _read(self, request_iterator) -> None:
        try:
            for message in request_iterator:
                self._on_message(message)
        except Exception as e:  # the stream broke or was cancelled
            logger.debug("GenerateMux stream stopped reading: %r", e)
        finally:
            with self.lock:
                self.is_reading = False
            self.out.put(None)

    def _on_message(self, message: decode_pb2.MuxRequest) -> None:
        rid = message.id
        with self.lock:
            if message.WhichOneof("kind") == "cancel":
                context = self.contexts.pop(rid, None)
                if context is None:
                    self.servicer.num_rejected_mux_messages += 1
                    return
            else:
                why = _check_start(self.servicer, message, self.contexts)
                if why is None:
                    context = self.contexts[rid] = _SyncSubContext(self.context)
        if message.WhichOneof("kind") == "cancel":
            self._cancel(context)  # its thread stops at its next message
        elif why is not None:
            self.out.put({"id": rid, "end": why})
        else:
            args = (rid, message.start, context)
            threading.Thread(target=self._run, args=args, daemon=True).start()

    def _run(self, rid: int, request, context: _SyncSubContext) -> None:
        end, responses = None, None
        try:
            responses = self.servicer.Generate(request, context)
            for response in responses:
                if context.is_cancelled:
                    break
                self.out.put({"id": rid, "response": response})
            else:
                end = context.status()
        except _Abort as e:
            end = _end(e.code, e.details)
        except Exception as e:
            end = _unexpected(e)
        finally:
            if hasattr(responses, "close"):
                responses.close()
        if end is not None and not context.is_cancelled:
            self.out.put({"id": rid, "end": end})  # before it leaves `contexts`: see responses
        with self.lock:
            is_mine = self.contexts.get(rid) is context
            if is_mine:
                del self.contexts[rid]
        self.out.put(None)
        if is_mine:
            context.terminate()
