"""What the gateway's decode transport (gRPC) costs per request, and where its threads wake.

Same load as `bench/gateway_overhead.py` (an `edge` gateway: key file + Redis quotas, a 4-token
chat completion at a fixed rate, the fast fake decode), with the gateway's `Generate` carried
by one of several transports, each its own gateway process, windows interleaved (the order
alternating per round, so that the bias of coming first in a pair cancels out):
  * `frames`: as shipped: the decode's framed connection (protos/mux_frames.py), which the
    fake decode advertises on its gRPC stream as a decode service does;
  * `grpc`: the `GenerateMux` stream on grpc.aio (gateway/mux.py), the advertised frames
    ignored (what shipped before them);
  * `grpc:K=V;K=V`: the same with environment variables set in the gateway only (grpc core
    settings such as `GRPC_EXPERIMENTS=-event_engine_client` or `GRPC_POLL_STRATEGY=poll`);
  * `raw`: the same `GenerateMux` messages (MuxRequest / MuxResponse, batched alike by the fake
    decode) as 4-byte-length-prefixed frames on a plain TCP socket read by the gateway's own
    event loop: no gRPC thread on the path. The 12-03 measuring prototype of `frames`: no
    authentication, no TLS, no reconnection;
  * `inproc`: no transport at all: `Generate` answered inside the gateway after a 1 ms timer
    (one loop wake-up standing for the response's arrival). The floor of any transport.
Per window: the gateway's CPU per request from every thread's `schedstat` (ns, exact), split by
thread kind (`main`, grpc's `poller` Python thread, grpc's `event_engine` threads, `other`),
and each kind's voluntary and involuntary context switches per request (wake-ups, and
preemptions by other processes on the machine); and the fake decode's CPU and wake-ups per
request in the same window (its side of the transport).

Writes `bench/results/gateway_transport-<date>.json` (`--tag` adds a suffix to the name).
Run from the repo root: `python -m bench.gateway_transport --variant grpc --variant frames`
(default: grpc, frames, raw and inproc, 10 rounds of 10 s windows at 100 req/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `gateway`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench import gateway_overhead as overhead  # noqa: E402
from bench.common import stop_processes, write_result  # noqa: E402
from protos import common_pb2, decode_pb2, decode_pb2_grpc, mux_frames  # noqa: E402

_FRAME = struct.Struct(">I")
_OK = decode_pb2.MuxStatus(code=grpc.StatusCode.OK.value[0])
ENV_RAW_DECODE = "TANDEM_BENCH_RAW_DECODE"  # host:port of the fake decode's raw listener


class _Frames:
    """Splits a byte stream into length-prefixed messages."""

    def __init__(self, message_type: type) -> None:
        self.buffer = bytearray()
        self.message_type = message_type

    def feed(self, data: bytes) -> list[Any]:
        self.buffer += data
        messages = []
        while len(self.buffer) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(self.buffer)
            end = _FRAME.size + size
            if len(self.buffer) < end:
                break
            messages.append(self.message_type.FromString(bytes(self.buffer[_FRAME.size : end])))
            del self.buffer[:end]
        return messages


def _frame(message: Any) -> bytes:
    data = message.SerializeToString()
    return _FRAME.pack(len(data)) + data


class RawDecodeProtocol(asyncio.Protocol):
    """The fake decode's raw listener: each start runs the servicer's `Generate` as a task, and
    items ready together go out in one MuxResponse (as `protos/decode_mux.py` batches them)."""

    def __init__(self, servicer: overhead.FastDecode) -> None:
        self.servicer = servicer
        self.frames = _Frames(decode_pb2.MuxRequest)
        self.batch: decode_pb2.MuxResponse | None = None
        self.tasks: dict[int, asyncio.Task] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for message in self.frames.feed(data):
            if message.WhichOneof("kind") == "cancel":
                task = self.tasks.pop(message.id, None)
                if task is not None:
                    task.cancel()
            else:
                task = asyncio.get_running_loop().create_task(self._run(message.id, message.start))
                self.tasks[message.id] = task

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self.tasks.values():
            task.cancel()

    async def _run(self, rid: int, request: decode_pb2.GenerateRequest) -> None:
        async for response in self.servicer.Generate(request, None):
            self._put(rid, response=response)
        self._put(rid, end=_OK)
        self.tasks.pop(rid, None)

    def _put(self, rid: int, **kind: Any) -> None:
        if self.batch is None:
            self.batch = decode_pb2.MuxResponse()
            asyncio.get_running_loop().call_soon(self._flush)
        self.batch.items.add(id=rid, **kind)

    def _flush(self) -> None:
        batch, self.batch = self.batch, None
        self.transport.write(_frame(batch))


async def serve_fake_decode() -> None:
    """The gateway_overhead fake decode on gRPC, plus the raw listener; prints
    `READY fake <grpc host:port>+<raw port>`."""
    servicer = overhead.FastDecode()
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await mux_frames.FramesServer(servicer, None, None).start("127.0.0.1", 0)
    await server.start()
    loop = asyncio.get_running_loop()
    raw = await loop.create_server(lambda: RawDecodeProtocol(servicer), "127.0.0.1", 0)
    raw_port = raw.sockets[0].getsockname()[1]
    print(f"READY fake 127.0.0.1:{port}+{raw_port}", flush=True)
    await server.wait_for_termination()


class RawMuxStream(asyncio.Protocol):
    """The gateway's side of the raw transport: what `gateway.mux.MuxStream` is to the calls
    (`loop`, `cancel`), so that its `MuxCall` serves the dispatcher unchanged."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls: dict[Any, Any] = {}
        self.frames = _Frames(decode_pb2.MuxResponse)
        self.transport: asyncio.Transport | None = None
        self.unsent: list[bytes] = []  # written before the connection is up
        self._next_id = 1

    def start(self, request: decode_pb2.GenerateRequest) -> Any:
        from gateway.mux import MuxCall

        rid, self._next_id = self._next_id, self._next_id + 1
        call = self.calls[rid] = MuxCall(self, rid, request)
        self._send(decode_pb2.MuxRequest(id=rid, start=request))
        return call

    def cancel(self, rid: int) -> bool:
        if self.calls.pop(rid, None) is None:
            return False
        self._send(decode_pb2.MuxRequest(id=rid, cancel=decode_pb2.MuxCancel()))
        return True

    def _send(self, message: decode_pb2.MuxRequest) -> None:
        if self.transport is None:
            self.unsent.append(_frame(message))
        else:
            self.transport.write(_frame(message))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        for data in self.unsent:
            self.transport.write(data)
        self.unsent.clear()

    def data_received(self, data: bytes) -> None:
        from gateway.mux import deliver

        for batch in self.frames.feed(data):
            deliver(self.calls, batch)

    def connection_lost(self, exc: Exception | None) -> None:
        from gateway.mux import _error

        error = _error(grpc.StatusCode.UNAVAILABLE, f"raw decode connection lost: {exc!r}")
        for call in self.calls.values():
            call._inbox.put(error)
        self.calls.clear()


class InprocCall:
    """`Generate` answered in the gateway: the fake decode's 4 tokens and Final, after 1 ms."""

    def __init__(self, request: decode_pb2.GenerateRequest) -> None:
        num_tokens = min(request.params.max_tokens or len(overhead.TOKENS), len(overhead.TOKENS))
        self.items: deque = deque(
            decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))
            for token in overhead.TOKENS[:num_tokens]
        )
        usage = common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens
        )
        final = decode_pb2.Final(finish_reason="length", usage=usage)
        self.items.extend((decode_pb2.GenerateResponse(final=final), grpc.aio.EOF))
        loop = asyncio.get_running_loop()
        self.arrived = loop.create_future()
        loop.call_later(0.001, self.arrived.set_result, None)

    async def read(self) -> Any:
        await self.arrived
        return self.items.popleft()

    def poll(self) -> decode_pb2.GenerateResponse | None:
        if self.arrived.done() and type(self.items[0]) is decode_pb2.GenerateResponse:
            return self.items.popleft()
        return None

    def cancel(self) -> bool:
        return False


def run_gateway(variant: str, argv: list[str]) -> None:
    """`python -m gateway ARGV` with `Generate` carried by `variant` (grpc, raw or inproc)."""
    from gateway import clients, mux

    if variant == "grpc":
        mux.DecodeGenerate._on_frames_port = lambda self, port: None
    elif variant == "raw":
        host, port = os.environ[ENV_RAW_DECODE].rsplit(":", 1)
        streams: dict[str, RawMuxStream] = {}

        def generate(self, instance, request):
            stream = streams.get(instance.address)
            if stream is None:
                stream = streams[instance.address] = RawMuxStream()
                connect = stream.loop.create_connection(lambda: stream, host, int(port))
                task = stream.loop.create_task(connect)
                task.add_done_callback(lambda t: t.result())  # a failed connect is raised
            return stream.start(request)

        clients.DecodeClients.generate = generate
    elif variant == "inproc":
        clients.DecodeClients.generate = lambda self, instance, request: InprocCall(request)
    else:
        raise SystemExit(f"unknown gateway variant {variant!r}")
    sys.argv = ["gateway", *argv]
    runpy.run_module("gateway", run_name="__main__", alter_sys=True)


def thread_kind(pid: int, tid: str, name: str) -> str:
    if tid == str(pid):
        return "main"
    if name == "event_engine":
        return "event_engine"
    return "poller" if name == "python" else "other"  # grpc.aio's poller: a Python thread


def thread_counters(pid: int) -> dict[str, tuple[str, float, int, int]]:
    """Per thread of `pid`: (kind, CPU s from schedstat, voluntary, involuntary switches)."""
    counters = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            cpu_ns = int((task / "schedstat").read_text().split()[0])
            status = dict(
                line.split(":\t", 1)
                for line in (task / "status").read_text().splitlines()
                if ":\t" in line
            )
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        kind = thread_kind(pid, tid, status["Name"].strip())
        voluntary = int(status["voluntary_ctxt_switches"])
        involuntary = int(status["nonvoluntary_ctxt_switches"])
        counters[tid] = (kind, cpu_ns / 1e9, voluntary, involuntary)
    return counters


def per_request(before: dict, after: dict, num: int) -> dict[str, Any]:
    """CPU ms and switches per request, by thread kind, between two `thread_counters`."""
    kinds: dict[str, list[float]] = {}
    for tid, (kind, cpu_s, voluntary, involuntary) in after.items():
        _, cpu0, vol0, invol0 = before.get(tid, (kind, 0.0, 0, 0))
        sums = kinds.setdefault(kind, [0.0, 0.0, 0.0])
        sums[0] += cpu_s - cpu0
        sums[1] += voluntary - vol0
        sums[2] += involuntary - invol0
    num = max(num, 1)
    by_kind = {
        kind: {
            "cpu_ms": round(1000 * cpu / num, 4),
            "voluntary_switches": round(vol / num, 3),
            "involuntary_switches": round(invol / num, 3),
        }
        for kind, (cpu, vol, invol) in sorted(kinds.items())
    }
    return {
        "cpu_ms_per_request": round(sum(k["cpu_ms"] for k in by_kind.values()), 4),
        "wakeups_per_request": round(sum(k["voluntary_switches"] for k in by_kind.values()), 3),
        "threads": by_kind,
    }


async def window(
    gw: overhead.Gateway, fake_pid: int, rate: float, duration_s: float, warmup_s: float
):
    """One window; `fake_decode`: the fake decode's own CPU and wake-ups per request meanwhile
    (it serves only this window's gateway, on this window's transport)."""
    pool, raw = overhead.HttpPool(gw.port), overhead.chat_request(gw.key)

    async def send() -> bool | int:
        status = await pool.send(raw)
        return status == 200 or status

    try:
        await overhead.open_loop(send, rate, warmup_s)
        before, fake0 = thread_counters(gw.proc.pid), thread_counters(fake_pid)
        busy0, t0 = overhead.machine_busy_s(), time.time()
        result = await overhead.open_loop(send, rate, duration_s)
        after, fake1 = thread_counters(gw.proc.pid), thread_counters(fake_pid)
        busy1, t1 = overhead.machine_busy_s(), time.time()
    finally:
        pool.close()
    fake = per_request(fake0, fake1, result["num_ok"])
    return {
        **per_request(before, after, result["num_ok"]),
        "fake_decode": {k: fake[k] for k in ("cpu_ms_per_request", "wakeups_per_request")},
        "num_ok": result["num_ok"],
        "num_errors": result["num_errors"],
        "p50_ms": result["p50_ms"],
        "machine_busy_cores": round((busy1 - busy0) / (t1 - t0), 3),
        "loadavg_1m_after": os.getloadavg()[0],
    }


def start_variant(variant: str, fake: str, raw_port: str, redis_url: str, workdir: Path):
    """An edge gateway for `variant` (see the module doc)."""
    folder = workdir / variant.replace("/", "_").replace(":", "_").replace(";", "_")
    folder.mkdir()
    kind, _, settings = variant.partition(":")
    env = dict(kv.split("=", 1) for kv in settings.split(";") if kv)
    if kind not in ("frames", "grpc", "raw", "inproc") or (env and kind != "grpc"):
        raise SystemExit(f"unknown variant {variant!r}")
    entry = ("-m", "gateway")
    if kind != "frames":
        entry = ("-m", "bench.gateway_transport", "--serve-gateway", kind)
        env[ENV_RAW_DECODE] = f"127.0.0.1:{raw_port}"
    gw = overhead.start_gateway("edge", fake, redis_url, folder, entry=entry, extra_env=env)
    gw.name = variant
    return gw


def summarize(windows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str) -> float:
        return round(statistics.mean(w[key] for w in windows), 4)

    kinds = sorted({k for w in windows for k in w["threads"]})
    threads = {
        kind: {
            field: round(
                statistics.mean(w["threads"].get(kind, {}).get(field, 0.0) for w in windows), 4
            )  # fmt: skip
            for field in ("cpu_ms", "voluntary_switches", "involuntary_switches")
        }
        for kind in kinds
    }
    fake = {
        k: round(statistics.mean(w["fake_decode"][k] for w in windows), 4)
        for k in ("cpu_ms_per_request", "wakeups_per_request")
    }
    return {
        "cpu_ms_per_request": mean("cpu_ms_per_request"),
        "wakeups_per_request": mean("wakeups_per_request"),
        "threads": threads,
        "fake_decode": fake,
    }


def paired(base: list[dict], other: list[dict]) -> dict[str, float]:
    """Mean and standard error of other - base over the rounds (CPU ms per request)."""
    diffs = [o["cpu_ms_per_request"] - b["cpu_ms_per_request"] for b, o in zip(base, other)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return {"mean_ms": round(statistics.mean(diffs), 4), "stderr_ms": round(se, 4)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", dest="variants", help="repeatable; see the doc")
    p.add_argument("--rounds", type=int, default=10, help="windows per variant")
    p.add_argument("--rate", type=float, default=100.0, help="req/s")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    p.add_argument("--serve-fake-decode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-gateway", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    if "--serve-gateway" in sys.argv[1:2]:
        run_gateway(sys.argv[2], sys.argv[3:])
        return
    args = parse_args()
    if args.serve_fake_decode:
        asyncio.run(serve_fake_decode())
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from tests.redis_server import RedisServer

    variants = args.variants or ["grpc", "frames", "raw", "inproc"]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    workdir = Path(tempfile.mkdtemp(prefix="gateway_transport-"))
    redis = RedisServer(workdir)
    redis.start()
    procs = []
    windows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        fake_args = [sys.executable, "-m", "bench.gateway_transport", "--serve-fake-decode"]
        fake, address = overhead.start(fake_args, dict(os.environ), workdir / "fake.log")
        procs.append(fake)
        grpc_address, raw_port = address.split("+")
        gateways = []
        for variant in variants:
            gateways.append(start_variant(variant, grpc_address, raw_port, redis.url, workdir))
            procs.append(gateways[-1].proc)
        for i in range(args.rounds):
            order = gateways if i % 2 == 0 else gateways[::-1]
            for k, gw in enumerate(order):
                w = overhead.Bench(grpc_address, args).run(
                    window(gw, fake.pid, args.rate, args.window_s, args.warmup_s)
                )
                w["position_in_round"] = k
                windows[gw.name].append(w)
                print(f"  round {i} {gw.name}: cpu {w['cpu_ms_per_request']} ms/req, wake-ups "
                      f"{w['wakeups_per_request']}/req, load {w['loadavg_1m_after']:.2f}",
                      flush=True)  # fmt: skip
    finally:
        stop_processes(procs, 20)
        redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    results: dict[str, Any] = {v: {**summarize(ws), "windows": ws} for v, ws in windows.items()}
    base = variants[0]
    results["paired_vs_first_variant"] = {
        v: paired(windows[base], windows[v]) for v in variants[1:]
    }
    config = {
        "variants": variants,
        "rounds": args.rounds,
        "rate": args.rate,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "order": "alternating per round (first variant first in even rounds)",
        "cpu": "schedstat of every thread of the gateway process, per request served",
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    name = "gateway_transport" + (f"_{args.tag}" if args.tag else "")
    path = write_result(name, config, results)
    for v in variants:
        r, f = results[v], results[v]["fake_decode"]
        print(
            f"{v}: {r['cpu_ms_per_request']} ms/req, {r['wakeups_per_request']} wake-ups/req; "
            f"fake decode {f['cpu_ms_per_request']} ms/req, {f['wakeups_per_request']} wake-ups"
        )
    for v, d in results["paired_vs_first_variant"].items():
        print(f"{v} - {base}: {d['mean_ms']:+.3f} +- {d['stderr_ms']:.3f} ms/req")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
