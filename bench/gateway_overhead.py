"""Gateway overhead: the latency the gateway adds to one request, open-loop at fixed rates.

Added latency = (client → gateway → fast fake decode → client) minus (client → the same fake
decode over gRPC directly), per percentile (p50 of one minus p50 of the other, and so on).
The fake decode (`--serve-fake-decode`, its own process) streams 4 fixed tokens and a Final at
once, so what remains is the gateway: HTTP parsing, the edge (allowlist, key hash, the quota
Lua script in Redis, settlement), chat template + tokenization, routing, the gRPC call,
detokenization, the JSON response and the access log.

Open loop: request i is sent at t0 + i / rate whether or not earlier ones finished, and its
latency runs from that scheduled time (no coordinated omission: a stalled gateway shows up as
latency, not as a lower rate). The client is a minimal keep-alive HTTP/1.1 pool over asyncio
streams, so that the load generator costs as little CPU as possible on this 2-core machine
(the gateway, the fake decode, Redis and the client all share those cores).

Gateway configurations: `edge` (what ships: one API key from a key file with limits high enough
never to refuse, so every request runs the Redis quota scripts) and `bare` (auth off, no limits:
the cost of the edge is the difference). Model: SmolLM2-135M-Instruct's tokenizer and chat
template (only its tokenizer and configs are read).

Writes `bench/results/gateway_overhead-<YYYY-MM-DD>.json` and prints a short table.
Run from the repo root: `python -m bench.gateway_overhead` (loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `gateway`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench.common import ensure_internal_token, print_table, write_result  # noqa: E402
from protos import common_pb2, decode_pb2, decode_pb2_grpc  # noqa: E402

ensure_internal_token()

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED = "smollm2"
KEY = "sk-bench-0f1e2d3c4b5a69788796a5b4"
TOKENS = [504, 3575, 314, 4649]  # any ids: the fake decode ignores the prompt
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PERCENTILES = (50, 90, 99)


class FastDecode(decode_pb2_grpc.DecodeServicer):
    async def Generate(self, request, context):
        num_tokens = min(request.params.max_tokens or len(TOKENS), len(TOKENS))
        for token in TOKENS[:num_tokens]:
            yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))
        usage = common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens
        )
        yield decode_pb2.GenerateResponse(
            final=decode_pb2.Final(finish_reason="length", usage=usage)
        )

    async def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="fast-fake")


async def serve_fake_decode() -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(FastDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY fake 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


class HttpPool:
    """Keep-alive HTTP/1.1 connections to one loopback server; a request takes an idle one or
    opens a new one. Responses must carry Content-Length (the gateway's JSON responses do)."""

    def __init__(self, port: int):
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self, raw: bytes) -> int:
        if self.idle:  # a kept-alive connection the server may have closed meanwhile: retry once
            try:
                return await self._send(*self.idle.pop(), raw)
            except (OSError, asyncio.IncompleteReadError):
                pass
        return await self._send(*await asyncio.open_connection("127.0.0.1", self.port), raw)

    async def _send(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes):
        writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


def chat_request(key: str | None) -> bytes:
    body = json.dumps({"model": SERVED, "messages": MESSAGES, "max_tokens": 4}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def open_loop(send, rate: float, duration_s: float) -> dict[str, Any]:
    """Send at t0 + i / rate; latency from the scheduled time. `send()` → True when OK."""
    num_requests = int(rate * duration_s)
    latencies_s: list[float] = []
    num_errors = 0
    t0 = time.perf_counter() + 0.05
    last_done = t0

    async def one(scheduled: float) -> None:
        nonlocal num_errors, last_done
        try:
            ok = await send()
        except (OSError, grpc.aio.AioRpcError, asyncio.IncompleteReadError):
            ok = False
        last_done = time.perf_counter()
        if ok:
            latencies_s.append(last_done - scheduled)
        else:
            num_errors += 1

    tasks = []
    for i in range(num_requests):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration_s + 60)
    latencies_s.sort()
    pct = {
        f"p{p}_ms": 1000 * latencies_s[min(len(latencies_s) - 1, int(p / 100 * len(latencies_s)))]
        for p in PERCENTILES
    }
    return {
        "num_requests": num_requests,
        "num_ok": len(latencies_s),
        "num_errors": num_errors,
        "offered_rate": rate,
        "achieved_rate": round(len(latencies_s) / max(last_done - t0, 1e-9), 1),
        **{k: round(v, 3) for k, v in pct.items()},
        "mean_ms": round(1000 * sum(latencies_s) / max(len(latencies_s), 1), 3),
    }


async def measure_direct(address: str, rate: float, duration_s: float, warmup_s: float):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.GenerateRequest(
            request_id="bench",
            prompt_token_ids=list(range(1, 40)),
            params=common_pb2.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0),
        )

        async def send() -> bool:
            kinds = [msg.WhichOneof("kind") async for msg in stub.Generate(request)]
            return kinds[-1] == "final"

        await open_loop(send, rate, warmup_s)
        return await open_loop(send, rate, duration_s)


async def measure_gateway(port: int, key: str | None, rate: float, duration_s: float, warmup_s):
    pool, raw = HttpPool(port), chat_request(key)

    async def send() -> bool:
        return await pool.send(raw) == 200

    try:
        await open_loop(send, rate, warmup_s)
        return await open_loop(send, rate, duration_s)
    finally:
        pool.close()


def start(args: list[str], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start a process that prints `READY <what> host:port`; returns it and host:port."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=log)
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{args[:4]} did not start (see {log_path}): {line!r}")
    # Keep draining stdout: a full pipe would block the process at its next write.
    threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, log), daemon=True).start()
    return proc, line.split()[-1]


def start_gateway(config: str, decode: str, redis_url: str, workdir: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "gateway", "--model", MODEL, "--served-model-name", SERVED]
    args += ["--decode", decode, "--port", "0"]
    if config == "edge":
        keys = workdir / "keys"
        limits = {"requests_per_min": 10**7, "tokens_per_min": 10**10, "max_concurrent": 10**5}
        keys.write_text(f"{KEY}:bench:{json.dumps(limits)}\n")
        env["TANDEM_API_KEYS_FILE"] = str(keys)
        args += ["--redis-url", redis_url]
    return start(args, env, workdir / f"gateway-{config}.log")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="200,1000", help="requests/s, comma-separated")
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--configs", default="edge,bare")
    p.add_argument("--serve-fake-decode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_fake_decode:
        asyncio.run(serve_fake_decode())
        return
    from tests.redis_server import RedisServer  # the tests' loopback redis-server wrapper

    # Other work on the machine shows up as latency: record the load around the run.
    load_before = round(os.getloadavg()[0], 2)
    rates = [float(r) for r in args.rates.split(",")]
    configs = args.configs.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="gateway_overhead-"))
    redis = RedisServer(workdir)
    redis.start()
    procs: list[subprocess.Popen] = []
    results: dict[str, Any] = {}
    try:
        fake_args = [sys.executable, "-m", "bench.gateway_overhead", "--serve-fake-decode"]
        fake, address = start(fake_args, dict(os.environ), workdir / "fake.log")
        procs.append(fake)
        gateways = {}
        for config in configs:
            proc, gateway = start_gateway(config, address, redis.url, workdir)
            procs.append(proc)
            gateways[config] = int(gateway.rsplit(":", 1)[1])
        for rate in rates:
            direct = asyncio.run(measure_direct(address, rate, args.duration_s, args.warmup_s))
            results[f"direct@{rate:g}"] = direct
            for config in configs:
                key = KEY if config == "edge" else None
                port = gateways[config]
                run = measure_gateway(port, key, rate, args.duration_s, args.warmup_s)
                gw = asyncio.run(run)
                gw["added_p50_ms"] = round(gw["p50_ms"] - direct["p50_ms"], 3)
                gw["added_p99_ms"] = round(gw["p99_ms"] - direct["p99_ms"], 3)
                results[f"{config}@{rate:g}"] = gw
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    config = {
        "model": MODEL,
        "request": "chat.completions, non-streamed, max_tokens=4 (fake decode: 4 tokens)",
        **{k: getattr(args, k) for k in ("duration_s", "warmup_s")},
        "rates": rates,
        "configs": configs,
        "target": "added p99 <= 5 ms at 200 req/s (edge)",
        "loadavg_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
    }
    path = write_result("gateway_overhead", config, results)
    columns = ("achieved_rate", "num_errors", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms")
    rows = [(name, *(str(r.get(c, "-")) for c in columns)) for name, r in results.items()]
    print_table(rows, ("run", *columns))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
