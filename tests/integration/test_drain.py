"""Drain on SIGTERM (scale-in, rolling restarts): the service refuses new work with UNAVAILABLE
(so the gateway tries another decode) while it still listens, turns unready (NOT_SERVING),
leaves the Redis pool, finishes the stream it holds to the last token, and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.internal_auth import internal_channel
from engine.registry import INSTANCES_KEY
from engine.sampling_params import SamplingParams
from engine.step_trace import KINDS, summarize
from tests.integration.services import ENGINE_FLAGS, decode_stub, generate_request
from tests.integration.test_supervision import DECODE_SERVICE, START_S, LineProc
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

SERVING = health_pb2.HealthCheckResponse.SERVING
NUM_TOKENS = 120


async def _is_ready(address: str) -> bool:
    """Readiness as a probe sees it: SERVING for the service's name; NOT_SERVING or a refused
    call (the draining server takes no new RPCs) is unready."""
    async with internal_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=DECODE_SERVICE)
        try:
            return (await stub.Check(request, timeout=5)).status == SERVING
        except grpc.aio.AioRpcError as e:  # refused, or cut off as the server stops
            assert e.code() != grpc.StatusCode.UNAUTHENTICATED, e
            return False


async def _until(check, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


def test_sigterm_drains_a_decode_without_losing_its_stream(
    tiny_qwen3_path,
    tmp_path,
    redis_server,  # noqa: F811
):
    cmd = [sys.executable, "-m", "tests.integration.slow_decode", "0.04", str(tiny_qwen3_path)]
    flags = [*ENGINE_FLAGS, "--port", "0", "--redis-url", redis_server.url]
    # Its steps traced too: the trace is written as a drained service stops.
    env = {**os.environ, "TANDEM_STEP_TRACE_DIR": str(tmp_path)}
    service = LineProc([*cmd, *flags], env=env)
    registry = redis.Redis.from_url(redis_server.url)
    try:
        _, m = service.wait_for(r"^READY decode (\S+)$", START_S)
        address = m.group(1)
        assert len(registry.smembers(INSTANCES_KEY)) == 1
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

        async def run() -> tuple[list[int], object, tuple[grpc.StatusCode, str]]:
            stub = decode_stub(address)
            stream = stub.Generate(generate_request("held", list(range(40, 60)), params))
            tokens = []
            first = await stream.read()
            tokens += first.tokens.token_ids
            service.proc.send_signal(signal.SIGTERM)  # the stream has 119 tokens to go

            await _until(_is_unready)
            await _until(_left_registry)
            try:
                await collect_one(decode_stub(address))
                refused = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as e:
                refused = (e.code(), e.details())
            final = None
            async for resp in stream:
                if resp.WhichOneof("kind") == "tokens":
                    tokens += resp.tokens.token_ids
                else:
                    final = resp
            return tokens, final, refused

        async def _is_unready() -> bool:
            return not await _is_ready(address)

        async def _left_registry() -> bool:
            return len(registry.smembers(INSTANCES_KEY)) == 0

        async def collect_one(stub):
            async for _ in stub.Generate(generate_request("new", [5, 6, 7], params), timeout=10):
                pass

        tokens, final, refused = asyncio.run(run())
        # The gateway tries another decode on UNAVAILABLE; the server still listens while it
        # drains and says so (a stopping server resets late calls: CANCELLED, not retried).
        assert refused[0] == grpc.StatusCode.UNAVAILABLE, refused
        assert "the decode is draining" in refused[1], refused
        assert final is not None and final.WhichOneof("kind") == "final", final
        assert final.final.finish_reason == "length"
        assert len(tokens) == NUM_TOKENS  # nothing truncated
        assert service.proc.wait(30) == 0
        service.wait_for(r"drained in [\d.]+ s; exiting", 5)
        (trace,) = tmp_path.glob("decode-*.json")
        st = summarize(json.loads(trace.read_text()))
        # The held stream's 20 prompt tokens, then each output token but the last fed back.
        assert sum(st[k]["tokens"] for k in KINDS) == 20 + NUM_TOKENS - 1
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
            service.proc.wait()
