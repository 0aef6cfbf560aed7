"""GenerateMux on top of a servicer's Generate (protos/decode_mux.py), on a grpc.aio server and
a thread-pool one, driven by raw MuxRequests: requests interleave and are batched, errors and
cancels stay with their request, no message stops the stream, draining ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

import grpc
import pytest

from protos import decode_mux, decode_pb2, decode_pb2_grpc
from tests.protos.echo_decode import (
    ABORT,
    RAISE,
    REFUSE,
    EchoDecode,
    ThreadEchoDecode,
    serve_aio,
    serve_threads,
)

KINDS = ["aio", "threads"]
OK = grpc.StatusCode.OK.value[0]


@contextlib.asynccontextmanager
async def served(kind: str, delay_s: float = 0.0):
    if kind == "aio":
        servicer = EchoDecode(delay_s)
        server, address = await serve_aio(servicer)
    else:
        servicer = ThreadEchoDecode(delay_s)
        server, address = serve_threads(servicer)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield servicer, RawStream(channel)
    finally:
        stopped = server.stop(None)
        if kind == "aio":
            await stopped


def start(rid: int, prompt: list[int]) -> decode_pb2.MuxRequest:
    request = decode_pb2.GenerateRequest(request_id=f"r{rid}", prompt_token_ids=prompt)
    return decode_pb2.MuxRequest(id=rid, start=request)


def cancel(rid: int) -> decode_pb2.MuxRequest:
    return decode_pb2.MuxRequest(id=rid, cancel=decode_pb2.MuxCancel())


class RawStream:
    """One GenerateMux call; what arrived, per request id."""

    def __init__(self, channel: grpc.aio.Channel):
        self.call = decode_pb2_grpc.DecodeStub(channel).GenerateMux()
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.kinds: dict[int, list[str]] = defaultdict(list)  # tokens / final / error / end
        self.ends: dict[int, list[tuple[grpc.StatusCode, str]]] = defaultdict(list)
        self.batch_ids: list[set[int]] = []  # the ids of each MuxResponse

    async def send(self, *messages: decode_pb2.MuxRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def until(self, done, timeout_s: float = 10.0) -> None:
        """Read until `done()` holds."""
        async with asyncio.timeout(timeout_s):
            while not done():
                batch = await self.call.read()
                assert batch is not grpc.aio.EOF, "the stream ended"
                self.batch_ids.append({item.id for item in batch.items})
                for item in batch.items:
                    if item.HasField("end"):
                        code = next(c for c in grpc.StatusCode if c.value[0] == item.end.code)
                        self.ends[item.id].append((code, item.end.details))
                        self.kinds[item.id].append("end")
                        continue
                    kind = item.response.WhichOneof("kind")
                    self.kinds[item.id].append(kind)
                    if kind == "tokens":
                        self.tokens[item.id] += item.response.tokens.token_ids

    async def until_ended(self, *rids: int) -> None:
        await self.until(lambda: all(self.ends[rid] for rid in rids))


@pytest.mark.parametrize("kind", KINDS)
def test_requests_interleave_with_their_own_tokens_batched(kind):
    prompts = {1: [11, 12, 13, 14, 15], 2: [21, 22, 23, 24, 25], 3: [31, 32, 33, 34, 35]}

    async def run():
        async with served(kind, delay_s=0.05) as (servicer, stream):
            await stream.send(*(start(rid, prompt) for rid, prompt in prompts.items()))
            await stream.until_ended(1, 2, 3)
            for rid, prompt in prompts.items():
                assert stream.tokens[rid] == prompt
                assert stream.kinds[rid] == ["tokens"] * 5 + ["final", "end"]
                assert stream.ends[rid] == [(grpc.StatusCode.OK, "")]
            # Chunks ready together (the tasks' sleeps end in one loop turn) went out together:
            # one write for several requests. Threads wake apart, so they batch by chance.
            if kind == "aio":
                assert max(len(ids) for ids in stream.batch_ids) > 1, stream.batch_ids
            assert sorted(servicer.finished) == ["r1", "r2", "r3"]

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_ends_only_its_request(kind):
    async def run():
        async with served(kind, delay_s=0.02) as (servicer, stream):
            await stream.send(start(1, [1, 2, 3, 4]), start(2, [ABORT]), start(3, [RAISE]))
            await stream.send(start(4, [REFUSE]))
            await stream.until_ended(1, 2, 3, 4)
            assert stream.ends[2] == [(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")]
            ((code, details),) = stream.ends[3]
            assert code == grpc.StatusCode.UNKNOWN and "boom" in details
            assert stream.ends[4] == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full")]
            assert stream.tokens[1] == [1, 2, 3, 4] and stream.ends[1][0][0] == grpc.StatusCode.OK
            # The stream goes on.
            await stream.send(start(5, [7, 8]))
            await stream.until_ended(5)
            assert stream.tokens[5] == [7, 8]

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_aborts_one_request_and_the_others_go_on(kind):
    async def run():
        async with served(kind, delay_s=0.05) as (servicer, stream):
            await stream.send(start(1, list(range(1, 41))), start(2, [5, 6, 7, 8]))
            await stream.until(lambda: stream.tokens[1])
            await stream.send(cancel(1))
            await stream.until_ended(2)
            assert stream.tokens[2] == [5, 6, 7, 8]
            async with asyncio.timeout(5):
                while servicer.cancelled != ["r1"]:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            num_tokens = len(stream.tokens[1])
            await stream.send(start(3, [9]))
            await stream.until_ended(3)
            assert not stream.ends[1], "a cancelled request gets no end"
            assert len(stream.tokens[1]) == num_tokens < 40
            assert "r1" not in servicer.finished

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_no_message_stops_the_stream(kind, monkeypatch):
    monkeypatch.setattr(decode_mux, "MAX_REQUESTS_PER_STREAM", 2)

    async def run():
        async with served(kind, delay_s=0.05) as (servicer, stream):
            await stream.send(start(1, list(range(1, 21))))
            await stream.until(lambda: stream.tokens[1])
            await stream.send(start(1, [99]))  # a duplicate of an id in flight
            await stream.until(lambda: stream.ends[1])
            assert stream.ends[1] == [(grpc.StatusCode.ALREADY_EXISTS, stream.ends[1][0][1])]
            await stream.send(start(0, [1]), decode_pb2.MuxRequest(id=7), cancel(99))
            await stream.until(lambda: stream.ends[0] and stream.ends[7])
            assert stream.ends[0][0][0] == stream.ends[7][0][0] == grpc.StatusCode.INVALID_ARGUMENT
            await stream.send(start(2, list(range(10))), start(3, [1]))  # past the bound (2)
            await stream.until(lambda: stream.ends[3])
            ((code, details),) = stream.ends[3]
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in details
            await stream.until(lambda: stream.ends[2] and len(stream.ends[1]) == 2)
            # The original request 1 was left alone and ended normally.
            assert stream.tokens[1] == list(range(1, 21))
            assert stream.ends[1][1][0] == grpc.StatusCode.OK
            assert servicer.num_rejected_mux_messages == 5  # dup, 0, empty, unknown cancel, bound
            await stream.send(start(4, [4, 4]))
            await stream.until_ended(4)
            assert stream.tokens[4] == [4, 4]
            assert sorted(servicer.finished) == ["r1", "r2", "r4"]

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_stream_cancels_its_requests(kind):
    async def run():
        async with served(kind, delay_s=0.05) as (servicer, stream):
            await stream.send(start(1, list(range(1, 41))), start(2, list(range(1, 41))))
            await stream.until(lambda: stream.tokens[1] and stream.tokens[2])
            stream.call.cancel()
            async with asyncio.timeout(5):
                while sorted(servicer.cancelled) != ["r1", "r2"]:
                    await asyncio.sleep(0.01)
            assert servicer.finished == []

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_drain_refuses_new_requests_and_ends_the_stream_after_its_own(kind):
    async def run():
        async with served(kind, delay_s=0.05) as (servicer, stream):
            await stream.send(start(1, [1, 2, 3, 4, 5, 6]))
            await stream.until(lambda: stream.tokens[1])
            servicer.close_mux_streams()
            await stream.send(start(2, [1]))
            await stream.until_ended(1, 2)
            assert stream.ends[2][0][0] == grpc.StatusCode.UNAVAILABLE
            assert stream.tokens[1] == [1, 2, 3, 4, 5, 6]
            async with asyncio.timeout(5):
                assert await stream.call.read() is grpc.aio.EOF
            assert await stream.call.code() == grpc.StatusCode.OK

    asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_half_closed_stream_ends_after_its_requests(kind):
    async def run():
        async with served(kind, delay_s=0.02) as (servicer, stream):
            await stream.send(start(1, [1, 2, 3]))
            await stream.call.done_writing()
            await stream.until_ended(1)
            async with asyncio.timeout(5):
                assert await stream.call.read() is grpc.aio.EOF
            assert stream.tokens[1] == [1, 2, 3]

    asyncio.run(run())
