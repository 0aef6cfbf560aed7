"""Admission against per-key quotas, with Redis when it answers and memory when it does not.

Lifecycle of one request's quota:
  `reserve` → backend.acquire (429 + Retry-After when refused) → a `Ticket`
  ... the request runs; every `renew_interval` the slots of running tickets are renewed ...
  `release(ticket, actual_tokens)` exactly once, on every exit path (success, error, client
  disconnect): synchronous, so it can run in a `finally` even while cancelled; the backend
  call runs in the background.

Degraded mode: a Redis error (refused, timeout) flips the service to its `MemoryQuota` (same
semantics, per gateway), sets `tandem:degraded` and starts a probe that pings Redis every
`redis_probe_interval_s`; the first answer flips it back. A ticket settles on the backend that
issued it. Slots held in Redis by a request that settles while Redis is down expire by lease.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.auth import Principal
from gateway.config import GatewaySettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota import MemoryQuota, QuotaBackend
from gateway.quota_redis import RedisQuota

logger = logging.getLogger(__name__)
_REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError)
_MAX_REDIS_CONNECTIONS = 64
_LIMIT_NAMES = {
    "requests_per_min": "requests per minute",
    "tokens_per_min": "tokens per minute",
    "max_concurrent": "concurrent requests",
}


@dataclass
class Ticket:
    quota_id: str
    request_id: str
    num_tokens: int  # reserved
    backend: QuotaBackend | None  # None: nothing was recorded (no window limits)
    is_released: bool = False


class QuotaService:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics):
        self.settings, self.metrics = settings, metrics
        self.memory = MemoryQuota(settings.concurrency_lease_s)
        self.redis: RedisQuota | None = None
        self._client: aioredis.Redis | None = None
        self.is_degraded = False
        self._running: dict[str, Ticket] = {}
        self._tasks: set[asyncio.Task] = set()
        self._probe: asyncio.Task | None = None

    @property
    def backend_name(self) -> str:
        return self._backend().name

    def _backend(self) -> QuotaBackend:
        return self.redis if self.redis is not None and not self.is_degraded else self.memory

    async def start(self) -> None:
        """On the serving loop (the Redis client binds to it). Redis down at start: degraded."""
        if self.settings.redis_url:
            timeout_s = self.settings.redis_timeout_s
            # A blocking pool: under a burst, requests wait (up to the timeout) for a connection
            # instead of failing at the pool's cap (redis-py's default pool raises at 100).
            pool = aioredis.BlockingConnectionPool.from_url(
                self.settings.redis_url,
                max_connections=_MAX_REDIS_CONNECTIONS,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # fail fast: falling back beats waiting
            )
            self._client = aioredis.Redis.from_pool(pool)  # owns (and closes) the pool
            self.redis = RedisQuota(self._client, self.settings.concurrency_lease_s)
            try:
                await self._client.ping()
            except _REDIS_DOWN as e:
                self._enter_degraded(e)
        self._spawn(self._renew_loop())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def reserve(self, principal: Principal, request_id: str, num_tokens: int) -> Ticket:
        """Admit (→ Ticket) or raise the 429. Requests too big to ever fit are 400s."""
        limits = principal.limits
        if not limits.has_window_limits:
            return Ticket(principal.quota_id, request_id, num_tokens, None)
        if limits.tokens_per_min and num_tokens > limits.tokens_per_min:
            self.metrics.quota_rejections.labels(principal.tenant, "tokens_per_min").inc()
            raise APIError(
                f"Request too large: it may use up to {num_tokens} tokens (prompt + max_tokens "
                f"for every sample); this key's limit is {limits.tokens_per_min} tokens per "
                "minute. Lower max_tokens or n.",
                400,
                param="max_tokens",
            )
        backend = self._backend()
        try:
            decision = await backend.acquire(principal.quota_id, request_id, limits, num_tokens)
        except _REDIS_DOWN as e:
            self._enter_degraded(e)
            backend = self.memory
            decision = self.memory.acquire_now(principal.quota_id, request_id, limits, num_tokens)
        if not decision.is_admitted:
            self.metrics.quota_rejections.labels(principal.tenant, decision.reason).inc()
            limit = getattr(limits, decision.reason)
            raise APIError(
                f"Rate limit reached: {limit} {_LIMIT_NAMES[decision.reason]} for this key. "
                f"Please try again in {decision.retry_after_header_s}s.",
                429,
                retry_after_s=decision.retry_after_header_s,
            )
        ticket = Ticket(principal.quota_id, request_id, num_tokens, backend)
        if limits.max_concurrent:
            self._running[request_id] = ticket
        return ticket

    def release(self, ticket: Ticket, actual_tokens: int) -> None:
        """Settle the ticket (once): actual tokens replace the reservation; the slot frees."""
        if ticket.is_released:
            return
        ticket.is_released = True
        self._running.pop(ticket.request_id, None)
        if ticket.backend is None:
            return
        if isinstance(ticket.backend, MemoryQuota):  # synchronous: no task needed
            ticket.backend.settle_now(ticket.quota_id, ticket.request_id, actual_tokens)
            return
        self._spawn(self._settle_remote(ticket, actual_tokens))

    async def _settle_remote(self, ticket: Ticket, actual_tokens: int) -> None:
        assert ticket.backend is not None
        try:
            await ticket.backend.settle(ticket.quota_id, ticket.request_id, actual_tokens)
        except _REDIS_DOWN as e:
            self._enter_degraded(e)  # the slot expires with its lease

    def _enter_degraded(self, error: BaseException) -> None:
        if not self.is_degraded:
            logger.warning(
                "Redis unreachable (%s): quotas fall back to this gateway's memory (degraded)",
                type(error).__name__,
            )
            self.is_degraded = True
            self.metrics.degraded.set(1)
        if self._probe is None or self._probe.done():
            self._probe = self._spawn(self._probe_loop())

    async def _probe_loop(self) -> None:
        assert self._client is not None
        while self.is_degraded:
            await asyncio.sleep(self.settings.redis_probe_interval_s)
            try:
                await self._client.ping()
            except _REDIS_DOWN:
                continue
            logger.warning("Redis is back: quotas are shared again (no longer degraded)")
            self.is_degraded = False
            self.metrics.degraded.set(0)

    async def _renew_loop(self) -> None:
        """Keep the slots of long requests alive (their lease would otherwise expire)."""
        interval_s = self.settings.concurrency_lease_s / 3
        while True:
            await asyncio.sleep(interval_s)
            by_backend: dict[int, tuple[QuotaBackend, list[tuple[str, str]]]] = {}
            for t in self._running.values():
                if t.backend is not None:
                    entry = by_backend.setdefault(id(t.backend), (t.backend, []))
                    entry[1].append((t.quota_id, t.request_id))
            for backend, slots in by_backend.values():
                try:
                    await backend.renew(slots)
                except _REDIS_DOWN as e:
                    self._enter_degraded(e)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
