"""Decode servicers that echo the prompt, for the GenerateMux tests: one for a grpc.aio server,
one for a thread-pool server, and a plain one without GenerateMux (an older decode).

`Generate` streams the prompt's ids back one per chunk, `delay_s` apart, then a Final. A prompt
that starts with ABORT aborts (INVALID_ARGUMENT), REFUSE aborts RESOURCE_EXHAUSTED, RAISE
raises. Each records the request ids it finished and those cancelled under it.

`python -m tests.protos.echo_decode PORT [DELAY_S] [--frames]` serves the aio one (the token of
the environment required, as a service does; with --frames also on the framed transport,
protos/mux_frames.py) and prints `READY`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent import futures

import grpc

from engine import internal_auth
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc, mux_frames

ABORT, REFUSE, RAISE = -1, -2, -3


def _chunk(token: int) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))


def _final(request: decode_pb2.GenerateRequest) -> decode_pb2.GenerateResponse:
    usage = common_pb2.Usage(completion_tokens=len(request.prompt_token_ids))
    return decode_pb2.GenerateResponse(final=decode_pb2.Final(finish_reason="length", usage=usage))


class EchoDecode(decode_mux.DecodeServicer):
    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.num_generate_contexts: dict[str, int] = {}  # context type -> Generate calls

    def _count(self, context) -> None:
        name = type(context).__name__
        self.num_generate_contexts[name] = self.num_generate_contexts.get(name, 0) + 1

    async def Generate(self, request, context):
        self._count(context)
        first = request.prompt_token_ids[0]
        if first == ABORT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
        if first == REFUSE:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full")
        if first == RAISE:
            raise RuntimeError("boom")
        try:
            for token in request.prompt_token_ids:
                yield _chunk(token)
                await asyncio.sleep(self.delay_s)
            yield _final(request)
            self.finished.append(request.request_id)
        except asyncio.CancelledError:  # as the decode service: the engine aborts it here
            self.cancelled.append(request.request_id)
            raise

    async def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)

    async def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="echo")


class ThreadEchoDecode(EchoDecode):
    """The same on a thread-pool server (as the gateway tests' fakes)."""

    def Generate(self, request, context):
        self._count(context)
        rid, ended = request.request_id, []
        context.add_callback(lambda: None if ended else self.cancelled.append(rid))
        first = request.prompt_token_ids[0]
        if first in (ABORT, REFUSE, RAISE):
            ended.append(True)
        if first == ABORT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
        if first == REFUSE:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full")
        if first == RAISE:
            raise RuntimeError("boom")
        for token in request.prompt_token_ids:
            yield _chunk(token)
            time.sleep(self.delay_s)
        ended.append(True)
        yield _final(request)
        self.finished.append(rid)

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)

    def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="echo")


class OldDecode(decode_pb2_grpc.DecodeServicer):
    """A decode from before GenerateMux (the generated servicer answers it UNIMPLEMENTED)."""

    __init__ = EchoDecode.__init__
    _count = EchoDecode._count
    Generate = EchoDecode.Generate


class CountMethods(grpc.aio.ServerInterceptor):
    """Counts the calls per method name (`Generate`, `GenerateMux`, ...)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    async def intercept_service(self, continuation, details):
        name = details.method.rsplit("/", 1)[-1]
        self.counts[name] = self.counts.get(name, 0) + 1
        return await continuation(details)


async def serve_aio(servicer, port: int = 0, interceptors=()) -> tuple[grpc.aio.Server, str]:
    """Serve `servicer` on loopback; returns the server and "host:port"."""
    server = grpc.aio.server(interceptors=list(interceptors))
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def serve_threads(servicer: ThreadEchoDecode) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


async def _main(port: int, delay_s: float, frames: bool) -> None:
    interceptors = internal_auth.server_interceptors()
    servicer = EchoDecode(delay_s)
    if frames:  # before the gRPC server starts, so that every stream advertises them
        await mux_frames.FramesServer(servicer, *internal_auth.frames_auth()).start("127.0.0.1", 0)
    server, address = await serve_aio(servicer, port, interceptors)
    print(f"READY {address}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    asyncio.run(_main(int(sys.argv[1]), delay, "--frames" in sys.argv[3:]))
