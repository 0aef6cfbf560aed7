"""Quota backends: one contract, checked against the in-memory backend and a real Redis.

The sliding-window behaviour over time is checked on the memory backend with a fake clock (the
Redis scripts use Redis's own clock); everything else runs against both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from gateway.auth import TenantLimits
from gateway.quota import MemoryQuota, QuotaBackend
from gateway.quota_redis import RedisQuota
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
