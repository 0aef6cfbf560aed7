"""Quota backends: one contract, checked against the in-memory backend and a real Redis.

The sliding-window behaviour over time is checked on the memory backend with a fake clock (the
Redis scripts use Redis's own clock); everything else runs against both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from gateway.auth import TenantLimits
from gateway.quota import MemoryQuota, QuotaBackend
from gateway.quota_redis import Record, RedisQuota
from tests.redis_server import redis_server  # noqa: F401  (fixture)

LEASE_S = 30.0


@pytest.fixture(params=["memory", "redis"])
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def make_backend(backend_kind, request) -> Iterator:
    """`make_backend()` → a backend; for Redis each call is a new client (another gateway)."""
    if backend_kind == "memory":
        memory = MemoryQuota(LEASE_S)
        yield lambda: memory
        return
    server = request.getfixturevalue("redis_server")
    yield lambda: RedisQuota(aioredis.Redis.from_url(server.url), LEASE_S)


def run(coro):
    return asyncio.run(coro)


def test_requests_per_min(make_backend):
    async def scenario():
        q: QuotaBackend = make_backend()
        limits = TenantLimits(requests_per_min=3)
        for i in range(3):
            assert (await q.acquire("k", f"r{i}", limits, 10)).is_admitted
        refused = await q.acquire("k", "r3", limits, 10)
        assert not refused.is_admitted and refused.reason == "requests_per_min"
        assert 58 < refused.retry_after_s <= 60 and refused.retry_after_header_s <= 60
        # Another key has its own window.
        assert (await q.acquire("other", "r4", limits, 10)).is_admitted

    run(scenario())


def test_tokens_are_reserved_then_settled(make_backend):
    async def scenario():
        q = make_backend()
        limits = TenantLimits(tokens_per_min=100)
        assert (await q.acquire("k", "a", limits, 60)).is_admitted
        refused = await q.acquire("k", "b", limits, 60)
        assert not refused.is_admitted and refused.reason == "tokens_per_min"
        assert 58 < refused.retry_after_s <= 60
        await q.settle("k", "a", 10)  # used 10 of its 60
        assert (await q.acquire("k", "b", limits, 60)).is_admitted  # 70 of 100
        assert not (await q.acquire("k", "c", limits, 31)).is_admitted
        assert (await q.acquire("k", "c", limits, 30)).is_admitted  # exactly 100
        await q.settle("k", "unknown", 5)  # no-op

    run(scenario())


def test_concurrency_slots(make_backend):
    async def scenario():
        q = make_backend()
        limits = TenantLimits(max_concurrent=2)
        assert (await q.acquire("k", "a", limits, 1)).is_admitted
        assert (await q.acquire("k", "b", limits, 1)).is_admitted
        refused = await q.acquire("k", "c", limits, 1)
        assert not refused.is_admitted and refused.reason == "max_concurrent"
        assert refused.retry_after_header_s == 1
        await q.renew([("k", "a"), ("k", "b")])
        await q.settle("k", "a", 1)
        await q.settle("k", "a", 1)  # settling twice frees one slot only
        assert (await q.acquire("k", "c", limits, 1)).is_admitted
        assert not (await q.acquire("k", "d", limits, 1)).is_admitted

    run(scenario())


def test_admission_is_atomic_across_gateways(make_backend):
    """50 racing requests from 5 clients (5 gateways for Redis) against 10/min: exactly 10."""

    async def scenario():
        backends = [make_backend() for _ in range(5)]
        limits = TenantLimits(requests_per_min=10, tokens_per_min=1000, max_concurrent=20)
        decisions = await asyncio.gather(
            *(backends[i % 5].acquire("k", f"r{i}", limits, 50) for i in range(50))
        )
        return decisions

    decisions = run(scenario())
    assert sum(d.is_admitted for d in decisions) == 10


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_window_slides_and_retry_after_is_exact():
    clock = FakeClock()
    q = MemoryQuota(LEASE_S, clock=clock)
    limits = TenantLimits(requests_per_min=2, tokens_per_min=100)
    assert q.acquire_now("k", "a", limits, 50).is_admitted
    clock.now_s += 20
    assert q.acquire_now("k", "b", limits, 30).is_admitted
    clock.now_s += 10
    refused = q.acquire_now("k", "c", limits, 10)
    assert refused.reason == "requests_per_min" and refused.retry_after_s == pytest.approx(30)
    clock.now_s += 30  # "a" leaves the window
    assert q.usage("k") == (1, 30, 0)
    # 30 used + 90 needed: 20 over, freed when "b" (30 tokens) leaves, 20 s from now.
    refused = q.acquire_now("k", "c", limits, 90)
    assert refused.reason == "tokens_per_min" and refused.retry_after_s == pytest.approx(20)
    assert q.acquire_now("k", "c", limits, 70).is_admitted
    clock.now_s += 61
    assert q.usage("k") == (0, 0, 0)


def test_slot_leases_expire_unless_renewed():
    clock = FakeClock()
    q = MemoryQuota(LEASE_S, clock=clock)
    limits = TenantLimits(max_concurrent=1)
    assert q.acquire_now("k", "a", limits, 1).is_admitted
    clock.now_s += LEASE_S - 1
    run(q.renew([("k", "a")]))
    clock.now_s += LEASE_S - 1
    assert not q.acquire_now("k", "b", limits, 1).is_admitted  # renewed: still held
    clock.now_s += 2  # a crashed holder: the lease runs out
    assert q.acquire_now("k", "b", limits, 1).is_admitted


def test_acquire_is_idempotent_per_request(make_backend):
    """A repeated (retried, or late) acquire of a recorded request records nothing more."""

    async def scenario():
        q = make_backend()
        limits = TenantLimits(tokens_per_min=100, max_concurrent=2)
        assert (await q.acquire("k", "a", limits, 60)).is_admitted
        assert (await q.acquire("k", "a", limits, 60)).is_admitted  # not 120 tokens, 2 slots
        assert (await q.acquire("k", "b", limits, 40)).is_admitted  # 100 of 100, 2 slots
        refused = await q.acquire("k", "c", limits, 1)
        assert not refused.is_admitted and refused.reason == "max_concurrent"
        await q.settle("k", "b", 40)
        refused = await q.acquire("k", "c", limits, 1)
        assert not refused.is_admitted and refused.reason == "tokens_per_min"

    run(scenario())


def test_memory_adopts_requests_admitted_elsewhere():
    q = MemoryQuota(LEASE_S, clock=FakeClock())
    limits = TenantLimits(requests_per_min=3, max_concurrent=2)
    q.adopt_now("k", "a", 10, has_slot=True)  # no limit is checked: it is running already
    q.adopt_now("k", "a", 10, has_slot=True)  # idempotent
    assert q.usage("k") == (1, 10, 1)
    assert q.acquire_now("k", "b", limits, 1).is_admitted
    assert q.acquire_now("k", "c", limits, 1).reason == "max_concurrent"
    q.settle_now("k", "a", 4)
    assert q.usage("k") == (2, 5, 1)


def _redis_usage(server, quota_id: str = "k") -> tuple[int, int, int]:
    """(requests, tokens, slots) in Redis for `quota_id`."""
    r = redis.Redis.from_url(server.url)
    prefix = f"tandem:quota:{{{quota_id}}}"
    return r.zcard(f"{prefix}:log"), int(r.get(f"{prefix}:sum") or 0), r.zcard(f"{prefix}:slots")


def test_redis_records_adopt_settle_forget_and_tombstones(redis_server):  # noqa: F811
    """The hand-back's records: adopt (no limit check, idempotent), settle and forget; after a
    tombstoned release, a late acquire or adopt of the same request records nothing."""

    async def scenario():
        q = RedisQuota(aioredis.Redis.from_url(redis_server.url), LEASE_S)
        limits = TenantLimits(max_concurrent=1)
        await q.apply([Record("adopt", "k", "a", 10, has_slot=True)] * 2)
        await q.apply([Record("adopt", "k", "b", 5, has_slot=True)])  # over the limit: kept
        assert _redis_usage(redis_server) == (2, 15, 2)
        assert not (await q.acquire("k", "c", limits, 1)).is_admitted
        await q.apply([Record("settle", "k", "a", 3), Record("forget", "k", "b", tombstone=True)])
        assert _redis_usage(redis_server) == (1, 3, 0)
        # Calls for "b" that the client gave up on, running late: nothing is recorded.
        await q.apply([Record("adopt", "k", "b", 5, has_slot=True)])
        with pytest.raises(RuntimeError, match="already released"):
            await q.acquire("k", "b", limits, 5)
        assert _redis_usage(redis_server) == (1, 3, 0)
        assert (await q.acquire("k", "c", limits, 1)).is_admitted

    run(scenario())
