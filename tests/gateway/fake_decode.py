"""A real gRPC `Decode` server whose `Generate` runs the offline engine: the gateway's test peer.

Why the real engine and not canned tokens: the gateway's detokenization, stop strings, usage
and n>1 seeding are only proven right if the tokens are what a decode would really produce, so
`Generate` calls `engine.LLM.generate` on the request's token ids with SamplingParams rebuilt
from the proto, then streams the output one token per chunk (the first carrying the prompt
logprobs when asked, as the decode service sends them). Knobs make it misbehave the ways a
decode can: refuse (RESOURCE_EXHAUSTED, as a status or as an Error event), fail mid-stream
(an Error event after some tokens), stream slowly (to test client disconnects).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from engine import LLM
from engine.serving import logprobs_to_proto, sampling_params_from_proto
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc

# The services' own conversion: the fake must read requests exactly as a real decode does.
params_from_proto = sampling_params_from_proto


@dataclass
class Knobs:
    refuse: bool = False  # abort Generate with RESOURCE_EXHAUSTED
    refuse_as_event: bool = False  # ... or answer with an Error(RESOURCE_EXHAUSTED) event
    cancel: bool = False  # end Generate with CANCELLED before any message (a stopping server)
    fail_after_tokens: int | None = None  # send Error(DECODE_FAILED) after this many tokens
    token_delay_s: float = 0.0
    max_tokens_cap: int | None = None  # generate at most this many (the request is recorded as is)


@dataclass
class Record:
    requests: list[decode_pb2.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # streams that ended without Final/Error
    aborted: list[str] = field(default_factory=list)  # ids passed to Abort
    finished: list[str] = field(default_factory=list)  # streams that sent Final


class FakeDecode(decode_mux.DecodeServicer):
    def __init__(self, llm: LLM, engine_lock: threading.Lock):
        self.llm = llm
        self.knobs = Knobs()
        self.record = Record()
        self._engine_lock = engine_lock  # LLM is single-threaded; fakes may share one
        self._active: dict[str, threading.Event] = {}  # request id -> "stop" flag

    def reset(self) -> None:
        self.knobs, self.record = Knobs(), Record()

    def Generate(self, request, context):
        self.record.requests.append(request)
        rid = request.request_id
        record, ended = self.record, []

        def on_termination() -> None:
            # A cancelled RPC's generator is never resumed, so only this callback sees it.
            if not ended:
                record.cancelled.append(rid)

        context.add_callback(on_termination)
        if self.knobs.refuse:
            ended.append(True)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full")
        if self.knobs.cancel:
            ended.append(True)
            context.abort(grpc.StatusCode.CANCELLED, "server is shutting down")
        if self.knobs.refuse_as_event:
            ended.append(True)
            error = common_pb2.Error(code=common_pb2.Error.RESOURCE_EXHAUSTED, message="full")
            yield decode_pb2.GenerateResponse(error=error)
            return
        try:  # as the decode service: a ValueError (bad params, a grammar that does not
            # compile) is INVALID_ARGUMENT, which the gateway answers with a 400
            params = params_from_proto(request.params)
            if self.knobs.max_tokens_cap is not None:
                cap = min(params.max_tokens, self.knobs.max_tokens_cap)
                params = dataclasses.replace(params, max_tokens=cap)
            with self._engine_lock:
                out = self.llm.generate([list(request.prompt_token_ids)], params)[0]
        except ValueError as e:
            ended.append(True)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        completion = out.outputs[0]
        stop = self._active[rid] = threading.Event()
        try:
            for i, token in enumerate(completion.token_ids):
                if i == self.knobs.fail_after_tokens:
                    error = common_pb2.Error(code=common_pb2.Error.DECODE_FAILED, message="boom")
                    ended.append(True)
                    yield decode_pb2.GenerateResponse(error=error)
                    return
                if stop.is_set():  # Abort
                    return
                chunk = decode_pb2.TokenChunk(token_ids=[token])
                if i == 0 and out.prompt_logprobs is not None:  # as the decode service does
                    chunk.prompt_logprobs.extend(map(logprobs_to_proto, out.prompt_logprobs[1:]))
                if completion.logprobs is not None:
                    lp = completion.logprobs[i]  # sampled token first, then the top-k
                    chunk.logprobs.append(
                        common_pb2.TokenLogprobs(token_ids=list(lp), logprobs=list(lp.values()))
                    )
                yield decode_pb2.GenerateResponse(tokens=chunk)
                if self.knobs.token_delay_s:
                    time.sleep(self.knobs.token_delay_s)
            final = decode_pb2.Final(
                finish_reason=completion.finish_reason,
                usage=common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=len(completion.token_ids),
                    cached_tokens=max(out.num_cached_tokens, 0),
                ),
            )
            if isinstance(completion.stop_reason, int):
                final.stop_token_id = completion.stop_reason
            ended.append(True)
            yield decode_pb2.GenerateResponse(final=final)
            record.finished.append(rid)
        finally:
            self._active.pop(rid, None)

    def Abort(self, request, context):
        self.record.aborted.append(request.request_id)
        stop = self._active.get(request.request_id)
        if stop is not None:
            stop.set()
        return common_pb2.AbortResponse(found=stop is not None)

    def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="fake", max_model_len=256)


def start_fake_decode(llm: LLM, engine_lock: threading.Lock) -> tuple[grpc.Server, FakeDecode, str]:
    """Serve a FakeDecode on a free loopback port; returns (server, servicer, "host:port")."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = FakeDecode(llm, engine_lock)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"
