"""Sending children to decodes and turning their token streams into text deltas.

Lifecycle of one child (one engine request):
  plan routes → for each decode in order: `Generate` (on the decode's GenerateMux stream,
  gateway/mux.py, which reads like a unary call) and wait for the first message
    RESOURCE_EXHAUSTED (status or Error event) → report REFUSED, try the next decode
    UNAVAILABLE → report UNAVAILABLE (router cools it down), try the next decode
    first TokenChunk → admitted; from here on the child is a `ChildStream`; it carries the
    prompt logprobs when the job asked for them (all of them, or the child fails)
  TokenChunk → detokenize + stop strings (engine `RequestState`) → `TokenDelta`
    stop string hit → cancel the call and `D.Abort` it; the delta carries finish "stop"
  Final → flush held-back text; the delta carries finish_reason and cached tokens
  Error / broken stream → `APIError` (the route turns it into an SSE error event or HTTP error)
A child whose consumer goes away (client disconnect, a sibling failed) cancels its call, which
makes D abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import EngineCoreOutput
from engine.params_proto import sampling_params_to_proto
from gateway.clients import DecodeClients
from gateway.errors import (
    DECODE_BUSY_MID_STREAM,
    DECODE_FAILED,
    DECODE_FAILED_MID_STREAM,
    APIError,
    hidden_failure,
)
from gateway.mux import GenerateCall, poll
from gateway.preprocess import ChildJob
from gateway.router import Outcome, Route, Router
from protos import common_pb2, decode_pb2

if TYPE_CHECKING:  # the gateway imports no transformers (ARCHITECTURE: light gateway)
    from transformers import PreTrainedTokenizerBase

_ERROR_STATUS = {
    common_pb2.Error.INVALID_ARGUMENT: 400,
    common_pb2.Error.RESOURCE_EXHAUSTED: 503,
}
Defer = Callable[..., None]  # defer(fn, *args): call fn(*args) now or later (Bookkeeping.defer)


def _call_now(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


@dataclass
class TokenDelta:
    index: int  # choice index
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # first delta only, when the job asked


@dataclass
class PromptLogprobs:
    k: int  # top logprobs asked per prompt token
    logprobs: list[common_pb2.TokenLogprobs]  # prompt tokens 1.. (token 0 has none)


@dataclass
class RequestOptions:
    request_id: str
    cache_salt: str = ""
    priority: int = 0
    retry_after_s: int = 1


class ChildStream:
    def __init__(
        self,
        job: ChildJob,
        state: RequestState,
        call: GenerateCall,
        first: decode_pb2.GenerateResponse,
        route: Route,
        clients: DecodeClients,
        router: Router,
        ttft_s: float,
        defer: Defer = _call_now,
    ):
        self.job, self.state, self.call, self.route = job, state, call, route
        self.decode = route.decode
        self._first = first
        self._clients, self._router, self._ttft_s = clients, router, ttft_s
        self._defer = defer
        self._is_done = False
        self._wants_prompt_logprobs = job.params.prompt_logprobs is not None

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        msg = self._first
        try:
            while True:
                kind = msg.WhichOneof("kind")
                if kind == "tokens":
                    chunks = [msg.tokens]
                    msg = poll(self.call)  # fell behind: what came meanwhile, as one delta
                    while msg is not None and msg.WhichOneof("kind") == "tokens":
                        chunks.append(msg.tokens)
                        msg = poll(self.call)
                    delta = self._on_tokens(chunks)
                    if self.state.finish_reason is not None:  # a stop string ended it here
                        self._is_done = True
                        self.call.cancel()  # D aborts on cancellation; Abort is belt and braces
                        self._clients.abort_soon(self.decode, self.state.request_id)
                        yield delta
                        return
                    yield delta
                    if msg is None:
                        msg = await self._read()
                    continue
                if kind == "final":
                    self._is_done = True
                    num_prompt_tokens = len(self.job.prompt_token_ids)
                    timings = msg.final.timings
                    observe = self._router.observe
                    self._defer(observe, self.route, self._ttft_s, timings, num_prompt_tokens)
                    yield self._on_final(msg.final)
                    return
                elif kind == "error":
                    self._is_done = True
                    raise error_from_event(msg.error)
                msg = await self._read()
        finally:
            self.cancel()

    def cancel(self) -> None:
        if not self._is_done:
            self._is_done = True
            self.call.cancel()

    async def _read(self) -> decode_pb2.GenerateResponse:
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as e:
            self._is_done = True
            detail = (
                f"{self.state.request_id} at {self.decode.address}: {e.code().name}: "
                f"{e.details()} ({e.debug_error_string()})"
            )
            raise hidden_failure(DECODE_FAILED_MID_STREAM, detail) from e
        if msg is grpc.aio.EOF:
            self._is_done = True
            raise APIError("Decode ended the stream without a final message.", 500)
        return msg

    def _pieces(self, chunks: list[decode_pb2.TokenChunk]):
        """(token ids, their logprobs) of each chunk in order; one token at a time where stop
        strings are watched, so that one found inside a chunk of several tokens (speculative
        decoding accepts several at once) ends the output at the token that completed it, as
        token-by-token streaming would: no ids, logprobs or usage past it."""
        for chunk in chunks:
            ids, lps = list(chunk.token_ids), list(chunk.logprobs)
            if self.state.stop is None or len(ids) < 2:
                yield ids, lps
                continue
            for i, token in enumerate(ids):
                yield [token], lps[i : i + 1]

    def _on_tokens(self, chunks: list[decode_pb2.TokenChunk]) -> TokenDelta:
        """One delta for the chunks in order, as if each had been its own: each goes through
        the detokenizer and stop strings by itself, and none after a stop string counts."""
        prompt_logprobs = None
        k = self.job.params.prompt_logprobs
        if k is not None and self._wants_prompt_logprobs:  # they come with the first chunk
            self._wants_prompt_logprobs = False
            prompt_logprobs = PromptLogprobs(k, list(chunks[0].prompt_logprobs))
            num_expected = len(self.job.prompt_token_ids) - 1
            if len(prompt_logprobs.logprobs) != num_expected:  # never answer a partial list
                detail = (
                    f"{self.state.request_id} at {self.decode.address}: "
                    f"{len(prompt_logprobs.logprobs)} prompt logprobs for {num_expected} "
                    "prompt tokens"
                )
                raise hidden_failure(DECODE_FAILED_MID_STREAM, detail)
        texts, ids, logprobs = [], [], []
        for chunk_ids, chunk_logprobs in self._pieces(chunks):
            lps = [dict(zip(lp.token_ids, lp.logprobs)) for lp in chunk_logprobs]
            texts.append(self.state.add(EngineCoreOutput(self.state.request_id, chunk_ids, lps)))
            ids += chunk_ids
            logprobs += chunk_logprobs
            if self.state.finish_reason is not None:
                break
        return TokenDelta(
            self.job.index,
            "".join(texts),
            ids,
            logprobs,
            self.state.finish_reason,
            self.state.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def _on_final(self, final: decode_pb2.Final) -> TokenDelta:
        stop_reason = final.stop_token_id if final.HasField("stop_token_id") else None
        out = EngineCoreOutput(
            self.state.request_id,
            finish_reason=final.finish_reason or "stop",
            stop_reason=stop_reason,
        )
        text = self.state.add(out)
        return TokenDelta(
            self.job.index,
            text,
            [],
            [],
            self.state.finish_reason,
            self.state.stop_reason,
            final.usage.cached_tokens,
        )


class Dispatcher:
    """Admits children at decodes chosen by the router and hands back their streams."""

    def __init__(
        self,
        router: Router,
        clients: DecodeClients,
        tokenizer: PreTrainedTokenizerBase,
        defer: Defer = _call_now,
    ):
        """`defer(fn, *args)` runs what no client waits for, the router's calibration from a
        finished child: the gateway passes its `Bookkeeping.defer` (batched, up to 0.1 s late)."""
        self.router, self.clients, self.tokenizer = router, clients, tokenizer
        self.defer = defer

    async def start(self, jobs: Sequence[ChildJob], opts: RequestOptions) -> list[ChildStream]:
        """Admit every child (concurrently), or cancel those admitted and raise the error."""
        processor = OutputProcessor(self.tokenizer)
        if len(jobs) == 1:  # the common case, in this task (no task and wait for one child)
            return [await self._admit(jobs[0], processor, opts)]
        tasks = [asyncio.create_task(self._admit(job, processor, opts)) for job in jobs]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled: the client went away while we waited
            await _discard(tasks)
            raise
        error = next((t.exception() for t in done if t.exception() is not None), None)
        if error is not None:
            await _discard(tasks)
            raise error
        return [t.result() for t in tasks]

    async def _admit(
        self, job: ChildJob, processor: OutputProcessor, opts: RequestOptions
    ) -> ChildStream:
        child_id = f"{job.index}_{opts.request_id}"
        started_s = time.monotonic()
        # The salt is part of the block hashes: the router must look up what D will hash.
        routes = await self.router.plan(job.prompt_token_ids, opts.cache_salt or None)
        num_refused, tried, replanned = 0, set(), False
        while True:
            for route in routes:
                tried.add(route.decode.instance_id)
                stream, refused = await self._try(route, job, child_id, processor, opts, started_s)
                if stream is not None:
                    return stream
                num_refused += refused
            if num_refused or replanned or not await self.router.refresh_instances():
                break
            # Every decode known was unreachable (a rolling restart: the last old one drains
            # before the background refresh saw its replacement): re-read the registry once.
            replanned = True
            plan = await self.router.plan(job.prompt_token_ids, opts.cache_salt or None)
            routes = [r for r in plan if r.decode.instance_id not in tried]
        if num_refused:
            raise APIError(
                "All decode instances are busy; retry later.", 503, retry_after_s=opts.retry_after_s
            )
        raise APIError("No decode instance is reachable.", 503, retry_after_s=opts.retry_after_s)

    async def _try(
        self,
        route: Route,
        job: ChildJob,
        child_id: str,
        processor: OutputProcessor,
        opts: RequestOptions,
        started_s: float,
    ) -> tuple[ChildStream | None, int]:
        """One decode: (its stream, 0) when it admitted the child, (None, 1) when it refused
        (RESOURCE_EXHAUSTED), (None, 0) when unreachable; other failures raise."""
        request = decode_pb2.GenerateRequest(
            request_id=child_id,
            transfer_id=os.urandom(16).hex(),  # one per attempt: each D owns its own blocks
            prompt_token_ids=job.prompt_token_ids,
            params=sampling_params_to_proto(job.params),
            cache_salt=opts.cache_salt,
            priority=opts.priority,
            prefill=[
                decode_pb2.PrefillTarget(
                    address=p.address,
                    instance_id=p.instance_id,
                    registration=p.registration,
                    predicted_prefill_s=predicted_s,
                )
                for p, predicted_s in zip(
                    route.prefills, route.predicted_prefill_s or [0.0] * len(route.prefills)
                )
            ],
        )
        call = self.clients.generate(route.decode, request)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            # CANCELLED here is the server's (a local cancel raises CancelledError): a
            # decode that stops (drain, shutdown) cancels calls it had not started. Nothing
            # was sent to the client yet, so another decode may take the request.
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                self.router.report(route.decode, Outcome.UNAVAILABLE)
                return None, 0
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.router.report(route.decode, Outcome.REFUSED)
                return None, 1
            self.router.report(route.decode, Outcome.OK)
            raise error_from_rpc(e) from e
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise APIError("Decode ended the stream without a response.", 500)
        if first.WhichOneof("kind") == "error":
            call.cancel()
            if first.error.code == common_pb2.Error.RESOURCE_EXHAUSTED:
                self.router.report(route.decode, Outcome.REFUSED)
                return None, 1
            self.router.report(route.decode, Outcome.OK)
            raise error_from_event(first.error, opts.retry_after_s)
        ttft_s = time.monotonic() - started_s
        self.router.report(route.decode, Outcome.OK)
        state = processor.add_request(child_id, job.prompt_token_ids, job.params)
        stream = ChildStream(
            job, state, call, first, route, self.clients, self.router, ttft_s, self.defer
        )
        return stream, 0


def error_from_event(error: common_pb2.Error, retry_after_s: int | None = None) -> APIError:
    """A decode's Error event. INVALID_ARGUMENT keeps its message (it is about the client's
    request); any other code's message is the decode's internals, logged but not sent."""
    status = _ERROR_STATUS.get(error.code, 500)
    if status == 400:
        return APIError(error.message or "Invalid request.", 400)
    detail = f"{common_pb2.Error.Code.Name(error.code)}: {error.message}"
    if status == 503:
        return hidden_failure(DECODE_BUSY_MID_STREAM, detail, 503, retry_after_s)
    return hidden_failure(DECODE_FAILED_MID_STREAM, detail, status)


def error_from_rpc(e: grpc.aio.AioRpcError) -> APIError:
    """A decode call that failed before its first message, with a status other than the
    refusals the dispatcher retries elsewhere."""
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(e.details() or "Invalid request.", 400)
    detail = f"{e.code().name}: {e.details()} ({e.debug_error_string()})"
    return hidden_failure(DECODE_FAILED, detail)


async def merge(streams: Sequence[ChildStream]) -> AsyncIterator[TokenDelta]:
    """Interleave the children's deltas as they arrive; any child's error ends all of them."""
    pending: dict[asyncio.Task, AsyncIterator[TokenDelta]] = {}

    def schedule(it: AsyncIterator[TokenDelta]) -> None:
        pending[asyncio.create_task(_next(it))] = it

    for s in streams:
        schedule(s.deltas())
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                it = pending.pop(task)
                delta = task.result()
                if delta is None:
                    continue
                yield delta
                schedule(it)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            s.cancel()


async def _discard(tasks: list[asyncio.Task]) -> None:
    """Cancel admissions still running and close the streams of those that succeeded."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is None:
            t.result().cancel()


async def _next(it: AsyncIterator[TokenDelta]) -> TokenDelta | None:
    try:
        return await anext(it)
    except StopAsyncIteration:
        return None
