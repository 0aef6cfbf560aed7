"""Per-key quotas: the backend contract and the in-memory backend.

Semantics (identical in Redis, `quota_redis.py`, and here), per quota id (one API key):
  * a **sliding-window log** of the last 60 s: one entry per admitted request, holding the
    tokens reserved for it. requests/min = number of entries; tokens/min = sum of their tokens.
    Sliding, not fixed windows: no double burst at a window edge, and `Retry-After` is exact
    (when the oldest entries that must leave the window leave it).
  * a request reserves `sum(prompt_len) + sum(max_tokens of every sample)` up front; at the end
    `settle` replaces that with the tokens actually used (prompt + completion), so a request
    that stopped early frees the rest of its reservation for the rest of the window.
  * **concurrency slots** with a lease: taken at admission, freed by `settle`, renewed while the
    request runs (`renew`), expired if a gateway dies holding them.
  * admission is all-or-nothing: the three checks and the recording happen in one atomic step
    (one Lua script in Redis; one synchronous call on the event loop here).
  * every step is idempotent per request id (ids are unique per request): acquiring a request
    already recorded records nothing more, settling twice frees one slot. Redis calls can be
    retried, or run late after the client gave up on them, without counting anything twice.
  * `adopt` records a request that another backend admitted, without checking limits (it is
    already running): how the service hands in-flight requests between Redis and memory when
    it switches (`gateway.quota_service`), so that the new authority counts them.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.auth import TenantLimits

WINDOW_S = 60.0
# Retry-After for a full concurrency limit: when a slot frees is unknowable; poll gently.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True)
class Decision:
    is_admitted: bool
    reason: str = ""  # which limit refused: requests_per_min | tokens_per_min | max_concurrent
    retry_after_s: float = 0.0

    @property
    def retry_after_header_s(self) -> int:
        """Whole seconds, rounded up, at least 1 (Retry-After has one-second resolution)."""
        return max(1, math.ceil(self.retry_after_s))


class QuotaBackend(ABC):
    """Contract: `acquire` is atomic per quota id across every gateway sharing the backend;
    it checks max_concurrent, requests_per_min and tokens_per_min (0 = unlimited) and, only if
    all pass, records the request (window entry with `num_tokens`, a slot when max_concurrent
    is set); a request id already recorded is admitted again with nothing more recorded.
    `settle` sets the entry's tokens to the actual use and frees the slot; settling an
    unknown or already-expired request is a no-op. `renew` extends held slots' leases.
    Backends raise on infrastructure failure (the service then falls back)."""

    name: str

    @abstractmethod
    async def acquire(
        self, quota_id: str, request_id: str, limits: TenantLimits, num_tokens: int
    ) -> Decision: ...

    @abstractmethod
    async def settle(self, quota_id: str, request_id: str, num_tokens: int) -> None: ...

    @abstractmethod
    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        """`slots`: (quota_id, request_id) pairs still running."""


@dataclass
class _Bucket:
    # request id -> (admission time, tokens); insertion order is time order (monotonic clock).
    log: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    num_tokens: int = 0  # invariant: == sum of the tokens in `log`
    slots: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry


class MemoryQuota(QuotaBackend):
    """One gateway's own limits: used without Redis, and while Redis is unreachable."""

    name = "memory"

    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self._buckets: dict[str, _Bucket] = {}  # bounded: quota ids come from configured keys

    def _trim(self, bucket: _Bucket, now: float) -> None:
        while bucket.log:
            request_id, (t, num_tokens) = next(iter(bucket.log.items()))
            if t > now - WINDOW_S:
                break
            del bucket.log[request_id]
            bucket.num_tokens -= num_tokens
        for request_id in [r for r, expiry in bucket.slots.items() if expiry <= now]:
            del bucket.slots[request_id]

    async def acquire(
        self, quota_id: str, request_id: str, limits: TenantLimits, num_tokens: int
    ) -> Decision:
        return self.acquire_now(quota_id, request_id, limits, num_tokens)

    def acquire_now(
        self, quota_id: str, request_id: str, limits: TenantLimits, num_tokens: int
    ) -> Decision:
        now = self.clock()
        bucket = self._buckets.setdefault(quota_id, _Bucket())
        self._trim(bucket, now)
        if request_id in bucket.log or request_id in bucket.slots:
            return Decision(True)  # recorded already: idempotent
        if limits.max_concurrent and len(bucket.slots) >= limits.max_concurrent:
            return Decision(False, "max_concurrent", CONCURRENCY_RETRY_S)
        if limits.requests_per_min and len(bucket.log) >= limits.requests_per_min:
            oldest_t, _ = next(iter(bucket.log.values()))
            return Decision(False, "requests_per_min", oldest_t + WINDOW_S - now)
        if limits.tokens_per_min and bucket.num_tokens + num_tokens > limits.tokens_per_min:
            excess = bucket.num_tokens + num_tokens - limits.tokens_per_min
            for t, tokens in bucket.log.values():  # oldest first: when has enough left?
                excess -= tokens
                if excess <= 0:
                    return Decision(False, "tokens_per_min", t + WINDOW_S - now)
            return Decision(False, "tokens_per_min", WINDOW_S)  # only if num_tokens > limit
        bucket.log[request_id] = (now, num_tokens)
        bucket.num_tokens += num_tokens
        if limits.max_concurrent:
            bucket.slots[request_id] = now + self.lease_s
        return Decision(True)

    def adopt_now(self, quota_id: str, request_id: str, num_tokens: int, has_slot: bool) -> None:
        """Record a request admitted elsewhere (running): no limit is checked. A recorded
        request keeps its entry; its slot's lease is refreshed. The entry is timed now (not at
        its admission): it may stay in the window longer than it would have, never shorter."""
        now = self.clock()
        bucket = self._buckets.setdefault(quota_id, _Bucket())
        self._trim(bucket, now)
        if request_id not in bucket.log:
            bucket.log[request_id] = (now, num_tokens)
            bucket.num_tokens += num_tokens
        if has_slot:
            bucket.slots[request_id] = now + self.lease_s

    async def settle(self, quota_id: str, request_id: str, num_tokens: int) -> None:
        self.settle_now(quota_id, request_id, num_tokens)

    def settle_now(self, quota_id: str, request_id: str, num_tokens: int) -> None:
        bucket = self._buckets.get(quota_id)
        if bucket is None:
            return
        bucket.slots.pop(request_id, None)
        entry = bucket.log.get(request_id)
        if entry is not None:
            bucket.log[request_id] = (entry[0], num_tokens)  # keeps its place (time order)
            bucket.num_tokens += num_tokens - entry[1]
        if not bucket.log and not bucket.slots:
            del self._buckets[quota_id]

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        expiry = self.clock() + self.lease_s
        for quota_id, request_id in slots:
            bucket = self._buckets.get(quota_id)
            if bucket is not None and request_id in bucket.slots:
                bucket.slots[request_id] = expiry

    def usage(self, quota_id: str) -> tuple[int, int, int]:
        """(requests, tokens, slots) in the window now: for tests and debugging."""
        bucket = self._buckets.get(quota_id)
        if bucket is None:
            return 0, 0, 0
        self._trim(bucket, self.clock())
        return len(bucket.log), bucket.num_tokens, len(bucket.slots)
