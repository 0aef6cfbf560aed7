"""Registry and index in a real Redis, through the real pieces: an engine-thread event source
(`KVEventSource` over a real `KVCacheManager`), the services' `RedisPublisher`, and the gateway's
`RedisRegistry` + `RedisBlockIndex`. Heartbeats are fast (0.1 s, TTL 0.3 s)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import redis
import redis.asyncio

from engine.engine_core import EngineStats
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventSource
from engine.record_auth import RecordAuth
from engine.registry import InstanceRecord, RedisPublisher, blocks_key, instance_key, new_epoch
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.index import IndexTarget
from gateway.redis_index import RedisBlockIndex
from gateway.redis_registry import RedisRegistry
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

BS = 4
HEARTBEAT_S = 0.1
PROMPT = list(range(50, 71))  # 21 tokens: 5 blocks can hit


class FakeEngine:
    """The engine thread's part: owns a real KV cache manager, runs commands, polls the hook."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(num_blocks=64, block_size=BS)
        self.scheduler = SimpleNamespace(requests={}, num_steps=0, num_prompt_tokens_computed=0)
        self.source = KVEventSource(self, measure_prefill="", interval_s=0.01)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(0, 0, kv.usage(), kv.num_free_blocks, 0, 0, 0)

    def has_unfinished_requests(self) -> bool:
        return False

    def compute(self, prompt: list[int]) -> None:
        """Prefill `prompt` into the cache and free it (its blocks stay cached)."""
        done = threading.Event()

        def run() -> None:
            req = Request(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1))
            self.kv.allocate_slots(req, len(prompt))
            req.num_computed_tokens = len(prompt)
            self.kv.cache_blocks(req)
            self.kv.free(req)
            done.set()

        self._cmds.put(run)
        assert done.wait(5)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            while not self._cmds.empty():
                self._cmds.get()()
            self.source.poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def publisher(url: str, engine: FakeEngine, instance_id: str, role: str = "decode"):
    address = f"127.0.0.1:{7000 + len(instance_id)}"
    record = InstanceRecord(instance_id, role, address, "m", BS, new_epoch(), 4096)
    pub = RedisPublisher(url, engine.source, record, heartbeat_s=HEARTBEAT_S)
    pub.start()
    assert pub.wait_registered(5)
    return pub


def crash(pub: RedisPublisher) -> None:
    """Stop heartbeating without deregistering, as a killed process would."""
    pub._stop.set()
    pub._thread.join()
    pub.source.unsubscribe(pub._sub)


async def eventually(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.stop()


def test_register_publish_expire_restart(redis_server, engine):  # noqa: F811
    url = redis_server.url
    pub = publisher(url, engine, "d1")
    engine.compute(PROMPT)

    async def run():
        registry = RedisRegistry(redis.asyncio.Redis.from_url(url), refresh_s=0.05)
        index = RedisBlockIndex(redis.asyncio.Redis.from_url(url))
        await registry.start()

        async def lookup():
            (d,) = registry.decodes()
            s = registry.status(d)
            return await index.lookup(PROMPT, None, [IndexTarget(d.instance_id, s.epoch, BS)])

        (d,) = registry.decodes()
        assert registry.prefills() == () and d.epoch == pub.record.epoch
        status = registry.status(d)
        assert (status.block_size, status.kv_bytes_per_block) == (BS, 4096)
        assert status.num_free_blocks > 0
        assert await eventually(lookup) == {"d1": 5}

        # A second instance joins: the pool grows without restarting anything.
        pub2 = publisher(url, engine, "p1", role="prefill")
        await eventually(lambda: _async(len(registry.prefills()) == 1))

        # d1 dies without a word: gone from the pool within the TTL (+ a refresh).
        crash(pub)
        t0 = time.monotonic()
        await eventually(lambda: _async(registry.decodes() == ()), timeout_s=2)
        assert time.monotonic() - t0 < 3 * HEARTBEAT_S + 0.7  # TTL + refresh + slack
        r = redis.Redis.from_url(url)
        ttl_ms = r.pttl(blocks_key("d1", pub.record.epoch))
        assert ttl_ms == -2 or 0 <= ttl_ms <= 300  # its blocks expire with it (-2: gone)

        # It restarts with the same id: a new epoch, the old epoch's blocks deleted at once.
        r.sadd(blocks_key("d1", pub.record.epoch), b"x")  # (as if still there)
        pub3 = publisher(url, engine, "d1")
        assert pub3.record.epoch != pub.record.epoch
        await eventually(lambda: _async(registry.decodes() != ()))
        assert registry.decodes()[0].epoch == pub3.record.epoch
        assert not r.exists(blocks_key("d1", pub.record.epoch))
        assert await eventually(lookup) == {"d1": 5}  # its reset re-published the cache

        # A clean stop leaves at once (no TTL wait).
        pub2.stop()
        assert not r.exists(instance_key("p1"))
        await eventually(lambda: _async(registry.prefills() == ()), timeout_s=0.5)
        pub3.stop()
        await registry.close()
        await index.close()

    asyncio.run(run())


def test_redis_restart_heals_from_republished_state(redis_server, engine):  # noqa: F811
    url = redis_server.url
    pub = publisher(url, engine, "d1")
    engine.compute(PROMPT)
    key = blocks_key("d1", pub.record.epoch)
    r = redis.Redis.from_url(url)
    _wait(lambda: r.scard(key) == 5)

    redis_server.kill()
    engine.compute(PROMPT[:9] + [1, 2, 3, 4, 5, 6, 7, 8])  # changes while Redis is down
    _wait(lambda: not pub._registered.is_set())  # the publisher noticed the outage
    redis_server.start()  # empty, as a restarted Redis without persistence
    r = redis.Redis.from_url(url)
    _wait(lambda: r.exists(instance_key("d1")) and r.scard(key) == len(engine.kv.pool.cached))
    member = RecordAuth.from_env().block_member  # sets hold keyed digests of the hashes
    assert set(r.smembers(key)) == {member(h) for h in engine.kv.pool.cached}
    pub.stop()


def _wait(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


async def _async(value):
    return value
