"""The gateway's CPU per streamed token: what bounds the tokens/s one gateway process can relay.

Behind a GPU the gateway's work is dominated by streaming: every output token becomes one
Server-Sent Event on one client connection. A fake decode (`--serve-fake-decode`, its own
process) answers each request with `--tokens` tokens, one per `--step-ms` "decode step" on a
shared clock (as a GPU's batch advances all requests together, so its MuxResponses carry many
requests' tokens at once); `--concurrency` streaming chat completions run back to back against
one gateway process (auth off, no Redis). Over `--duration-s` it reports the gateway's CPU time
(utime + stime of all its threads) per token delivered, the token rate, its event loop's busy
fraction (from its own metrics), the 503s its load shedder returned, and the SSE events per
token (below 1 once it falls behind: what waits for a stream goes out as one event). With
`--profile-s`, py-spy samples the gateway meanwhile and the top functions (own time) are listed.

    python -m bench.gateway_stream [--concurrency 128 --step-ms 20 --tokens 128]
Writes `bench/results/gateway_stream-<YYYY-MM-DD>.json` and prints a short table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench import gateway_stages  # noqa: E402
from bench.common import (  # noqa: E402
    ensure_internal_token,
    print_table,
    process_cpu_s,
    stop_processes,
    write_result,
)  # noqa: E402
from bench.gateway_overhead import (  # noqa: E402
    MESSAGES,
    SERVED,
    start,
    start_gateway,
)
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc  # noqa: E402

ensure_internal_token()

# Ids that decode to short English words in SmolLM2's vocabulary (any ids would do).
WORDS = [504, 3575, 314, 4649, 282, 1345, 30, 216]


class StreamDecode(decode_mux.DecodeServicer):
    def __init__(self, step_s: float):
        self.step_s = step_s

    async def Generate(self, request, context):
        loop = asyncio.get_running_loop()
        n = request.params.max_tokens or 16
        for i in range(n):
            # The next tick of the shared step clock: all streams advance together.
            await asyncio.sleep(self.step_s - loop.time() % self.step_s)
            token = WORDS[i % len(WORDS)]
            yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))
        usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n)
        yield decode_pb2.GenerateResponse(
            final=decode_pb2.Final(finish_reason="length", usage=usage)
        )

    async def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="stream-fake")


async def serve_fake_decode(step_s: float) -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(StreamDecode(step_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY fake 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def request_bytes(port: int, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": SERVED,
            "messages": MESSAGES,
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }  # fmt: skip
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def stream_client(port: int, payload: bytes, stop_at: float, counts: collections.Counter):
    """Back-to-back streaming requests on one keep-alive connection until `stop_at`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            writer.write(payload)
            status = (await reader.readline()).split(b" ", 2)[1]
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            if status != b"200":
                await reader.readexactly(int(headers.get("content-length", 0)))
                counts[f"HTTP {status.decode()}"] += 1
                await asyncio.sleep(0.05)
                continue
            events = 0
            while True:  # chunked: size line, data, CRLF; ends with a 0-size chunk
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    await reader.readline()
                    break
                chunk = await reader.readexactly(size + 2)
                events += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
            counts["events"] += events
            counts["requests"] += 1
    finally:
        writer.close()


async def run_clients(port: int, args, duration_s: float) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    payload = request_bytes(port, args.tokens)
    stop_at = time.monotonic() + duration_s
    await asyncio.gather(
        *(stream_client(port, payload, stop_at, counts) for _ in range(args.concurrency))
    )
    return counts


def loop_busy(port: int) -> float | None:
    """tandem:event_loop_busy_fraction from the gateway's /metrics (None if it has none)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return None
    for line in text.decode().splitlines():
        if line.startswith("tandem:event_loop_busy_fraction"):
            return float(line.split()[-1])
    return None


def top_functions(raw: str, n: int = 25) -> list[tuple[str, float]]:
    """py-spy's raw (collapsed) stacks → the share of samples whose innermost frame is each
    function (own time), the first `n`."""
    own: collections.Counter = collections.Counter()
    for stack, count in gateway_stages.samples(raw):
        own[stack[-1]] += count
    total = sum(own.values())
    return [(f, c / total) for f, c in own.most_common(n)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--step-ms", type=float, default=20.0, help="the fake decode's step")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--profile-s", type=float, default=0.0, help="py-spy window (0: none)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--serve-fake-decode", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.serve_fake_decode:
        asyncio.run(serve_fake_decode(args.step_ms / 1000))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    workdir = Path(tempfile.mkdtemp(prefix="gateway_stream-"))
    procs: list[subprocess.Popen] = []
    try:
        fake_args = [sys.executable, "-m", "bench.gateway_stream", "--serve-fake-decode",
                     "--step-ms", str(args.step_ms)]  # fmt: skip
        fake, address = start(fake_args, dict(os.environ), workdir / "fake.log")
        procs.append(fake)
        gw = start_gateway("bare", address, "", workdir)
        procs.append(gw.proc)
        asyncio.run(run_clients(gw.port, args, args.warmup_s))
        cpu0, t0 = process_cpu_s(gw.proc.pid), time.monotonic()
        counts = asyncio.run(run_clients(gw.port, args, args.duration_s))
        cpu_s, wall_s = process_cpu_s(gw.proc.pid) - cpu0, time.monotonic() - t0
        busy = loop_busy(gw.port)
        profile, stages = [], {}
        if args.profile_s:
            spy = gateway_stages.start_profile(gw.proc.pid, args.profile_s)
            asyncio.run(run_clients(gw.port, args, args.profile_s + 2))
            raw_path = spy.output_path
            _, err = spy.communicate(timeout=120)
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")
            raw = raw_path.read_text()
            stages, _ = gateway_stages.shares(raw)
            profile = top_functions(raw)
    finally:
        stop_processes(procs, 20)
        shutil.rmtree(workdir, ignore_errors=True)
    # Every request counted ran to its end (ignore_eos): `tokens` each. A gateway that fell
    # behind sends the tokens waiting for a stream as one event: events <= tokens.
    tokens = counts["requests"] * args.tokens
    results = {
        "tokens": tokens,
        "requests": counts["requests"],
        "sse_events_per_token": counts["events"] / tokens if tokens else None,
        "refused": {k: v for k, v in counts.items() if k.startswith("HTTP")},
        "tok_s": tokens / wall_s,
        "gateway_cpu_fraction": cpu_s / wall_s,
        "gateway_cpu_us_per_token": 1e6 * cpu_s / tokens if tokens else None,
        "event_loop_busy_fraction": busy,
        "profile_stage_share": {k: round(v, 4) for k, v in stages.items()},
        "profile_own_share": [[f, round(s, 4)] for f, s in profile],
    }
    config = {k: getattr(args, k) for k in ("concurrency", "tokens", "step_ms", "duration_s")}
    path = write_result("gateway_stream", config, results, Path(args.out_dir or "bench/results"))
    print_table(
        [(str(args.concurrency), f"{results['tok_s']:.0f}",
          f"{results['gateway_cpu_fraction']:.2f}",
          f"{results['gateway_cpu_us_per_token'] or 0:.1f}", str(busy), str(results["refused"]),
          f"{results['sse_events_per_token'] or 0:.2f}")],
        ("conc", "tok/s", "gw CPU", "us/token", "loop busy", "refused", "events/token"),
    )  # fmt: skip
    for f, s in [*stages.items(), *profile]:
        print(f"{100 * s:5.1f}%  {f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
