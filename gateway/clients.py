"""gRPC channels to the decode instances, one per address, created lazily on the event loop.

grpc.aio channels bind to the loop that creates them, so they are made on first use inside a
request, not at import or settings time. Short reconnect backoff: a decode that restarts should
be reachable again within a couple of seconds, not after grpc's default two-minute backoff.
`generate` sends a request on the channel's one `GenerateMux` stream (gateway/mux.py).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from engine import internal_auth
from gateway.mux import DecodeGenerate, GenerateCall
from gateway.registry import Instance
from gateway.router import Outcome
from protos import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
# Codes that mean "no server answered"; anything else proves the instance is up.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class DecodeClients:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, decode_pb2_grpc.DecodeStub] = {}
        self._generates: dict[str, DecodeGenerate] = {}
        self._background: set[asyncio.Task] = set()

    def stub(self, instance: Instance) -> decode_pb2_grpc.DecodeStub:
        stub = self._stubs.get(instance.address)
        if stub is None:
            channel = internal_auth.internal_channel(instance.address, options=_CHANNEL_OPTIONS)
            self._channels[instance.address] = channel
            stub = self._stubs[instance.address] = decode_pb2_grpc.DecodeStub(channel)
        return stub

    def generate(self, instance: Instance, request: decode_pb2.GenerateRequest) -> GenerateCall:
        """Start `Generate` at `instance`: on its stream (unary where it has none)."""
        generate = self._generates.get(instance.address)
        if generate is None:
            generate = DecodeGenerate(self.stub(instance), instance.address)
            self._generates[instance.address] = generate
        return generate(request)

    async def probe(self, instance: Instance, timeout_s: float) -> Outcome:
        """Ask for the instance's load; only "no answer" counts as unreachable."""
        try:
            await self.stub(instance).GetLoad(common_pb2.LoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in _UNREACHABLE:
                return Outcome.UNAVAILABLE
        return Outcome.OK

    def abort_soon(self, instance: Instance, request_id: str) -> None:
        """Best-effort `D.Abort` in the background (the stream is already cancelled)."""
        task = asyncio.create_task(self._abort(instance, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, instance: Instance, request_id: str) -> None:
        try:
            req = common_pb2.AbortRequest(request_id=request_id)
            await self.stub(instance).Abort(req, timeout=2.0)
        except grpc.aio.AioRpcError as e:
            logger.debug("abort of %s at %s failed: %s", request_id, instance.address, e.code())

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for generate in self._generates.values():
            generate.close()
        self._generates.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
