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
import httpx
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.internal_auth import internal_channel
from engine.registry import INSTANCES_KEY
from engine.sampling_params import SamplingParams
from engine.step_trace import KINDS, summarize
from tests.integration.services import (
    ENGINE_FLAGS,
    decode_stub,
    generate_request,
    start_tandem_serve,
)
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


def test_a_signal_to_the_whole_group_still_drains(tiny_qwen3_path):
    """Ctrl-C in a terminal (SIGINT) or systemd's stop (SIGTERM) reaches every process of
    `tandem serve`'s group, and the launcher then forwards SIGTERM to each child: a service
    must take those two as one stop and drain, not as "again: stop at once". A stream in
    flight ends with all its tokens; everything exits."""
    # its own group, as a shell job or a systemd unit has
    serve, url, lines = start_tandem_serve(tiny_qwen3_path, START_S, start_new_session=True)
    try:
        body = {"model": str(tiny_qwen3_path), "prompt": "one two three", "max_tokens": 200,
                "ignore_eos": True, "stream": True}  # fmt: skip
        texts, finish, before_signal = [], None, None
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, (event, "".join(lines[-60:]))
                choice = event["choices"][0]
                texts.append(choice["text"])
                finish = choice.get("finish_reason") or finish
                if before_signal is None:
                    before_signal = len(texts)
                    os.killpg(serve.pid, signal.SIGINT)  # the terminal's Ctrl-C
        assert before_signal is not None and before_signal < len(texts), "tokens after it"
        assert finish == "length", ("".join(lines[-60:]), texts[-3:])
        assert serve.wait(60) == 0
        log = "".join(lines)
        assert "stop at once" not in log.replace("send it again to stop at once", "")
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


_SIGNALS_SCRIPT = """
import asyncio, logging, sys
from engine import service_main
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
service_main.SAME_STOP_S = float(sys.argv[1])

async def main():
    drain = service_main._drain_on_signals()
    print("READY", flush=True)
    await drain.wait()
    print("DRAINING", flush=True)
    await asyncio.Event().wait()  # a drain that takes its time

asyncio.run(main())
"""


def test_a_second_signal_later_stops_at_once_and_a_doubled_one_does_not():
    """The window that makes one stop of a group's signal and the launcher's: a second signal
    inside it is logged and ignored (the drain goes on); one after it ends the process at once
    (SAME_STOP_S set to 60 s and to 0 here, instead of waiting for 2 s to pass)."""
    doubled = LineProc([sys.executable, "-c", _SIGNALS_SCRIPT, "60"])
    later = LineProc([sys.executable, "-c", _SIGNALS_SCRIPT, "0"])
    try:
        for proc in (doubled, later):
            proc.wait_for("^READY$", START_S)
            proc.proc.send_signal(signal.SIGINT)
            proc.wait_for("^DRAINING$", 30)
            proc.proc.send_signal(signal.SIGTERM)
        doubled.wait_for(r"SIGTERM: already draining", 30)
        assert doubled.proc.poll() is None
        assert later.proc.wait(30) == -signal.SIGTERM
        later.wait_for(r"SIGTERM again: stopping at once, without draining", 5)
    finally:
        for proc in (doubled, later):
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()
