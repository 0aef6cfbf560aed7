"""A cohort of requests arriving at once: how long the last of them waits at the gateway.

A closed-loop benchmark's clients (and real traffic after a hiccup) send many requests in the
same instant; the gateway prepares each one (parse, template, tokenize) before it reaches a
decode, and a burst queues for that work. Here N connections each send one completion of a
`--prompt-chars` random-word prompt at the same moment, `--rounds` times, against the fast
fake decode of `bench/gateway_overhead.py` (4 tokens at once), for this tree's gateway and,
with `--baseline-tree`, another checkout's, alternating. Per burst: the median and the slowest
request's latency from the burst's start; per gateway: their medians and the gateway's CPU
per request.

    python -m bench.gateway_burst --burst 64 --burst 200 --baseline-tree /tmp/base
Writes `bench/results/gateway_burst-<date>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import gateway_overhead as go
from bench.common import process_cpu_s, write_result


async def bursts(gw: go.Gateway, n: int, rounds: int) -> list[tuple[float, float]]:
    """(median, max) latency of each of `rounds` bursts of `n` requests."""
    pools = [go.HttpPool(gw.port) for _ in range(n)]
    raw = go.chat_request(gw.key)
    try:
        await asyncio.gather(*(p.send(raw) for p in pools))  # connections up, caches warm
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()

            async def one(pool: go.HttpPool, t0: float = t0) -> float:
                status = await pool.send(raw)
                if status != 200:
                    raise RuntimeError(f"the gateway answered {status} in a burst")
                return time.perf_counter() - t0

            latencies = await asyncio.gather(*(one(p) for p in pools))
            out.append((statistics.median(latencies), max(latencies)))
            await asyncio.sleep(0.2)  # the burst is over before the next
        return out
    finally:
        for p in pools:
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, action="append", help="requests per burst (repeatable)")
    ap.add_argument("--rounds", type=int, default=10, help="bursts per gateway and repeat")
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the gateways")
    ap.add_argument("--prompt-chars", type=int, default=3000)
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    go.PROMPT_CHARS = args.prompt_chars
    from tests.redis_server import RedisServer

    workdir = Path(tempfile.mkdtemp(prefix="gateway_burst-"))
    redis = RedisServer(workdir)
    redis.start()
    procs = []
    results: dict = {}
    try:
        fake_args = [sys.executable, "-m", "bench.gateway_overhead", "--serve-fake-decode"]
        fake, address = go.start(fake_args, dict(os.environ), workdir / "fake.log")
        procs.append(fake)
        gateways = {"current": go.start_gateway("bare", address, redis.url, workdir)}
        if args.baseline_tree:
            gateways["baseline"] = go.start_gateway(
                "bare", address, redis.url, workdir, args.baseline_tree
            )
        procs += [gw.proc for gw in gateways.values()]
        for n in args.burst or [64]:
            runs: dict[str, dict] = {name: {"bursts": [], "cpu_s": 0.0} for name in gateways}
            for _ in range(args.repeats):
                for name, gw in gateways.items():
                    cpu0 = process_cpu_s(gw.proc.pid)
                    runs[name]["bursts"] += asyncio.run(bursts(gw, n, args.rounds))
                    runs[name]["cpu_s"] += process_cpu_s(gw.proc.pid) - cpu0
            for name, run in runs.items():
                r = results.setdefault(name, {})[str(n)] = {
                    "median_ms": 1e3 * statistics.median(b[0] for b in run["bursts"]),
                    "max_ms": 1e3 * statistics.median(b[1] for b in run["bursts"]),
                    # every burst plus each repeat's warm-up round
                    "cpu_ms_per_request": 1e3
                    * run["cpu_s"]
                    / (n * (args.rounds + 1) * args.repeats),
                    "bursts_ms": [[round(1e3 * a, 1), round(1e3 * b, 1)] for a, b in run["bursts"]],
                }
                print(
                    f"{name:9} burst {n:4}: median {r['median_ms']:7.1f} ms, slowest "
                    f"{r['max_ms']:7.1f} ms, cpu {r['cpu_ms_per_request']:.2f} ms/request",
                    flush=True,
                )
    finally:
        go.stop_processes(procs, 20)
        redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    config = {
        "prompt_chars": args.prompt_chars,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        "gateway": "bare (auth off), fast fake decode, completions, max_tokens=4, non-streamed",
    }
    print("wrote", write_result("gateway_burst", config, results, args.out_dir))


if __name__ == "__main__":
    main()
