"""Routing cost per request: score all instances for an 8,192-token prompt against Redis.

`python -m bench.index_lookup [--redis-url URL]` (default: starts a throwaway redis-server on a
free loopback port). Registers 8 instances (4 prefill, 4 decode) the way services do (records
and block sets, each set padded with unrelated hashes to `--blocks-per-instance`), then times,
on one event loop like the gateway's:

- `hash`: the gateway's block hashes of the prompt (`gateway.index.lookup_hashes`, equal to
  engine/block_hash.py's), no I/O;
- `lookup`: hashes + the one-round-trip Lua lookup (`RedisBlockIndex.lookup`);
- `plan`: the whole `KVRouter.plan` (registry snapshot, lookup, cost model, routes).

Two cache layouts: `mixed` (instance k holds the first k/8 of the prompt) and `all_hit` (every
instance holds all of it: the script walks 8 x 512 memberships, the worst case).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict

import redis
import redis.asyncio

from bench.common import ensure_internal_token, print_table, write_result
from engine.block_hash import hash_block_tokens
from engine.block_pool import KVCacheEvent
from engine.kv_events import EventBatch, LoadSnapshot
from engine.record_auth import RecordAuth
from engine.registry import (
    INSTANCES_KEY,
    InstanceRecord,
    apply_batch,
    blocks_key,
    instance_key,
)
from gateway.index import IndexTarget, lookup_hashes
from gateway.kv_router import KVRouter
from gateway.redis_index import RedisBlockIndex
from gateway.redis_registry import RedisRegistry

ensure_internal_token()  # records are sealed and block sets keyed with the internal secret
BLOCK_SIZE = 16
NUM_INSTANCES = 8
LOAD = LoadSnapshot(1, 4, 1000, 0.3, 256, 8000.0, 0, 0)


def start_redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = shutil.which("redis-server")
    assert binary, "redis-server not found (or pass --redis-url)"
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.01)
    raise RuntimeError("redis-server did not start")


def register(url: str, prompt: list[int], layout: str, blocks_per_instance: int) -> None:
    """Write 8 records and block sets as `engine/registry.py` publishers would."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    auth = RecordAuth.from_env()
    chain = hash_block_tokens(prompt, BLOCK_SIZE)
    rng = random.Random(0)
    for k in range(NUM_INSTANCES):
        role = "prefill" if k % 2 == 0 else "decode"
        record = InstanceRecord(
            f"{role}-{k}", role, f"127.0.0.1:{7000 + k}", "m", BLOCK_SIZE, f"epoch{k}", 65536,
            8192, load=asdict(LOAD), published_at=time.time() + 3600,
        )  # fmt: skip
        held = chain if layout == "all_hit" else chain[: len(chain) * (k + 1) // NUM_INSTANCES]
        other = [rng.randbytes(32) for _ in range(max(blocks_per_instance - len(held), 0))]
        batch = EventBatch(True, (KVCacheEvent("stored", tuple(held) + tuple(other)),), LOAD)
        pipe = client.pipeline(transaction=True)
        apply_batch(pipe, blocks_key(record.instance_id, record.epoch), batch, 3_600_000)
        pipe.sadd(INSTANCES_KEY, record.instance_id)
        pipe.set(instance_key(record.instance_id), record.seal(auth), px=3_600_000)
        pipe.execute()


def percentiles(samples_s: list[float]) -> dict[str, float]:
    xs = sorted(samples_s)
    pick = lambda q: xs[min(int(q * len(xs)), len(xs) - 1)] * 1e3  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": sum(xs) / len(xs) * 1e3}


async def measure(url: str, prompt: list[int], iterations: int) -> dict[str, dict[str, float]]:
    registry = RedisRegistry(redis.asyncio.Redis.from_url(url), refresh_s=3600)
    await registry.start()
    instances = [*registry.decodes(), *registry.prefills()]
    assert len(instances) == NUM_INSTANCES, instances
    index = RedisBlockIndex(redis.asyncio.Redis.from_url(url))
    router = KVRouter(registry, index)
    targets = [IndexTarget(i.instance_id, i.epoch, BLOCK_SIZE) for i in instances]
    timings: dict[str, list[float]] = {"hash": [], "lookup": [], "plan": []}
    counts = await index.lookup(prompt, None, targets)
    for _ in range(max(iterations // 10, 20)):  # warm-up: connections, script cache
        await router.plan(prompt)
    for _ in range(iterations):
        t0 = time.perf_counter()
        lookup_hashes(prompt, BLOCK_SIZE, None)
        t1 = time.perf_counter()
        await index.lookup(prompt, None, targets)
        t2 = time.perf_counter()
        await router.plan(prompt)
        t3 = time.perf_counter()
        timings["hash"].append(t1 - t0)
        timings["lookup"].append(t2 - t1)
        timings["plan"].append(t3 - t2)
        router.pending = type(router.pending)()  # keep every iteration's load the same
    await registry.close()
    await index.close()
    out = {name: percentiles(xs) for name, xs in timings.items()}
    out["hit_blocks"] = dict(sorted(counts.items()))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser("bench.index_lookup", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--blocks-per-instance", type=int, default=20_000)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    proc, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        rng = random.Random(1)
        prompt = [rng.randrange(100, 150_000) for _ in range(args.prompt_tokens)]
        version = redis.Redis.from_url(url).info()["redis_version"]
        results = {}
        for layout in ("mixed", "all_hit"):
            register(url, prompt, layout, args.blocks_per_instance)
            results[layout] = asyncio.run(measure(url, prompt, args.iterations))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    rows = [
        (layout, step, f"{r[step]['p50_ms']:.3f}", f"{r[step]['p99_ms']:.3f}")
        for layout, r in results.items()
        for step in ("hash", "lookup", "plan")
    ]
    print_table(rows, ("layout", "step", "p50 ms", "p99 ms"))
    config = {
        "prompt_tokens": args.prompt_tokens,
        "block_size": BLOCK_SIZE,
        "num_instances": NUM_INSTANCES,
        "blocks_per_instance": args.blocks_per_instance,
        "iterations": args.iterations,
        "redis": f"redis-server {version} on loopback",
        "target": "plan p99 <= 2 ms",
    }
    path = write_result("index_lookup", config, results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
