"""What the HTTP server alone costs per request: uvicorn (uvloop + httptools, as the gateway runs
it) against granian (a Rust HTTP server for ASGI apps), on an app that does nothing else.

Issue 14 asks for the gateway's CPU per request at 0.4x of 6da4224's; the stage profile gives
HTTP parsing and the event loop's socket I/O ~0.6 ms of the ~1.7 left. This measures how much
of that another server could take away, before anything is built on it: a minimal ASGI app
(reads the body, answers a fixed JSON of the gateway's response size with Content-Length)
behind each server, the same chat-completion request at a fixed rate over keep-alive
connections, and the CPU of the server's whole process tree (granian runs its worker as a child
process) per request. Servers alternate window by window.

    python -m bench.http_server [--rates 100,400] [--window-s 10] [--rounds 3]

granian is not a Tandem dependency: `pip install granian` first (skipped with a note if absent).
Writes `bench/results/http_server-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import free_port, print_table, process_cpu_s, write_result
from bench.gateway_overhead import HttpPool, chat_request, open_loop

RESPONSE = (
    b'{"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion",'
    b'"created":1764892800,"model":"smollm2","choices":[{"index":0,"message":{"role":'
    b'"assistant","content":"The capital of France","reasoning_content":null,"tool_calls":[]},'
    b'"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":'
    b'37,"total_tokens":41,"completion_tokens":4,"prompt_tokens_details":null}}'
)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(RESPONSE)).encode())]


async def app(scope, receive, send):
    """The minimal ASGI app both servers run (lifespan accepted, then every request answered)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE})


def _commands(port: int) -> dict[str, list[str]]:
    py = sys.executable
    uvicorn = [py, "-m", "uvicorn", "bench.http_server:app", "--host", "127.0.0.1"]
    uvicorn += ["--port", str(port), "--loop", "uvloop", "--http", "httptools"]
    uvicorn += ["--no-access-log", "--log-level", "warning"]
    commands = {"uvicorn": uvicorn}
    granian = shutil.which("granian", path=str(Path(py).parent))
    if granian:
        cmd = [granian, "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--workers", "1", "--runtime-threads", "1", "--loop", "uvloop"]
        cmd += ["--no-access-log", "--log-level", "warning", "bench.http_server:app"]
        commands["granian"] = cmd
    return commands


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (granian's worker is a child process)."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for child in Path(f"/proc/{parent}/task").glob("*/children"):
            for c in child.read_text().split():
                pids.append(int(c))
                frontier.append(int(c))
    return pids


def _tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            total += process_cpu_s(p)
        except FileNotFoundError:
            pass
    return total


async def _wait_up(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server on port {port}") from None
            await asyncio.sleep(0.05)


async def window(port: int, pid: int, rate: float, seconds: float) -> dict:
    pool = HttpPool(port)
    raw = chat_request(None)

    async def send() -> bool | str:
        status = await pool.send(raw)
        return status == 200 or str(status)

    await open_loop(send, rate, 1.0)  # warm-up: connections open
    cpu0 = _tree_cpu_s(pid)
    result = await open_loop(send, rate, seconds)
    cpu = _tree_cpu_s(pid) - cpu0
    pool.close()
    result["server_cpu_ms_per_request"] = round(1000 * cpu / max(result["num_ok"], 1), 4)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100,400")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    commands = _commands(0)  # which servers are installed
    if "granian" not in commands:
        print("granian is not installed: measuring uvicorn only (pip install granian)")
    servers = {}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        for name in commands:
            port = free_port()
            cmd = _commands(port)[name]
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            servers[name] = (proc, port)
            asyncio.run(_wait_up(port))
        windows: dict[str, dict[str, list]] = {n: {str(r): [] for r in rates} for n in servers}
        for _ in range(args.rounds):
            for rate in rates:
                for name, (proc, port) in servers.items():
                    r = asyncio.run(window(port, proc.pid, rate, args.window_s))
                    windows[name][str(rate)].append(r)
                    print(
                        f"  {name} @{rate:g}: cpu {r['server_cpu_ms_per_request']} ms/req, "
                        f"p50 {r['p50_ms']} ms, errors {r['num_errors']}",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    results = {}
    rows = []
    for name, by_rate in windows.items():
        results[name] = {}
        for rate, runs in by_rate.items():
            cpu = sorted(r["server_cpu_ms_per_request"] for r in runs)
            results[name][rate] = {
                "server_cpu_ms_per_request": cpu[len(cpu) // 2],  # median window
                "windows": runs,
            }
            rows.append((name, rate, str(cpu[len(cpu) // 2]), str(cpu)))
    config = {"rates": rates, "window_s": args.window_s, "rounds": args.rounds}
    config["commands"] = {n: " ".join(c[1:]) for n, c in _commands(0).items()}
    path = write_result("http_server", config, results)
    print_table(rows, ("server", "req/s", "cpu ms/req (median)", "windows"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
