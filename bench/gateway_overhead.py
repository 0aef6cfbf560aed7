"""Gateway overhead: the latency and CPU the gateway adds to one request, open-loop.

Added latency = (client → gateway → fast fake decode → client) minus (client → the same fake
decode over gRPC directly) at the same rate, per percentile (p50 of one minus p50 of the other,
and so on). The fake decode (`--serve-fake-decode`, its own process) streams 4 fixed tokens and
a Final at once, so what remains is the gateway: HTTP parsing, the edge (allowlist, key hash,
the quota Lua script in Redis, settlement), chat template + tokenization, routing, the gRPC
call (on the fake decode's framed connection, protos/mux_frames.py, once the gateway has it;
a baseline tree's gateway that predates it stays on gRPC), detokenization, the JSON response and
the access log.

Per gateway configuration it reports:
  * `cpu_ms_per_request`: the gateway process's CPU time (utime + stime of all its threads,
    /proc/<pid>/stat) over a fixed-rate window (`--cpu-rate`, `--cpu-s`), per request served;
  * `saturation_rps`: the highest rate whose added p99 stays under `--target-p99-ms` (50) and
    whose offered rate is achieved (95%), each candidate held for `--window-s` (>= 30 s for a
    recorded result). Failed or refused (503) requests count as infinitely slow, so more than
    1% of them is a miss. The search steps up by 25% in short probes (`--probe-s`; a failed
    probe is repeated once) to find the knee, then holds full windows around it, 10% apart: up
    from the last probe that passed until one fails, or down until one passes. The gateways'
    windows alternate, so a burst of other load on the machine hits them alike;
  * `stages_ms_per_request`: where that CPU goes (py-spy samples sorted into stages by
    bench/gateway_stages.py, each thread's samples weighed to its CPU time, times
    `cpu_ms_per_request`), taken in a separate window at `--cpu-rate` (sampling perturbs the
    process, so it is not the CPU window); that window's CPU per thread is in
    `profile_window.thread_cpu_ms_per_request`. py-spy counts a runnable thread as running,
    so a stage whose system call wakes a peer on these 2 cores and is then preempted reads high
    (socket writes: ~17% of its samples on 2026-12-05). `native_ms_per_request` splits the same
    CPU by shared object from `perf record`'s on-CPU samples, taken in the same window (the
    interpreter, the kernel, tokenizers, pydantic-core, uvloop, protobuf); every window also
    has `cpu_system_share`, the kernel's part of the gateway's CPU.
With `--baseline-tree PATH` (a checkout of an older commit: `git worktree add /tmp/base REV`)
every configuration also runs from that tree (`baseline-edge`, ...), in the same run on the same
machine, and `ratios` gives current / baseline. CPU windows of all gateways are interleaved,
the order reversed every other round (the first in a round reads ~3.5% high).

Open loop: request i is sent at t0 + i / rate whether or not earlier ones finished, and its
latency runs from that scheduled time (no coordinated omission: a stalled gateway shows up as
latency, not as a lower rate). The client is a minimal keep-alive HTTP/1.1 pool over asyncio
streams (on uvloop when installed), so that the load generator costs as little CPU as possible
on this 2-core machine (the gateway, the fake decode, Redis and the client share those cores).

Gateway configurations: `edge` (what ships: one API key from a key file with limits high enough
never to refuse, so every request runs the Redis quota scripts) and `bare` (auth off, no limits:
the cost of the edge is the difference). Model: SmolLM2-135M-Instruct's tokenizer and chat
template (only its tokenizer and configs are read).

Writes `bench/results/gateway_overhead-<YYYY-MM-DD>.json` and prints a short table.
Run from the repo root: `python -m bench.gateway_overhead [--baseline-tree PATH] [--quick]`
(loopback only; `--quick`: short windows, a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `gateway`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench import gateway_stages  # noqa: E402
from bench.common import (  # noqa: E402
    ensure_internal_token,
    print_table,
    process_cpu_s,
    process_user_system_s,
    stop_processes,
    write_result,
)
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc, mux_frames  # noqa: E402

ensure_internal_token()

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVED = "smollm2"
KEY = "sk-bench-0f1e2d3c4b5a69788796a5b4"
TOKENS = [504, 3575, 314, 4649]  # any ids: the fake decode ignores the prompt
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PERCENTILES = (50, 90, 99)
PROFILE_HZ = 200  # py-spy samples per second


class FastDecode(decode_mux.DecodeServicer):
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
    """The fast fake decode, on gRPC and on the framed transport (protos/mux_frames.py) as a
    decode service serves: a gateway that knows the frames moves its requests there."""
    servicer, server = FastDecode(), grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await mux_frames.FramesServer(servicer, None, None).start("127.0.0.1", 0)  # as insecure
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


PROMPT_CHARS = 0  # --prompt-chars: a completion of a text prompt this long instead of the chat


def prompt_text(num_chars: int) -> str:
    """Random words (fixed seed), `num_chars` long: text whose tokenizing costs what a real
    prompt of that length costs (a repeated word would hit the BPE's caches)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words, length = [], 0
    while length < num_chars:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:num_chars]


def chat_request(key: str | None) -> bytes:
    if PROMPT_CHARS:
        payload = {"model": SERVED, "prompt": prompt_text(PROMPT_CHARS), "max_tokens": 4}
        path = "/v1/completions"
    else:
        payload, path = (
            {"model": SERVED, "messages": MESSAGES, "max_tokens": 4},
            "/v1/chat/completions",
        )
    body = json.dumps(payload).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if key:
        head += f"Authorization: Bearer {key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def open_loop(send, rate: float, duration_s: float) -> dict[str, Any]:
    """Send at t0 + i / rate; latency from the scheduled time. `send()` → True when OK, else
    what went wrong (an HTTP status), counted under `errors`."""
    num_requests = int(rate * duration_s)
    latencies_s: list[float] = []
    errors: Counter[str] = Counter()
    t0 = time.perf_counter() + 0.05
    last_done = t0

    async def one(scheduled: float) -> None:
        nonlocal last_done
        try:
            outcome = await send()
        except (OSError, grpc.aio.AioRpcError, asyncio.IncompleteReadError) as e:
            outcome = type(e).__name__
        last_done = time.perf_counter()
        if outcome is True:
            latencies_s.append(last_done - scheduled)
        else:
            errors[str(outcome)] += 1

    tasks = []
    for i in range(num_requests):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration_s + 60)
    latencies_s.sort()
    pct = {f"p{p}_ms": _percentile_ms(latencies_s, p) for p in PERCENTILES}
    with_errors = latencies_s + [math.inf] * sum(errors.values())
    return {
        "num_requests": num_requests,
        "num_ok": len(latencies_s),
        "num_errors": sum(errors.values()),
        "errors": dict(errors),
        "offered_rate": rate,
        "achieved_rate": round(len(latencies_s) / max(last_done - t0, 1e-9), 1),
        **pct,
        "mean_ms": round(1000 * sum(latencies_s) / max(len(latencies_s), 1), 3),
        "p99_with_errors_ms": _percentile_ms(with_errors, 99),
    }


def _percentile_ms(sorted_s: list[float], p: float) -> float | None:
    """The p-th percentile in ms, rounded; None when it is infinite (a failed request)."""
    if not sorted_s:
        return None
    value = sorted_s[min(len(sorted_s) - 1, int(p / 100 * len(sorted_s)))]
    return None if math.isinf(value) else round(1000 * value, 3)


async def measure_direct(address: str, rate: float, duration_s: float, warmup_s: float):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.GenerateRequest(
            request_id="bench",
            prompt_token_ids=list(range(1, 40)),
            params=common_pb2.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0),
        )

        async def send() -> bool | str:
            kinds = [msg.WhichOneof("kind") async for msg in stub.Generate(request)]
            return kinds[-1] == "final" or kinds[-1]

        await open_loop(send, rate, warmup_s)
        return await open_loop(send, rate, duration_s)


def own_cpu_s(pids: Sequence[int]) -> float:
    """CPU of this process and `pids` (the benchmark's own: gateways, fake decode, Redis)."""
    return time.process_time() + sum(process_cpu_s(pid) for pid in pids)


def machine_busy_s() -> float:
    """CPU time all cores spent running processes since boot, or stolen by the hypervisor
    (/proc/stat), in seconds. Interrupt time is left out: loopback traffic, the benchmark's
    own mostly, is processed there, on no process's account."""
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Gateway:
    name: str  # edge | bare, prefixed "baseline-" when it runs from --baseline-tree
    proc: subprocess.Popen
    port: int
    key: str | None


async def measure_gateway(
    gw: Gateway,
    rate: float,
    duration_s: float,
    warmup_s: float,
    profile_s: float = 0.0,
    own_pids: Sequence[int] = (),
) -> dict[str, Any]:
    """One window at `rate`, with the CPU it cost the gateway (and this client), and the CPU
    that processes other than `own_pids` and this one used meanwhile (`foreign_cores`); with
    `profile_s`, py-spy samples the gateway's stages meanwhile."""
    pool, raw = HttpPool(gw.port), chat_request(gw.key)

    async def send() -> bool | int:
        status = await pool.send(raw)
        return status == 200 or status

    try:
        await open_loop(send, rate, warmup_s)
        profiler, threads0 = None, {}
        native = None
        if profile_s:
            profiler = gateway_stages.start_profile(gw.proc.pid, profile_s, PROFILE_HZ)
            native = gateway_stages.start_native_profile(gw.proc.pid, profile_s)
            own_pids = [*own_pids, profiler.pid, *([native.pid] if native else [])]
            threads0 = gateway_stages.thread_cpu_s(gw.proc.pid)
        (user0, system0), client0 = process_user_system_s(gw.proc.pid), time.process_time()
        busy0, own0, t0 = machine_busy_s(), own_cpu_s(own_pids), time.perf_counter()
        result = await open_loop(send, rate, profile_s or duration_s)
        user_s, system_s = process_user_system_s(gw.proc.pid)
        user_s, system_s, client_s = (
            user_s - user0,
            system_s - system0,
            time.process_time() - client0,
        )
        cpu_s = user_s + system_s
        if profiler is not None:
            threads = gateway_stages.thread_cpu_s(gw.proc.pid)
            thread_cpu = gateway_stages.thread_cpu_between(threads0, threads)
        foreign_s = machine_busy_s() - busy0 - (own_cpu_s(own_pids) - own0)
        result["foreign_cores"] = round(foreign_s / (time.perf_counter() - t0), 3)
    finally:
        pool.close()
    num_ok = max(result["num_ok"], 1)
    result["cpu_ms_per_request"] = round(1000 * cpu_s / num_ok, 3)
    result["client_cpu_ms_per_request"] = round(1000 * client_s / num_ok, 3)
    result["cpu_system_share"] = round(system_s / cpu_s, 3) if cpu_s else None  # the kernel's
    if profiler is not None:
        stage_shares, num_samples = await asyncio.to_thread(
            gateway_stages.finish, profiler, thread_cpu
        )
        result["thread_cpu_ms_per_request"] = {
            f"{name} ({tid})": round(1000 * cpu / num_ok, 3)
            for tid, (name, cpu) in sorted(thread_cpu.items(), key=lambda t: -t[1][1])
        }
        result["profile_samples"] = num_samples
        # Samples of running threads per sampling tick: the cores py-spy saw busy (vs the
        # measured CPU: how much of it the samples cover).
        result["sampled_cores"] = round(num_samples / (PROFILE_HZ * int(profile_s)), 3)
        result["stage_shares"] = {k: round(v, 4) for k, v in stage_shares.items()}
        if native is not None:  # on-CPU samples by library (perf): what the stages run on
            result["native_shares"] = await asyncio.to_thread(gateway_stages.finish_native, native)
    return result


class Bench:
    """Runs windows against the gateways; caches the direct gRPC figures per rate."""

    def __init__(self, address: str, args: argparse.Namespace, own_pids: Sequence[int] = ()):
        self.address, self.args, self.own_pids = address, args, list(own_pids)
        self.direct: dict[float, dict[str, Any]] = {}

    def run(self, coro) -> Any:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            return asyncio.run(coro)

    def direct_at(self, rate: float) -> dict[str, Any]:
        if rate not in self.direct:
            a = self.args
            self.direct[rate] = self.run(measure_direct(self.address, rate, a.direct_s, a.warmup_s))
        return self.direct[rate]

    def window(self, gw: Gateway, rate: float, duration_s: float, profile_s: float = 0.0):
        """One window; taken again (up to `--retries` times, after a pause) while other
        processes on the machine used more than `--max-foreign-cores` of it meanwhile."""
        a, discarded = self.args, []
        while True:
            run = measure_gateway(gw, rate, duration_s, a.warmup_s, profile_s, self.own_pids)
            result = self.run(run)
            if result["foreign_cores"] <= a.max_foreign_cores or len(discarded) >= a.retries:
                break
            print(f"  {gw.name} @{rate:g}: {result['foreign_cores']} cores used by other "
                  "processes meanwhile: again", flush=True)  # fmt: skip
            discarded.append({k: result.get(k) for k in ("foreign_cores", "p99_with_errors_ms")})
            time.sleep(a.retry_pause_s)
        result["discarded_windows"] = discarded
        direct = self.direct_at(rate)
        for p in PERCENTILES:
            if result[f"p{p}_ms"] is not None:
                result[f"added_p{p}_ms"] = round(result[f"p{p}_ms"] - direct[f"p{p}_ms"], 3)
        # Refused or failed requests count as infinitely slow: 1% of them is a p99 miss.
        p99 = result["p99_with_errors_ms"]
        added_p99 = math.inf if p99 is None else p99 - direct["p99_ms"]
        result["is_ok"] = (
            added_p99 < self.args.target_p99_ms and result["achieved_rate"] >= 0.95 * rate
        )
        result["loadavg_1m_after"] = os.getloadavg()[0]  # others' work shows up as latency
        print(f"  {gw.name} @{rate:g} for {duration_s:g} s: {brief(result)}", flush=True)
        return result

    def saturations(self, gateways: list[Gateway]) -> dict[str, dict[str, Any]]:
        """Every gateway's `saturation_search`, their windows taken in turn (a burst of other
        load on the machine then hits them alike)."""
        searches = {gw.name: saturation_search(self.args) for gw in gateways}
        wanted = {name: next(search) for name, search in searches.items()}
        found: dict[str, dict[str, Any]] = {}
        while wanted:
            for gw in gateways:
                if gw.name not in wanted:
                    continue
                result = self.window(gw, *wanted[gw.name])
                try:
                    wanted[gw.name] = searches[gw.name].send(result)
                except StopIteration as done:
                    found[gw.name] = done.value
                    del wanted[gw.name]
        return found


def saturation_search(args) -> Generator[tuple[float, float], dict, dict[str, Any]]:
    """One gateway's search for its saturation rate (see the module doc), as a generator: it
    yields (rate, window_s) to measure and is sent each window's result."""
    probes, rate, last_ok, has_retried = [], args.start_rate, None, False
    while rate <= args.max_rate:
        probe = yield rate, args.probe_s
        probes.append(probe)
        if probe["is_ok"]:
            last_ok, rate, has_retried = rate, _step(rate, 1.25), False
        elif has_retried:
            break
        else:
            has_retried = True  # once: one noisy probe must not end the climb
    windows, rate = [], last_ok or _step(args.start_rate, 0.8)
    passed, failed = None, None
    while passed is None or failed is None:
        result = yield rate, args.window_s
        windows.append(result)
        if result["is_ok"]:
            passed = max(passed or 0, rate)
            if rate >= args.max_rate:
                break
            rate = _step(rate, 1.1)
        else:
            failed = min(failed or rate, rate)
            if passed is not None or rate <= 10:
                break
            rate = _step(rate, 1 / 1.1)
    return {"saturation_rps": passed or 0, "windows": windows, "probes": probes}


def _step(rate: float, factor: float) -> float:
    """`rate * factor`, rounded to 5 req/s and moved by at least 5."""
    stepped = max(5.0, 5 * round(rate * factor / 5))
    if stepped == rate:
        stepped = rate + 5 if factor > 1 else max(5.0, rate - 5)
    return stepped


def brief(r: dict[str, Any]) -> str:
    return (
        f"achieved {r['achieved_rate']} req/s, errors {r['errors'] or 0}, added p50/p99 "
        f"{r.get('added_p50_ms')}/{r.get('added_p99_ms')} ms, cpu {r['cpu_ms_per_request']} ms/req"
    )


def start(
    args: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """Start a process that prints `READY <what> host:port`; returns it and host:port."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=log, cwd=cwd)
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{args[:4]} did not start (see {log_path}): {line!r}")
    # Keep draining stdout: a full pipe would block the process at its next write.
    threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, log), daemon=True).start()
    return proc, line.split()[-1]


def start_gateway(
    config: str,
    decode: str,
    redis_url: str,
    workdir: Path,
    tree: Path | None = None,
    hidden: Sequence[str] = (),
    entry: Sequence[str] = ("-m", "gateway"),
    extra_env: dict[str, str] | None = None,
) -> Gateway:
    """`tree`: run the gateway from that checkout (its `gateway`, `engine`, `protos` first on
    the path) instead of this one, with the modules `hidden` made unimportable (packages this
    environment has but the tree's own dependencies do not: uvicorn would pick httptools and a
    gateway orjson just because they are installed). `entry`: what follows the interpreter in
    place of `-m gateway` (it takes the gateway's flags); `extra_env`: set in the gateway only."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra_env or {})
    name = config if tree is None else f"baseline-{config}"
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(hide_modules(workdir, hidden)), str(tree)])
    args = [sys.executable, *entry, "--model", MODEL, "--served-model-name", SERVED]
    args += ["--decode", decode, "--port", "0"]
    if config == "edge":
        keys = workdir / "keys"
        limits = {"requests_per_min": 10**7, "tokens_per_min": 10**10, "max_concurrent": 10**5}
        keys.write_text(f"{KEY}:bench:{json.dumps(limits)}\n")
        env["TANDEM_API_KEYS_FILE"] = str(keys)
        args += ["--redis-url", redis_url]
    proc, address = start(args, env, workdir / f"gateway-{name}.log", cwd=tree)
    return Gateway(name, proc, int(address.rsplit(":", 1)[1]), KEY if config == "edge" else None)


def hide_modules(workdir: Path, names: Sequence[str]) -> Path:
    """A folder that, first on PYTHONPATH, makes `import name` raise ImportError."""
    folder = workdir / "hidden"
    for name in names:
        (folder / name).mkdir(parents=True, exist_ok=True)
        message = f"{name} is hidden: not a dependency of the baseline tree"
        (folder / name / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r})\n")
    return folder


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="edge,bare")
    p.add_argument("--baseline-tree", type=Path, help="also run every config from this checkout")
    p.add_argument(
        "--baseline-hide",
        default="uvloop,httptools,orjson",
        help="modules the baseline gateway must not import (not in its pyproject)",
    )
    p.add_argument("--cpu-rate", type=float, default=100.0, help="req/s of the CPU window")
    p.add_argument("--cpu-s", type=float, default=30.0, help="CPU window (per repeat)")
    p.add_argument(
        "--cpu-repeats",
        type=int,
        default=2,
        help="CPU windows per gateway (even: each gateway first in as many rounds)",
    )
    p.add_argument("--profile-s", type=float, default=20.0, help="py-spy window (0: none)")
    p.add_argument("--target-p99-ms", type=float, default=50.0, help="saturation: added p99")
    p.add_argument("--start-rate", type=float, default=50.0, help="saturation search start")
    p.add_argument("--max-rate", type=float, default=3000.0)
    p.add_argument("--window-s", type=float, default=30.0, help="saturation: a held window")
    p.add_argument("--probe-s", type=float, default=5.0, help="saturation: a probe window")
    p.add_argument("--direct-s", type=float, default=10.0, help="direct gRPC window per rate")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument(
        "--max-foreign-cores",
        type=float,
        default=0.3,
        help="a window during which other processes used more CPU than this is taken again",
    )
    p.add_argument("--retries", type=int, default=3, help="of a window, for foreign load")
    p.add_argument("--retry-pause-s", type=float, default=20.0)
    p.add_argument("--no-saturation", action="store_true", help="CPU and profile only")
    p.add_argument("--quick", action="store_true", help="short windows: a smoke test")
    p.add_argument(
        "--prompt-chars", type=int, default=0,
        help="send a completion of a random-word prompt this long (0: the 4-token chat)",
    )  # fmt: skip
    p.add_argument("--serve-fake-decode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    global PROMPT_CHARS
    PROMPT_CHARS = args.prompt_chars
    if args.quick:
        args.cpu_s, args.cpu_repeats, args.profile_s = 4.0, 1, min(args.profile_s, 4.0)
        args.window_s, args.probe_s, args.direct_s, args.warmup_s = 4.0, 2.0, 2.0, 0.5
    return args


def main() -> None:
    args = parse_args()
    if args.serve_fake_decode:
        asyncio.run(serve_fake_decode())
        return
    # Terminated: still stop what this started (the `finally` below runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from tests.redis_server import RedisServer  # the tests' loopback redis-server wrapper

    # Other work on the machine shows up as latency and CPU: record the load around the run.
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    configs = args.configs.split(",")
    trees: list[Path | None] = [None] + ([args.baseline_tree] if args.baseline_tree else [])
    workdir = Path(tempfile.mkdtemp(prefix="gateway_overhead-"))
    redis = RedisServer(workdir)
    redis.start()
    procs: list[subprocess.Popen] = []
    results: dict[str, Any] = {}
    try:
        fake_args = [sys.executable, "-m", "bench.gateway_overhead", "--serve-fake-decode"]
        fake, address = start(fake_args, dict(os.environ), workdir / "fake.log")
        procs.append(fake)
        gateways = []
        for tree in trees:
            for config in configs:
                hidden = args.baseline_hide.split(",") if args.baseline_hide else []
                gw = start_gateway(config, address, redis.url, workdir, tree, hidden)
                gateways.append(gw)
                procs.append(gateways[-1].proc)
        bench = Bench(address, args, [redis.proc.pid, *(p.pid for p in procs)])
        results = measure_all(bench, gateways, args)
    finally:
        stop_processes(procs, 20)
        redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    results["direct"] = {f"{rate:g}": r for rate, r in sorted(bench.direct.items())}
    config = {
        "model": MODEL,
        "prompt_chars": args.prompt_chars,
        "request": (
            f"completions of a {args.prompt_chars}-character random-word prompt"
            if args.prompt_chars
            else "chat.completions"
        )
        + ", non-streamed, max_tokens=4 (fake decode: 4 tokens)",
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        "baseline_commit": tree_commit(args.baseline_tree) if args.baseline_tree else None,
        "baseline_hidden_modules": args.baseline_hide,
        **{k: getattr(args, k) for k in ("cpu_rate", "cpu_s", "cpu_repeats", "profile_s")},
        **{k: getattr(args, k) for k in ("window_s", "probe_s", "direct_s", "warmup_s")},
        **{k: getattr(args, k) for k in ("target_p99_ms", "start_rate", "quick")},
        **{k: getattr(args, k) for k in ("max_foreign_cores", "retries", "retry_pause_s")},
        "configs": configs,
        "saturation": f"highest rate with added p99 < {args.target_p99_ms:g} ms, no errors and "
        f">= 95% of the rate achieved, over a {args.window_s:g} s window",
        "client_loop": "uvloop" if _has("uvloop") else "asyncio",
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    path = write_result("gateway_overhead", config, results)
    print_summary(results)
    print(f"wrote {path}")


def cpu_window_order(gateways: Sequence[Gateway], repeats: int) -> list[Gateway]:
    """The gateways' CPU windows in turn, the order reversed every other round (A B B A ...):
    the gateway whose window comes first in a round reads ~3.5% high (bench/README.md,
    2026-12-07), and over an even number of rounds each comes first equally often."""
    order: list[Gateway] = []
    for i in range(repeats):
        order += gateways if i % 2 == 0 else list(reversed(gateways))
    return order


def measure_all(bench: Bench, gateways: list[Gateway], args) -> dict[str, Any]:
    results: dict[str, Any] = {gw.name: {} for gw in gateways}
    # CPU windows interleaved, so that other load on the machine hits every gateway alike.
    cpu_windows: dict[str, list] = {gw.name: [] for gw in gateways}
    for gw in cpu_window_order(gateways, args.cpu_repeats):
        cpu_windows[gw.name].append(bench.window(gw, args.cpu_rate, args.cpu_s))
    for gw in gateways:
        windows = cpu_windows[gw.name]
        num_ok = sum(w["num_ok"] for w in windows)
        cpu = sum(w["cpu_ms_per_request"] * w["num_ok"] for w in windows) / max(num_ok, 1)
        results[gw.name]["cpu_ms_per_request"] = round(cpu, 3)
        results[gw.name]["cpu_windows"] = windows
    if args.profile_s:
        for gw in gateways:
            w = bench.window(gw, args.cpu_rate, args.profile_s, profile_s=args.profile_s)
            cpu = results[gw.name]["cpu_ms_per_request"]
            results[gw.name]["stages_ms_per_request"] = {
                stage: round(share * cpu, 3) for stage, share in w["stage_shares"].items()
            }
            if "native_shares" in w:  # the same CPU by library, from perf's on-CPU samples
                results[gw.name]["native_ms_per_request"] = {
                    dso: round(share * cpu, 3) for dso, share in w["native_shares"].items()
                }
            results[gw.name]["profile_window"] = w
    if not args.no_saturation:
        for name, search in bench.saturations(gateways).items():
            results[name]["saturation_rps"] = search.pop("saturation_rps")
            results[name]["saturation_search"] = search
    ratios = {}
    for gw in gateways:
        base = results.get(f"baseline-{gw.name}")
        if base is None:
            continue
        cur = results[gw.name]
        ratios[gw.name] = {
            k: round(cur[k] / base[k], 3) for k in ("cpu_ms_per_request", "saturation_rps")
            if k in cur and base.get(k)
        }  # fmt: skip
    if ratios:
        results["ratios_current_over_baseline"] = ratios
    return results


def print_summary(results: dict[str, Any]) -> None:
    rows = [
        (name, str(r.get("cpu_ms_per_request", "-")), str(r.get("saturation_rps", "-")))
        for name, r in results.items()
        if isinstance(r, dict) and "cpu_ms_per_request" in r
    ]
    print_table(rows, ("gateway", "cpu ms/request", "saturation req/s"))
    for name, r in results.items():
        if "stages_ms_per_request" in r:
            stages = ", ".join(f"{k} {v}" for k, v in r["stages_ms_per_request"].items())
            print(f"{name} stages (ms/request): {stages}")
        if "native_ms_per_request" in r:
            top = list(r["native_ms_per_request"].items())[:8]
            print(
                f"{name} on CPU by library (perf, ms/request): "
                + ", ".join(f"{k} {v}" for k, v in top)
            )
    for name, ratio in results.get("ratios_current_over_baseline", {}).items():
        print(f"{name} current / baseline: {ratio}")


def tree_commit(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True)
    return done.stdout.decode().strip() or "unknown"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
