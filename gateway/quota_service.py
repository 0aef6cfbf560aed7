"""Admission against per-key quotas, with Redis when it answers and memory when it does not.

Lifecycle of one request's quota:
  `reserve` → backend.acquire (429 + Retry-After when refused) → a `Ticket`
  ... the request runs; every `renew_interval` the slots of running tickets are renewed ...
  `release(ticket, actual_tokens)` exactly once, on every exit path (success, error, client
  disconnect): synchronous, so it can run in a `finally` even while cancelled; the backend
  call runs in the background.

Degraded mode: a Redis error (refused, timeout) flips the service to its `MemoryQuota` (same
semantics, per gateway), sets `tandem:degraded` and starts a probe that pings Redis every
`redis_probe_interval_s`. Exactly one backend is the authority at a time, and this gateway's
requests in flight are counted by it, whichever backend admitted them:
  * Redis → memory: every running ticket is adopted by memory (`MemoryQuota.adopt_now`) in the
    same synchronous step that flips the mode, so memory admits only what is left of the limit.
    A Redis answer that arrives after the flip is stale: it is discarded (its record is undone
    later) and the request is decided again by memory.
  * memory → Redis (the hand-back, once the probe is answered and no Redis acquire from before
    the switch is still out): every ticket whose Redis record may be wrong ("unsynced") is
    written to Redis: running ones adopted (slot + entry, no limit check), finished ones
    settled (Redis had admitted them) or forgotten (memory had), acquires the client gave up on
    forgotten. New reservations wait for the hand-back (one or two round trips), so the set
    only shrinks; when it is empty, the running tickets move to Redis in one synchronous step.
    Then Redis holds exactly this gateway's running requests. A failed hand-back leaves the
    service degraded; the next probe tries again (every step is idempotent).
  * an acquire (or adopt) that timed out on the client may still run when a hung Redis resumes.
    Its request is unsynced, so the hand-back forgets (or settles) it, with a tombstone that
    makes the late call record nothing if it runs after that (`gateway.quota_redis`).
While degraded each gateway enforces the limits alone (as it did before Redis was shared).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.auth import Principal, TenantLimits
from gateway.config import GatewaySettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.quota import Decision, MemoryQuota, QuotaBackend
from gateway.quota_redis import Record, RedisQuota

logger = logging.getLogger(__name__)
_REDIS_DOWN = (RedisError, OSError, asyncio.TimeoutError)
_MAX_REDIS_CONNECTIONS = 64
# A settlement waits up to this long to share the next admission's round trip to Redis (one
# round trip per request under load instead of two). Another gateway may see the slot and the
# unused tokens come back that much later; this gateway's next admission never does (it carries
# the settlements ahead of itself).
SETTLE_WITHIN_S = 0.02
_LIMIT_NAMES = {
    "requests_per_min": "requests per minute",
    "tokens_per_min": "tokens per minute",
    "max_concurrent": "concurrent requests",
}


@dataclass(eq=False)
class Ticket:
    quota_id: str
    request_id: str
    num_tokens: int  # reserved
    backend: QuotaBackend | None  # None: nothing recorded (no window limits, or not admitted)
    has_slot: bool = False  # holds a concurrency slot (the key has max_concurrent)
    is_released: bool = False  # released, or never admitted
    actual_tokens: int = 0  # set by `release`
    is_in_redis_window: bool = False  # Redis counts it as admitted: settle it there, not forget
    may_be_in_redis: bool = False  # Redis may hold a record of it (to undo or settle)
    may_run_late: bool = False  # a Redis call for it failed: it may still run there


class QuotaService:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics):
        self.settings, self.metrics = settings, metrics
        self.memory = MemoryQuota(settings.concurrency_lease_s)
        self.redis: RedisQuota | None = None
        self._client: aioredis.Redis | None = None
        self.is_degraded = False
        self._running: dict[str, Ticket] = {}  # admitted, recorded, not released
        self._unsynced: dict[str, Ticket] = {}  # Redis's record may be wrong: fix on hand-back
        self._num_redis_acquires = 0  # Redis acquires awaiting their answer
        self._hand_back: asyncio.Event | None = None  # set while a hand-back runs
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
                # One retry on a fresh connection when a pooled one is dead (a restarted Redis),
                # safe since every script is idempotent; none after a timeout: falling back
                # beats waiting.
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
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
        if self.redis is not None:
            await self.redis.close()
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
        while self._hand_back is not None:  # the hand-back must see every running ticket
            await self._hand_back.wait()
        ticket = Ticket(
            principal.quota_id, request_id, num_tokens, None, has_slot=bool(limits.max_concurrent)
        )
        decision = None
        if self.redis is not None and not self.is_degraded:
            decision = await self._acquire_in_redis(ticket, limits)
        if decision is not None:
            ticket.backend = self.redis
            ticket.is_in_redis_window = ticket.may_be_in_redis = decision.is_admitted
        else:
            decision = self.memory.acquire_now(ticket.quota_id, request_id, limits, num_tokens)
            ticket.backend = self.memory
        if not decision.is_admitted:
            ticket.backend, ticket.is_released = None, True
            self.metrics.quota_rejections.labels(principal.tenant, decision.reason).inc()
            limit = getattr(limits, decision.reason)
            raise APIError(
                f"Rate limit reached: {limit} {_LIMIT_NAMES[decision.reason]} for this key. "
                f"Please try again in {decision.retry_after_header_s}s.",
                429,
                retry_after_s=decision.retry_after_header_s,
            )
        self._running[request_id] = ticket
        if ticket.backend is self.memory and self.redis is not None:
            self._unsynced[request_id] = ticket  # to be adopted by Redis on hand-back
        return ticket

    async def _acquire_in_redis(self, ticket: Ticket, limits: TenantLimits) -> Decision | None:
        """Redis's decision, or None when memory must decide: Redis failed, or the service went
        degraded while the call was out (memory, the authority now, never saw this request)."""
        assert self.redis is not None
        self._num_redis_acquires += 1
        try:
            decision = await self.redis.acquire(
                ticket.quota_id, ticket.request_id, limits, ticket.num_tokens
            )
        except _REDIS_DOWN as e:
            # Sent, maybe: it may still run when Redis resumes. Forgotten there unless it runs.
            ticket.may_be_in_redis = ticket.may_run_late = True
            self._unsynced[ticket.request_id] = ticket
            self._enter_degraded(e)
            return None
        except asyncio.CancelledError:  # the client left; Redis may have admitted it, or may yet
            ticket.may_be_in_redis = ticket.may_run_late = ticket.is_released = True
            self._spawn(self._settle_remote(ticket))  # forget it there, tombstoned
            raise
        finally:
            self._num_redis_acquires -= 1
        if self.is_degraded:  # stale: undo Redis's record on hand-back (unless it runs)
            if decision.is_admitted:
                ticket.may_be_in_redis = True
                self._unsynced[ticket.request_id] = ticket
            return None
        return decision

    def release(self, ticket: Ticket, actual_tokens: int) -> None:
        """Settle the ticket (once): actual tokens replace the reservation; the slot frees."""
        if ticket.is_released:
            return
        ticket.is_released, ticket.actual_tokens = True, actual_tokens
        self._running.pop(ticket.request_id, None)
        if ticket.backend is None:
            return
        if isinstance(ticket.backend, MemoryQuota):  # synchronous: no task needed
            ticket.backend.settle_now(ticket.quota_id, ticket.request_id, actual_tokens)
            if ticket.may_be_in_redis:
                self._unsynced[ticket.request_id] = ticket  # its Redis record is settled or goes
            else:
                self._unsynced.pop(ticket.request_id, None)  # nothing to adopt any more
            return
        self._spawn(self._settle_remote(ticket))

    async def _settle_remote(self, ticket: Ticket) -> None:
        """The released ticket's final record in Redis; on failure, again at the hand-back."""
        assert self.redis is not None
        try:
            await self.redis.apply([_final_record(ticket)], SETTLE_WITHIN_S)
        except _REDIS_DOWN as e:
            ticket.may_run_late = True
            self._unsynced[ticket.request_id] = ticket  # settled again on hand-back
            self._enter_degraded(e)

    def _enter_degraded(self, error: BaseException) -> None:
        if not self.is_degraded:
            logger.warning(
                "Redis unreachable (%s): quotas fall back to this gateway's memory (degraded)",
                type(error).__name__,
            )
            self.is_degraded = True
            self.metrics.degraded.set(1)
            for t in self._running.values():  # memory counts what Redis admitted and runs
                if t.backend is self.redis:
                    self.memory.adopt_now(t.quota_id, t.request_id, t.num_tokens, t.has_slot)
                    t.backend = self.memory
                    self._unsynced[t.request_id] = t
        if self._probe is None or self._probe.done():
            self._probe = self._spawn(self._probe_loop())

    async def _probe_loop(self) -> None:
        assert self._client is not None
        while self.is_degraded:
            await asyncio.sleep(self.settings.redis_probe_interval_s)
            if self._num_redis_acquires:
                continue  # answers from before the switch are still to come (or time out)
            try:
                await self._client.ping()
            except _REDIS_DOWN:
                continue
            self._hand_back = asyncio.Event()
            try:
                await self._sync_unsynced()
            except _REDIS_DOWN as e:
                logger.warning("Redis answered but the quota hand-back failed (%s)", e)
                continue
            finally:
                self._hand_back.set()
                self._hand_back = None
            self._leave_degraded()

    async def _sync_unsynced(self) -> None:
        """Write every unsynced ticket's truth to Redis, until none is left."""
        assert self.redis is not None
        while self._unsynced:
            batch = [(t, t.is_released) for t in self._unsynced.values()]
            for t, was_released in batch:
                t.may_be_in_redis = t.may_be_in_redis or not was_released  # adopted (maybe)
            try:
                await self.redis.apply(
                    [_final_record(t) if done else _adopt(t) for t, done in batch]
                )
            except _REDIS_DOWN:
                for t, _ in batch:
                    t.may_run_late = True
                raise
            for t, was_released in batch:  # a ticket released meanwhile needs another write
                if self._unsynced.get(t.request_id) is t and t.is_released == was_released:
                    del self._unsynced[t.request_id]

    def _leave_degraded(self) -> None:
        """Redis holds every running ticket now: move them to it (synchronous, one step)."""
        assert not self._unsynced and self._num_redis_acquires == 0
        for t in self._running.values():
            if t.backend is self.memory:
                self.memory.settle_now(t.quota_id, t.request_id, t.num_tokens)  # frees the slot
                t.backend, t.is_in_redis_window = self.redis, True
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
                if t.backend is not None and t.has_slot:
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
        task.add_done_callback(_log_failure)
        return task


def _log_failure(task: asyncio.Task) -> None:
    """A background quota task that died of a bug says so (Redis faults are handled inside)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("quota background task failed", exc_info=task.exception())


def _adopt(t: Ticket) -> Record:
    return Record("adopt", t.quota_id, t.request_id, t.num_tokens, has_slot=t.has_slot)


def _final_record(t: Ticket) -> Record:
    """A released ticket's last word in Redis: settled if Redis counts it as admitted, else
    forgotten (memory admitted it, or nobody did); tombstoned if a call of it may run late."""
    if t.is_in_redis_window:
        return Record("settle", t.quota_id, t.request_id, t.actual_tokens, tombstone=t.may_run_late)
    return Record("forget", t.quota_id, t.request_id, tombstone=t.may_run_late)
