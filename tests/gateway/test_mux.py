"""The gateway's requests to a decode ride one GenerateMux stream (gateway/mux.py), and behave as
the unary calls they replace: each gets its own tokens, a cancel or an error stays with its
request, refusals and unreachable decodes fail over, a dying decode fails every request on the
stream with the error a broken call gives and a restarted one serves again, the stream carries
the internal token, and a decode without GenerateMux is called unary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest

from engine import internal_auth
from engine.params_proto import sampling_params_to_proto
from engine.sampling_params import SamplingParams
from gateway import mux as mux_module
from gateway.clients import DecodeClients
from gateway.dispatch import Dispatcher, RequestOptions
from gateway.errors import DECODE_FAILED_MID_STREAM, APIError
from gateway.mux import MuxCall
from gateway.preprocess import ChildJob
from gateway.registry import Instance
from gateway.router import Outcome, Route
from protos import decode_pb2, decode_pb2_grpc, mux_frames
from tests.protos.echo_decode import (
    ABORT,
    REFUSE,
    CountMethods,
    EchoDecode,
    OldDecode,
    ThreadEchoDecode,
    serve_aio,
    serve_threads,
)

PARAMS = SamplingParams(max_tokens=64)


def request(rid: str, prompt: list[int]) -> decode_pb2.GenerateRequest:
    params = sampling_params_to_proto(PARAMS)
    return decode_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)


async def read_all(call) -> tuple[list[int], list[str]]:
    """Tokens and message kinds until EOF."""
    tokens, kinds = [], []
    while (msg := await call.read()) is not grpc.aio.EOF:
        kinds.append(msg.WhichOneof("kind"))
        tokens += msg.tokens.token_ids
    return tokens, kinds


@contextlib.asynccontextmanager
async def decode(kind: str = "aio", delay_s: float = 0.0, servicer=None):
    """A decode on loopback, counting calls per method; yields (servicer, counts, instance)."""
    counts = CountMethods()
    if kind == "aio":
        servicer = servicer or EchoDecode(delay_s)
        server, address = await serve_aio(servicer, interceptors=[counts])
    else:
        servicer = ThreadEchoDecode(delay_s)
        server, address = serve_threads(servicer)
    try:
        yield servicer, counts.counts, Instance(address, f"d-{address}")
    finally:
        stopped = server.stop(None)
        if kind == "aio":
            await stopped


@pytest.mark.parametrize("kind", ["aio", "threads"])
def test_concurrent_requests_share_one_stream_and_get_their_own_tokens(kind):
    async def run():
        clients = DecodeClients()
        async with decode(kind, delay_s=0.01) as (servicer, counts, d):
            prompts = {f"r{i}": [100 * i + k for k in range(1, 9)] for i in range(1, 9)}
            calls = {rid: clients.generate(d, request(rid, p)) for rid, p in prompts.items()}
            results = await asyncio.gather(*(read_all(c) for c in calls.values()))
            for (rid, prompt), (tokens, kinds) in zip(prompts.items(), results):
                assert tokens == prompt, rid
                assert kinds == ["tokens"] * 8 + ["final"]
            assert all(isinstance(c, MuxCall) for c in calls.values())
            if kind == "aio":
                assert counts == {"GenerateMux": 1}
            assert servicer.num_generate_contexts == {
                "_AsyncSubContext" if kind == "aio" else "_SyncSubContext": 8
            }
            await clients.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["aio", "threads"])
def test_cancelling_one_request_aborts_it_and_leaves_the_others(kind):
    async def run():
        clients = DecodeClients()
        async with decode(kind, delay_s=0.03) as (servicer, _, d):
            long = clients.generate(d, request("long", list(range(1, 100))))
            other = clients.generate(d, request("other", list(range(1, 11))))
            assert (await long.read()).tokens.token_ids == [1]
            assert long.cancel() and not long.cancel()
            tokens, _ = await read_all(other)
            assert tokens == list(range(1, 11))
            async with asyncio.timeout(5):
                while servicer.cancelled != ["long"]:
                    await asyncio.sleep(0.01)
            assert servicer.finished == ["other"]
            # A read cancelled by its task cancels its request too (as grpc's read does).
            waiting = clients.generate(d, request("waiting", list(range(1, 100))))
            await waiting.read()
            task = asyncio.create_task(waiting.read())
            await asyncio.sleep(0)
            task.cancel()
            async with asyncio.timeout(5):
                while "waiting" not in servicer.cancelled:
                    await asyncio.sleep(0.01)
            await clients.close()

    asyncio.run(run())


def test_an_error_stays_with_its_request():
    async def run():
        clients = DecodeClients()
        async with decode(delay_s=0.02) as (servicer, counts, d):
            good = clients.generate(d, request("good", [1, 2, 3, 4, 5]))
            bad = clients.generate(d, request("bad", [ABORT]))
            full = clients.generate(d, request("full", [REFUSE]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await bad.read()
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad prompt",
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await full.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await read_all(good))[0] == [1, 2, 3, 4, 5]
            stream = clients._generates[d.address].stream
            assert stream.is_open
            assert (await read_all(clients.generate(d, request("next", [9]))))[0] == [9]
            assert clients._generates[d.address].stream is stream
            assert counts == {"GenerateMux": 1}
            await clients.close()

    asyncio.run(run())


# ---- through the dispatcher: failover and the errors clients see ----


class FixedRouter:
    """Routes every child to `decodes` in order; records what the dispatcher reports."""

    def __init__(self, decodes: list[Instance]):
        self.routes = [Route(d, ()) for d in decodes]
        self.reports: list[tuple[str, Outcome]] = []

    async def plan(self, prompt_token_ids, cache_salt):
        return self.routes

    def report(self, instance: Instance, outcome: Outcome) -> None:
        self.reports.append((instance.address, outcome))

    def observe(self, *args) -> None:
        pass

    async def refresh_instances(self) -> bool:
        return False


class RefusingDecode(EchoDecode):
    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full")
        yield  # pragma: no cover


def _unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def _texts(dispatcher: Dispatcher, prompts: list[list[int]], rid: str = "req") -> list:
    jobs = [ChildJob(i, p, PARAMS) for i, p in enumerate(prompts)]
    streams = await dispatcher.start(jobs, RequestOptions(rid))
    out = []
    for s in streams:
        out.append([t for d in [d async for d in s.deltas()] for t in d.token_ids])
    return out


def test_refused_and_unreachable_decodes_fail_over(model_info):
    tokenizer = model_info.tokenizer

    async def run():
        clients = DecodeClients()
        async with (
            decode(servicer=RefusingDecode()) as (_, _, full),
            decode() as (_, _, ok),
        ):
            dead = Instance(_unused_address(), "dead")
            router = FixedRouter([dead, full, ok])
            dispatcher = Dispatcher(router, clients, tokenizer)
            assert await _texts(dispatcher, [[5, 6, 7], [8, 9]]) == [[5, 6, 7], [8, 9]]
            outcomes = {(a, o) for a, o in router.reports}
            assert (dead.address, Outcome.UNAVAILABLE) in outcomes
            assert (full.address, Outcome.REFUSED) in outcomes
            assert (ok.address, Outcome.OK) in outcomes
            router.routes = router.routes[:2]
            with pytest.raises(APIError) as e:
                await _texts(dispatcher, [[5]])
            assert (e.value.status_code, e.value.message) == (
                503,
                "All decode instances are busy; retry later.",
            )
            router.routes = router.routes[:1]
            with pytest.raises(APIError) as e:
                await _texts(dispatcher, [[5]])
            assert e.value.message == "No decode instance is reachable."
            await clients.close()

    asyncio.run(run())


def _start_echo_process(address: str, delay_s: float, frames: bool = False) -> subprocess.Popen:
    port = address.rsplit(":", 1)[1]
    args = [sys.executable, "-m", "tests.protos.echo_decode", port, str(delay_s)]
    args += ["--frames"] if frames else []
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    assert line.startswith("READY"), line
    return proc


def test_a_dying_decode_fails_every_request_on_the_stream_and_a_restarted_one_serves(
    model_info,
):
    address = _unused_address()
    proc = _start_echo_process(address, delay_s=0.05)

    async def run():
        nonlocal proc
        clients = DecodeClients()
        d = Instance(address, "d")
        dispatcher = Dispatcher(FixedRouter([d]), clients, model_info.tokenizer)
        jobs = [ChildJob(i, list(range(1, 200)), PARAMS) for i in range(3)]
        streams = await dispatcher.start(jobs, RequestOptions("dying"))
        # A unary call beside them: what a broken call looked like before the streams.
        unary = clients.stub(d).Generate(request("unary", list(range(1, 200))))
        await unary.read()
        iterators = [s.deltas() for s in streams]
        for it in iterators:
            await anext(it)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(grpc.aio.AioRpcError) as unary_error:
            while True:
                await unary.read()
        for it in iterators:
            with pytest.raises(APIError) as e:
                while True:
                    await anext(it)
            assert e.value.message == DECODE_FAILED_MID_STREAM
        stream = clients._generates[address].stream
        assert stream.error.code() == unary_error.value.code() == grpc.StatusCode.UNAVAILABLE
        proc = _start_echo_process(address, delay_s=0.0)
        async with asyncio.timeout(15):  # the channel reconnects within its 2 s backoff
            while True:
                try:
                    texts = await _texts(dispatcher, [[7, 8, 9]])
                    break
                except APIError:
                    await asyncio.sleep(0.1)
        assert texts == [[7, 8, 9]]
        assert clients._generates[address].stream is not stream
        await clients.close()

    try:
        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()


def test_a_decode_without_generate_mux_is_called_unary():
    async def run():
        clients = DecodeClients()
        async with decode(servicer=OldDecode()) as (servicer, counts, d):
            first = [clients.generate(d, request(f"r{i}", [i, i + 1])) for i in range(3)]
            results = [await read_all(c) for c in first]
            assert [tokens for tokens, _ in results] == [[0, 1], [1, 2], [2, 3]]
            call = clients.generate(d, request("later", [4, 5]))
            assert not isinstance(call, MuxCall)
            assert (await read_all(call))[0] == [4, 5]
            assert counts == {"GenerateMux": 1, "Generate": 4}
            await clients.close()

    asyncio.run(run())


def test_the_stream_carries_the_internal_token_and_is_refused_without(monkeypatch):
    monkeypatch.setenv(internal_auth.ENV_TOKEN, "mux-token-for-tests-0123456789")

    async def run():
        servicer = EchoDecode()
        server, address = await serve_aio(
            servicer, interceptors=internal_auth.server_interceptors()
        )
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = decode_pb2_grpc.DecodeStub(channel).GenerateMux()
                with pytest.raises(grpc.aio.AioRpcError) as e:  # the write may see it first
                    async with asyncio.timeout(10):
                        await call.write(decode_pb2.MuxRequest(id=1, start=request("x", [1])))
                        await call.read()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert servicer.num_generate_contexts == {}
            clients = DecodeClients()  # internal_channel: the token from the environment
            d = Instance(address, "d")
            assert (await read_all(clients.generate(d, request("y", [1, 2]))))[0] == [1, 2]
            await clients.close()
            monkeypatch.setenv(internal_auth.ENV_TOKEN, "a-wrong-token-0123456789")
            clients = DecodeClients()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await clients.generate(d, request("z", [1])).read()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await clients.close()
        finally:
            await server.stop(None)

    asyncio.run(run())


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def framed_decode(servicer, interceptors=()):
    """A decode on loopback serving gRPC and frames (with this process's internal auth), and the
    gateway's clients to it. Tests may replace `rig.server` and `rig.frames`; the ones there at
    the end are stopped."""
    server, address = await serve_aio(servicer, interceptors=interceptors)
    frames = mux_frames.FramesServer(servicer, *internal_auth.frames_auth())
    port = await frames.start("127.0.0.1", 0)
    rig = SimpleNamespace(server=server, address=address, frames=frames, frames_port=port)
    rig.clients, rig.d = DecodeClients(), Instance(address, "d")
    try:
        yield rig
    finally:
        await rig.clients.close()
        rig.frames.close()
        await rig.server.stop(None)


async def _open_frames(rig) -> mux_module.DecodeGenerate:
    """A first request (on gRPC, which advertises the frames), then until the frames are open."""
    assert (await read_all(rig.clients.generate(rig.d, request("first", [1, 2]))))[0] == [1, 2]
    generate = rig.clients._generates[rig.address]
    await _until(lambda: generate.frames is not None and generate.frames.is_open)
    return generate


def test_requests_move_to_the_framed_connection_the_decode_advertises(monkeypatch):
    monkeypatch.setenv(internal_auth.ENV_TOKEN, "mux-token-for-tests-0123456789")

    async def run():
        servicer, counts = EchoDecode(0.01), CountMethods()
        interceptors = [counts, *internal_auth.server_interceptors()]
        async with framed_decode(servicer, interceptors) as rig:
            clients, d, frames = rig.clients, rig.d, rig.frames
            generate = await _open_frames(rig)
            prompts = {f"r{i}": [100 * i + k for k in range(1, 9)] for i in range(1, 9)}
            calls = {rid: clients.generate(d, request(rid, p)) for rid, p in prompts.items()}
            assert all(call._stream is generate.frames for call in calls.values())
            results = await asyncio.gather(*(read_all(c) for c in calls.values()))
            for (rid, prompt), (tokens, kinds) in zip(prompts.items(), results):
                assert tokens == prompt, rid
                assert kinds == ["tokens"] * 8 + ["final"]
            assert counts.counts == {"GenerateMux": 1}  # the rest went on the frames
            assert len(frames.connections) == 1 and frames.num_rejected == 0
            # A cancel on the frames aborts its request at the decode, as on the stream.
            long = clients.generate(d, request("long", list(range(1, 300))))
            await long.read()
            assert long.cancel()
            await _until(lambda: "long" in servicer.cancelled)

    asyncio.run(run())


def test_a_broken_framed_connection_fails_its_requests_and_grpc_serves_until_it_is_back(
    monkeypatch,
):
    monkeypatch.setattr(mux_module, "FRAMES_RETRY_S", 0.05)

    async def run():
        servicer = EchoDecode(0.02)
        async with framed_decode(servicer) as rig:
            clients, d = rig.clients, rig.d
            generate = await _open_frames(rig)
            on_frames = clients.generate(d, request("on-frames", list(range(1, 300))))
            await on_frames.read()
            rig.frames.close()  # the decode's listener goes, and the connection with it
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await read_all(on_frames)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            await _until(lambda: "on-frames" in servicer.cancelled)  # aborted at the decode
            on_grpc = clients.generate(d, request("on-grpc", [3, 4]))
            assert on_grpc._stream is generate.stream
            assert (await read_all(on_grpc))[0] == [3, 4]
            rig.frames = mux_frames.FramesServer(servicer, *internal_auth.frames_auth())
            await rig.frames.start("127.0.0.1", rig.frames_port)  # back, where it was advertised
            async with asyncio.timeout(10):  # each request tries again after the back-off
                while generate.frames is None or not generate.frames.is_open:
                    await read_all(clients.generate(d, request("poke", [5])))
                    await asyncio.sleep(0.05)
            again = clients.generate(d, request("again", [6, 7]))
            assert again._stream is generate.frames
            assert (await read_all(again))[0] == [6, 7]

    asyncio.run(run())


def test_a_decode_restarted_without_the_frames_is_not_dialed_there_again():
    async def run():
        async with framed_decode(EchoDecode()) as rig:
            clients, d = rig.clients, rig.d
            generate = await _open_frames(rig)
            rig.frames.close()
            await rig.server.stop(None)
            port = int(rig.address.rsplit(":", 1)[1])  # --mux-port -1: gRPC only, same address
            rig.server, _ = await serve_aio(EchoDecode(), port=port)
            async with asyncio.timeout(15):  # UNAVAILABLE until the channel reconnects
                while True:
                    try:
                        assert (await read_all(clients.generate(d, request("x", [2]))))[0] == [2]
                        break
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE
                        await asyncio.sleep(0.05)
            assert generate._frames_port is None  # the new stream advertised none
            generate._frames_after_s = 0.0  # past any back-off: still nothing to dial
            call = clients.generate(d, request("y", [3]))
            assert call._stream is generate.stream and generate._frames_task is None
            assert (await read_all(call))[0] == [3]

    asyncio.run(run())


def test_a_dying_decode_fails_every_request_on_its_frames_and_a_restarted_one_serves_there(
    model_info, monkeypatch
):
    monkeypatch.setattr(mux_module, "FRAMES_RETRY_S", 0.05)
    address = _unused_address()
    proc = _start_echo_process(address, delay_s=0.05, frames=True)

    async def run():
        nonlocal proc
        clients = DecodeClients()
        d = Instance(address, "d")
        dispatcher = Dispatcher(FixedRouter([d]), clients, model_info.tokenizer)
        assert await _texts(dispatcher, [[4, 5]]) == [[4, 5]]  # on gRPC: learns the frames
        generate = clients._generates[address]
        await _until(lambda: generate.frames is not None and generate.frames.is_open)
        frames = generate.frames
        jobs = [ChildJob(i, list(range(1, 200)), PARAMS) for i in range(3)]
        streams = await dispatcher.start(jobs, RequestOptions("dying"))
        assert len(frames.calls) == 3
        iterators = [s.deltas() for s in streams]
        for it in iterators:
            await anext(it)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        async with asyncio.timeout(15):  # a request left waiting fails here, not at pytest's 600 s
            for it in iterators:
                with pytest.raises(APIError) as e:
                    while True:
                        await anext(it)
                assert e.value.message == DECODE_FAILED_MID_STREAM
        assert frames.error.code() == grpc.StatusCode.UNAVAILABLE and not frames.calls
        proc = _start_echo_process(address, delay_s=0.0, frames=True)  # another frames port
        async with asyncio.timeout(15):
            while generate.frames is None or generate.frames is frames:
                try:
                    assert await _texts(dispatcher, [[7, 8, 9]]) == [[7, 8, 9]]
                except APIError:  # until the channel has reconnected
                    pass
                await asyncio.sleep(0.05)
            await _until(lambda: generate.frames.is_open)
        sent_before = generate.frames._next_id
        assert await _texts(dispatcher, [[1, 2]]) == [[1, 2]]
        assert generate.frames._next_id == sent_before + 1  # it went on the new frames
        await clients.close()

    try:
        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
