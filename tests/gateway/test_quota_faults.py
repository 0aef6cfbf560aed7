"""Quotas stay exact across Redis faults, against a real `redis-server`.

A hung Redis (SIGSTOP, then SIGCONT) runs the acquires the client gave up on when it resumes;
a restarted Redis comes back empty and leaves the client's pooled connections stale. Through
both, one gateway's `QuotaService` must never have more than `max_concurrent` requests of a key
in flight, and once Redis answers again it must hold exactly the slots of the requests in
flight: no phantom slot from a late acquire, none missing for a request admitted in memory.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.auth import Principal, TenantLimits
from gateway.config import GatewaySettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota_service import QuotaService, Ticket
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

MAX_CONCURRENT = 2
ALPHA = Principal("alpha", TenantLimits(max_concurrent=MAX_CONCURRENT), "q-alpha")


def _service(server: RedisServer, **overrides) -> QuotaService:
    settings = dict(
        model="m",
        redis_url=server.url,
        redis_timeout_s=0.2,
        redis_probe_interval_s=0.05,
        concurrency_lease_s=30.0,  # long: a leaked slot would outlive every test here
    )
    settings.update(overrides)
    return QuotaService(GatewaySettings(**settings), GatewayMetrics("m"))


async def _try_reserve(quota: QuotaService, request_id: str) -> Ticket | None:
    """The ticket, or None for a 429 (any other error fails the test)."""
    try:
        return await quota.reserve(ALPHA, request_id, 1)
    except APIError as e:
        assert e.status_code == 429, e.message
        return None


async def _warm_up(quota: QuotaService, server: RedisServer, timeout_s: float = 30.0) -> None:
    """What a serving gateway has: the scripts loaded in Redis, several pooled connections (so
    acquires during a hang are sent at once and run when Redis resumes). On a loaded machine
    the first calls can outlast the client's timeout and turn the service degraded: this waits
    until Redis, not memory, decides, so that no scenario starts from the wrong backend."""
    assert quota._client is not None
    deadline = time.monotonic() + timeout_s
    for attempt in itertools.count():  # request ids are never reused, so one per attempt
        await _wait_for(lambda: not quota.is_degraded, timeout_s, what="Redis at start")
        try:
            await asyncio.gather(*(quota._client.ping() for _ in range(8)))
            ids = [f"warm-{attempt}-{i}" for i in range(2)]
            warm = await asyncio.gather(*(_try_reserve(quota, request_id) for request_id in ids))
        except RedisError:  # a ping that timed out: not degraded, but not warm either
            warm = []
        for ticket in warm:
            assert ticket is not None
            quota.release(ticket, 1)
        if len(warm) == 2 and not quota.is_degraded:
            break
        assert time.monotonic() < deadline, "Redis never answered within the client's timeout"
    await _wait_for_slots(server, 0)


async def _within(awaitable, what: str, timeout_s: float = 10.0):
    """`awaitable`'s result, failing (not hanging) after `timeout_s`: an event a scenario waits
    on is never set when the service took another path than the one the scenario set up."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def _redis_slots(server: RedisServer) -> int:
    """Concurrency slots of ALPHA that a fresh client sees in Redis."""
    client = aioredis.Redis.from_url(server.url)
    try:
        return await client.zcard("tandem:quota:{q-alpha}:slots")
    finally:
        await client.aclose()


async def _wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate()` until it is true, failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _wait_for_slots(server: RedisServer, num_slots: int, timeout_s: float = 10.0) -> None:
    """Poll Redis until ALPHA holds `num_slots` slots (releases settle in the background)."""
    deadline = time.monotonic() + timeout_s
    while (found := await _redis_slots(server)) != num_slots:
        assert time.monotonic() < deadline, f"Redis holds {found} slots, expected {num_slots}"
        await asyncio.sleep(0.02)


def _stop(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)


def _cont(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGCONT)


def test_acquires_that_timed_out_during_a_hang_leave_no_slot(redis_server):  # noqa: F811
    """The chaos report: SIGSTOP during acquires, SIGCONT; the acquires the client gave up on
    ran late in Redis and held both slots for a lease (429 "2 concurrent", nothing in flight)."""

    async def scenario():
        quota = _service(redis_server)
        await quota.start()
        try:
            await _warm_up(quota, redis_server)
            _stop(redis_server)
            # Both time out on the client (they fall back to memory) but sit in Redis's socket
            # buffers, and run when it resumes.
            hung = await asyncio.gather(
                *(_try_reserve(quota, f"hung-{i}") for i in range(MAX_CONCURRENT))
            )
            assert all(hung) and quota.is_degraded
            for ticket in hung:
                quota.release(ticket, 1)  # nothing in flight any more
            _cont(redis_server)
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            assert quota.backend_name == "redis"
            await _wait_for_slots(redis_server, 0)
            # Nothing in flight: max_concurrent new requests are admitted, and no more.
            fresh = [await _try_reserve(quota, f"fresh-{i}") for i in range(MAX_CONCURRENT)]
            assert all(fresh), "a slot is held by a request that is not in flight"
            assert await _try_reserve(quota, "one-too-many") is None
            await _wait_for_slots(redis_server, MAX_CONCURRENT)
            for ticket in fresh:
                quota.release(ticket, 1)
            await _wait_for_slots(redis_server, 0)
        finally:
            _cont(redis_server)
            await quota.close()

    asyncio.run(scenario())


def test_request_in_flight_through_a_hang_keeps_exactly_its_slot(redis_server):  # noqa: F811
    """An acquire that timed out, was admitted in memory and is still running when Redis
    resumes holds one slot in Redis (the late acquire and the hand-over do not count it twice);
    when it ends, the slot frees."""

    async def scenario():
        quota = _service(redis_server)
        await quota.start()
        try:
            await _warm_up(quota, redis_server)
            _stop(redis_server)
            running = await _try_reserve(quota, "running")
            assert running is not None and quota.is_degraded
            _cont(redis_server)
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            assert await _redis_slots(redis_server) == 1
            other = await _try_reserve(quota, "other")
            assert other is not None
            assert await _try_reserve(quota, "one-too-many") is None
            quota.release(running, 1)
            quota.release(other, 1)
            await _wait_for_slots(redis_server, 0)
            again = [await _try_reserve(quota, f"again-{i}") for i in range(MAX_CONCURRENT)]
            assert all(again)
        finally:
            _cont(redis_server)
            await quota.close()

    asyncio.run(scenario())


def test_restart_with_requests_in_flight_never_over_admits(redis_server):  # noqa: F811
    """Redis killed with two requests in flight, then restarted empty: the requests in flight
    count in memory while it is down, and in Redis once it is back, whatever the stale pooled
    connections do."""

    async def scenario():
        quota = _service(redis_server)
        await quota.start()
        try:
            await _warm_up(quota, redis_server)  # pooled connections: stale once it restarts
            a, b = await _try_reserve(quota, "a"), await _try_reserve(quota, "b")
            assert a is not None and b is not None
            redis_server.kill()
            assert await _try_reserve(quota, "c") is None, "2 in flight: a third was admitted"
            assert quota.is_degraded
            quota.release(a, 1)
            c = await _try_reserve(quota, "c")
            assert c is not None  # b and c in flight
            redis_server.start()  # empty
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            assert await _redis_slots(redis_server) == 2  # b and c, handed over to Redis
            burst = await asyncio.gather(*(_try_reserve(quota, f"burst-{i}") for i in range(6)))
            assert burst == [None] * 6, "admitted over max_concurrent during the switch back"
            quota.release(b, 1)
            quota.release(c, 1)
            await _wait_for_slots(redis_server, 0)
            burst = await asyncio.gather(*(_try_reserve(quota, f"again-{i}") for i in range(6)))
            assert sum(t is not None for t in burst) == MAX_CONCURRENT
        finally:
            await quota.close()

    asyncio.run(scenario())


def test_redis_answer_after_the_switch_is_decided_again_by_memory(redis_server):  # noqa: F811
    """An acquire still out when the service goes degraded: Redis (restarted, empty) admits it,
    but memory is the authority by then and already counts two in flight, so it is refused, and
    the hand-back removes Redis's record of it."""

    async def scenario():
        quota = _service(redis_server)
        await quota.start()
        try:
            await _warm_up(quota, redis_server)
            a = await _try_reserve(quota, "a")
            assert a is not None and quota.redis is not None
            parked, go = asyncio.Event(), asyncio.Event()
            real_acquire = quota.redis.acquire

            async def gated_acquire(quota_id, request_id, limits, num_tokens):
                if request_id == "x":
                    parked.set()
                    await go.wait()
                return await real_acquire(quota_id, request_id, limits, num_tokens)

            quota.redis.acquire = gated_acquire
            x = asyncio.create_task(_try_reserve(quota, "x"))
            await _within(parked.wait(), "x's acquire to reach Redis")
            redis_server.kill()
            b = await _try_reserve(quota, "b")  # memory counts a: one slot left
            assert b is not None and quota.is_degraded
            redis_server.start()  # empty: it would admit x
            go.set()
            assert await _within(x, "x's answer") is None, (
                "admitted by Redis after memory took over: 3 in flight"
            )
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            assert await _redis_slots(redis_server) == 2  # a and b; x's record is gone
            quota.release(a, 1)
            quota.release(b, 1)
            await _wait_for_slots(redis_server, 0)
        finally:
            await quota.close()

    asyncio.run(scenario())


def test_acquire_cancelled_after_redis_ran_it_leaves_no_slot(redis_server):  # noqa: F811
    """The client leaves while its acquire is out, after Redis admitted it: the slot is not
    left to its lease (30 s here), it is forgotten at once."""

    async def scenario():
        quota = _service(redis_server, redis_timeout_s=5.0)  # the acquire must reach Redis
        await quota.start()
        try:
            await _warm_up(quota, redis_server)
            assert quota.redis is not None
            ran, real_acquire = asyncio.Event(), quota.redis.acquire

            async def acquire_then_hang(quota_id, request_id, limits, num_tokens):
                decision = await real_acquire(quota_id, request_id, limits, num_tokens)
                ran.set()
                await asyncio.Event().wait()  # the answer never comes back: cancelled here
                return decision

            quota.redis.acquire = acquire_then_hang
            gone = asyncio.create_task(_try_reserve(quota, "gone"))
            await _within(ran.wait(), "Redis to run the acquire")
            assert await _redis_slots(redis_server) == 1
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await _within(gone, "the cancelled request to end")
            quota.redis.acquire = real_acquire
            await _wait_for_slots(redis_server, 0, timeout_s=5.0)
            fresh = [await _try_reserve(quota, f"fresh-{i}") for i in range(MAX_CONCURRENT)]
            assert all(fresh)
        finally:
            await quota.close()

    asyncio.run(scenario())


class _InFlight:
    """Requests admitted and not yet released; remembers the most ever at once."""

    def __init__(self) -> None:
        self.now = self.peak = self.admitted = 0

    def enter(self) -> None:
        self.now += 1
        self.admitted += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1

    async def wait_for_more(self, num_admitted: int) -> None:
        """Until `num_admitted` more requests have been admitted (traffic keeps flowing)."""
        target = self.admitted + num_admitted
        await _wait_for(lambda: self.admitted >= target, what=f"{target} admissions")


@pytest.mark.parametrize("fault", ["restart", "hang"])
def test_concurrency_limit_holds_under_load_through_faults(redis_server, fault):  # noqa: F811
    """Workers keep requests in flight while Redis is restarted (or hung and resumed) twice:
    at no time are more than max_concurrent admitted, and afterwards Redis holds exactly the
    slots of the requests still in flight (none, once the workers stop)."""

    async def worker(quota: QuotaService, in_flight: _InFlight, name: str, stop: asyncio.Event):
        rng = random.Random(name)
        i = 0
        while not stop.is_set():
            i += 1
            ticket = await _try_reserve(quota, f"{name}-{i}")
            if ticket is None:
                await asyncio.sleep(0.005)  # a client backing off after a 429
                continue
            in_flight.enter()
            try:
                await asyncio.sleep(rng.uniform(0.0, 0.03))  # the request's work
            finally:
                in_flight.leave()
                quota.release(ticket, 1)

    async def fault_cycle(quota: QuotaService, in_flight: _InFlight) -> None:
        for _ in range(2):
            await in_flight.wait_for_more(10)
            if fault == "restart":
                redis_server.kill()
            else:
                _stop(redis_server)
            await _wait_for(lambda: quota.is_degraded, what="degraded")
            await in_flight.wait_for_more(10)
            if fault == "restart":
                redis_server.start()
            else:
                _cont(redis_server)
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            await in_flight.wait_for_more(10)

    async def scenario():
        quota = _service(redis_server)
        await quota.start()
        await _warm_up(quota, redis_server)
        in_flight, stop = _InFlight(), asyncio.Event()
        workers = [asyncio.create_task(worker(quota, in_flight, f"w{i}", stop)) for i in range(6)]
        try:
            await fault_cycle(quota, in_flight)
        finally:
            if fault == "hang":
                _cont(redis_server)
            stop.set()
            await asyncio.gather(*workers)
        try:
            assert in_flight.peak <= MAX_CONCURRENT, f"{in_flight.peak} admitted at once"
            await _wait_for(lambda: not quota.is_degraded, what="Redis back")
            await _wait_for_slots(redis_server, 0)
            fresh = [await _try_reserve(quota, f"fresh-{i}") for i in range(MAX_CONCURRENT)]
            assert all(fresh)
        finally:
            await quota.close()

    asyncio.run(scenario())
