"""Faults between real processes: each ends in a clean result or a clean error, and every
block pool returns to its idle count (no leaked blocks)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest

from engine import LLM, SamplingParams
from gateway.clients import DecodeClients
from gateway.registry import Instance
from tests.integration.services import (
    collect,
    decode_stub,
    free_port,
    generate_request,
    get_load,
    metric_value,
    open_frames,
    prefill_stub,
    read_call,
    start_services,
    wait_idle,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(40, 90))


@pytest.fixture
def cluster(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path,
        2,
        1,
        extra_prefill=["--kv-lease-s", "1.5"],
        extra_decode=["--kv-lease-s", "1.5", "--prefill-timeout-s", "2"],
    )
    yield cluster, prefills, decodes[0]
    for c in cluster.children:  # resume anything a test stopped, so it can exit
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGCONT)
    cluster.stop()


async def wait_for_remote_prefill(stub, timeout_s: float = 10.0) -> None:
    """Poll until D holds blocks for a request: it reserves them just before it calls P, and a
    stopped P never answers, so D is then waiting on P."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await get_load(stub)
        if load.num_free_blocks < load.num_idle_free_blocks:
            return
        assert time.monotonic() < deadline, f"D reserved no blocks in {timeout_s} s: {load}"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=64)
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_kill_prefill_during_prefill_retries_on_another(cluster, expected):
    _, (p1, p2), d = cluster

    async def run():
        stub = decode_stub(d.address)
        os.kill(p1.proc.pid, signal.SIGSTOP)  # P1 takes the request and never answers ...
        task = asyncio.ensure_future(
            collect(stub, generate_request("k", PROMPT, GREEDY, [p1.address, p2.address]))
        )
        await wait_for_remote_prefill(stub)
        os.kill(p1.proc.pid, signal.SIGKILL)  # ... and dies mid-prefill
        tokens, final, error = await task
        assert error is None and tokens == expected
        assert not final.timings.local_prefill and final.timings.prefill_instance == p2.address
        await wait_idle(stub)  # D's fenced blocks come back once P1's port refuses (dead)
        await wait_idle(prefill_stub(p2.address))

    asyncio.run(run())


def test_hung_prefill_falls_back_to_local_and_its_blocks_stay_fenced(cluster, expected):
    _, (p1, _), d = cluster

    async def run():
        stub, pstub = decode_stub(d.address), prefill_stub(p1.address)
        idle = (await get_load(stub)).num_idle_free_blocks
        os.kill(p1.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        tokens, final, error = await collect(
            stub, generate_request("h", PROMPT, GREEDY, [p1.address])
        )
        assert tokens == expected and final.timings.local_prefill
        assert time.monotonic() - t0 >= 2.0  # waited for the prefill's bound
        # P1 may still write the blocks it was given: they stay quarantined while it is
        # stopped, past its lease, whatever else D does meanwhile.
        for i in range(2):
            other, _, _ = await collect(stub, generate_request(f"o{i}", PROMPT[:20], GREEDY))
            assert len(other) == GREEDY.max_tokens
            assert (await get_load(stub)).num_free_blocks < idle
        os.kill(p1.proc.pid, signal.SIGCONT)
        # P1 wakes up after its lease: it must not write; it acknowledges D's abort (which
        # releases D's blocks) and frees its own.
        await wait_idle(stub)
        await wait_idle(pstub)

    asyncio.run(run())


def test_abort_during_transfer(cluster):
    _, (p1, _), d = cluster

    async def run():
        stub = decode_stub(d.address)
        os.kill(p1.proc.pid, signal.SIGSTOP)
        call = stub.Generate(generate_request("a", PROMPT, GREEDY, [p1.address]))

        async def consume():
            async for _ in call:
                pass

        task = asyncio.ensure_future(consume())
        await wait_for_remote_prefill(stub)  # the transfer is under way (P never answers)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.kill(p1.proc.pid, signal.SIGCONT)
        await wait_idle(stub)
        await wait_idle(prefill_stub(p1.address))
        # Both keep serving.
        tokens, _, _ = await collect(stub, generate_request("a2", [1, 2, 3], GREEDY, [p1.address]))
        assert len(tokens) == GREEDY.max_tokens

    asyncio.run(run())


def test_dropped_framed_connection_frees_every_block(tiny_qwen3_path, expected):
    """The gateway's framed connection to D (protos/mux_frames.py) dropped without a goodbye,
    once while its request decodes and once while D waits on a stopped P for the prompt's KV:
    D cancels the requests (the second one's transfer is fenced while P is still stopped),
    every block comes back on D and on P, and D serves the next connection the same tokens."""
    port = free_port()
    lease = ["--kv-lease-s", "1.5"]
    cluster, (p1,), (d,) = start_services(
        tiny_qwen3_path, 1, 1, lease, [*lease, "--metrics-port", str(port)]
    )
    long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    instance = Instance(d.address, "d")

    def counter(name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return metric_value(text, f"tandem:{name}_total")

    async def run():
        stub, clients = decode_stub(d.address), DecodeClients()
        try:
            frames = await open_frames(clients, instance)
            decoding = clients.generate(instance, generate_request("drop1", PROMPT, long))
            assert decoding._stream is frames
            assert (await decoding.read()).tokens.token_ids  # it decodes
            frames.transport.abort()
            await wait_idle(stub)

            frames = await open_frames(clients, instance, old=frames)  # the client's retry
            os.kill(p1.proc.pid, signal.SIGSTOP)
            request = generate_request("drop2", PROMPT, long, [p1.address])
            waiting = clients.generate(instance, request)
            assert waiting._stream is frames
            await wait_for_remote_prefill(stub)
            assert counter("num_fenced_transfers") == 0
            frames.transport.abort()
            # Cancelled while P sleeps: D fences the blocks P was given (only P's answer to
            # D's abort frees them). A request left running would wait on P until its bound
            # (2 s at least), and be fenced only then, as a timeout.
            async with asyncio.timeout(20):
                while counter("num_fenced_transfers") < 1:
                    await asyncio.sleep(0.05)
            assert counter("num_prefill_timeouts") == 0
            os.kill(p1.proc.pid, signal.SIGCONT)
            await wait_idle(stub)
            await wait_idle(prefill_stub(p1.address))

            frames = await open_frames(clients, instance, old=frames)
            call = clients.generate(instance, generate_request("after", PROMPT, GREEDY))
            assert call._stream is frames
            assert (await read_call(call))[0] == expected
        finally:
            await clients.close()

    try:
        asyncio.run(run())
    finally:
        os.kill(p1.proc.pid, signal.SIGCONT)  # so that it can exit
        cluster.stop()


def test_decode_refuses_fast_when_full(tiny_qwen3_path):
    cluster, prefills, decodes = start_services(
        tiny_qwen3_path, 0, 1, extra_decode=["--max-num-queued-reqs", "1", "--max-num-seqs", "1"]
    )
    try:

        async def run():
            stub = decode_stub(decodes[0].address)
            long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
            calls = [
                asyncio.ensure_future(collect(stub, generate_request(f"f{i}", [1, 2, 3], long)))
                for i in range(4)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
            assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
            assert "max_num_queued_reqs=1" in refused[0].details()
            await wait_idle(stub)

        asyncio.run(run())
    finally:
        cluster.stop()
