"""The block-location index contract, on both stores: Redis (real redis-server, written the
way services write it) and embedded (written the way `WatchKVEvents` feeds it). Plus: the
gateway's hashes are the engine's, byte for byte."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio

from engine.block_hash import hash_block_tokens
from engine.block_pool import KVCacheEvent
from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import EventBatch, LoadSnapshot
from engine.registry import apply_batch, blocks_key
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.index import EmbeddedIndex, IndexTarget, IndexUnavailable, lookup_hashes
from gateway.redis_index import RedisBlockIndex
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

BS = 4
LOAD = LoadSnapshot(0, 0, 0, 0.0, 0, 0.0, 0, 0)
PROMPT = list(range(10, 27))  # 17 tokens: 4 full blocks, and the last token is never a hit


def _hashes(prompt=PROMPT, salt=None):
    return hash_block_tokens(prompt, BS, salt)


class EmbeddedStore:
    def __init__(self) -> None:
        self.index = EmbeddedIndex()

    def write(self, instance_id, epoch, *events, reset=False):
        self.index.apply(instance_id, epoch, reset, events)

    def lookup(self, targets, prompt=PROMPT, salt=None):
        return asyncio.run(self.index.lookup(prompt, salt, targets))


class RedisStore:
    """Services write with `engine.registry.apply_batch`; the gateway reads with the script."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)

    def write(self, instance_id, epoch, *events, reset=False):
        pipe = self.client.pipeline(transaction=True)
        apply_batch(pipe, blocks_key(instance_id, epoch), EventBatch(reset, events, LOAD), 60_000)
        pipe.execute()

    def lookup(self, targets, prompt=PROMPT, salt=None):
        async def run():
            index = RedisBlockIndex(redis.asyncio.Redis.from_url(self.url))
            try:
                return await index.lookup(prompt, salt, targets)
            finally:
                await index.close()

        return asyncio.run(run())


@pytest.fixture(params=["embedded", "redis"])
def store(request):
    if request.param == "embedded":
        return EmbeddedStore()
    return RedisStore(request.getfixturevalue("redis_server").url)


def stored(hashes) -> KVCacheEvent:
    return KVCacheEvent("stored", tuple(hashes))


def targets(*ids, epoch="e1"):
    return [IndexTarget(i, epoch, BS) for i in ids]


def test_exact_leading_block_counts_per_instance(store):
    h = _hashes()
    store.write("a", "e1", stored(h), reset=True)  # all 4
    store.write("b", "e1", stored(h[:2]), reset=True)  # the first 2
    store.write("c", "e1", stored(h[1:]), reset=True)  # not the first: nothing counts
    store.write("d", "e1", stored(h[:2] + h[3:]), reset=True)  # a hole at block 2
    counts = store.lookup(targets("a", "b", "c", "d", "nobody"))
    assert {k: v for k, v in counts.items() if v} == {"a": 4, "b": 2, "d": 2}


def test_a_block_counts_only_after_the_same_blocks_before_it(store):
    """The instance holds a, y-after-a, x and c-after-x; `a + c + b` holds only a there: its c
    follows a, a different block from the c that follows x."""
    a, c, b, x, y = ([v] * BS for v in (1, 2, 3, 4, 5))
    store.write("i", "e1", stored(_hashes(a + y) + _hashes(x + c)), reset=True)
    assert store.lookup(targets("i"), prompt=a + c + b + [0]) == {"i": 1}
    assert store.lookup(targets("i"), prompt=x + c + b + [0]) == {"i": 2}
    assert store.lookup(targets("i"), prompt=y + c + [0]).get("i", 0) == 0


def test_the_last_token_is_never_a_hit(store):
    h = _hashes()
    store.write("a", "e1", stored(h), reset=True)
    assert store.lookup(targets("a"), prompt=PROMPT[:16]) == {"a": 3}  # 16 tokens: 3 blocks
    assert store.lookup(targets("a"), prompt=PROMPT[:4]).get("a", 0) == 0


def test_removed_and_cleared_events(store):
    h = _hashes()
    store.write("a", "e1", stored(h), reset=True)
    store.write("a", "e1", KVCacheEvent("removed", (h[1],)))
    assert store.lookup(targets("a")) == {"a": 1}
    store.write("a", "e1", KVCacheEvent("cleared"))
    assert store.lookup(targets("a")).get("a", 0) == 0
    store.write("a", "e1", stored(h))
    assert store.lookup(targets("a")) == {"a": 4}


def test_stale_epoch_is_ignored(store):
    h = _hashes()
    store.write("a", "old", stored(h), reset=True)
    # The instance restarted: the registry now names epoch "new", which holds nothing yet.
    assert store.lookup(targets("a", epoch="new")).get("a", 0) == 0
    store.write("a", "new", stored(h[:1]), reset=True)
    assert store.lookup(targets("a", epoch="new")) == {"a": 1}


def test_embedded_drops_events_of_a_previous_epoch():
    store, h = EmbeddedStore(), _hashes()
    store.write("a", "new", stored(h[:1]), reset=True)
    store.write("a", "old", stored(h))  # a late batch from the dead process
    assert store.lookup(targets("a", epoch="new")) == {"a": 1}


def test_salt_separates_tenants(store):
    store.write("a", "e1", stored(_hashes(salt="tenant-1")), reset=True)
    assert store.lookup(targets("a"), salt="tenant-1") == {"a": 4}
    assert store.lookup(targets("a"), salt="tenant-2").get("a", 0) == 0
    assert store.lookup(targets("a")).get("a", 0) == 0


def test_gateway_hashes_equal_the_engines_cached_hashes():
    """What the engine publishes after computing a prompt is what the gateway looks up."""
    prompt = list(range(300, 341))  # 41 tokens: 10 full blocks of 4
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    req = Request("r", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-7")
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    published = [h for e in kv.pool.take_events() if e.kind == "stored" for h in e.block_hashes]
    assert len(published) == 10
    assert lookup_hashes(prompt, BS, "tenant-7") == published  # (41 - 1) // 4 = 10 blocks
    assert lookup_hashes(prompt, BS, None) != published
    # A hit on these blocks is exactly what the engine's own lookup finds.
    again = Request("r2", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-7")
    assert kv.get_computed_blocks(again)[1] == 10 * BS


def test_redis_down_fails_fast_then_recovers(redis_server):  # noqa: F811
    store = RedisStore(redis_server.url)
    store.write("a", "e1", stored(_hashes()), reset=True)

    async def run():
        client = redis.asyncio.Redis.from_url(
            redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        index = RedisBlockIndex(client, retry_s=0.3)
        assert await index.lookup(PROMPT, None, targets("a")) == {"a": 4}
        redis_server.kill()
        with pytest.raises(IndexUnavailable):
            await index.lookup(PROMPT, None, targets("a"))
        assert not index.is_available
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(IndexUnavailable):  # in back-off: no I/O at all
            await index.lookup(PROMPT, None, targets("a"))
        assert loop.time() - t0 < 0.05
        redis_server.start()  # back, empty (the services re-publish; see test_registry_redis)
        RedisStore(redis_server.url).write("a", "e1", stored(_hashes()), reset=True)
        deadline = loop.time() + 5
        while not index.is_available:  # the back-off window ends (retry_s)
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        assert await index.lookup(PROMPT, None, targets("a")) == {"a": 4}  # script reloaded
        await index.close()

    asyncio.run(run())
