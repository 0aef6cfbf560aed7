"""The Redis quota backend: the sliding-window log of `gateway.quota`, one Lua script per step.

Each script runs atomically in Redis, so every gateway sharing the Redis sees one limit per key,
however many requests race. Time is Redis's own (`TIME`), so gateway clocks do not matter.

Keys per quota id (hash-tagged, so one key's state stays in one cluster slot):
  tandem:quota:{id}:log    ZSET  request id -> admission time (ms)
  tandem:quota:{id}:amt    HASH  request id -> tokens (reserved, then actual)
  tandem:quota:{id}:sum    STR   sum of `amt` over the entries in `log`
  tandem:quota:{id}:slots  ZSET  request id -> lease expiry (ms)
  tandem:quota:{id}:done   ZSET  released request id -> tombstone expiry (ms)
All five expire after window + lease without traffic, so idle keys leave nothing behind.

Every script is idempotent per request id, so a call may be retried, and a call the client gave
up on (timeout) may still run late, when a hung Redis resumes, without counting twice:
  * `acquire` of a request id already recorded admits it again and records nothing more;
  * `adopt` records a request admitted elsewhere (the gateway's memory while Redis was
    unreachable) without checking limits: it is already running; recorded ones are left as
    they are, but the slot's lease is refreshed;
  * `settle` / `forget` free the slot (keeping the entry with the actual tokens, or removing it);
    with `tombstone`, they leave the id in `done` for window + lease, and an `acquire` or `adopt`
    of a tombstoned id that runs late records nothing. The service asks for a tombstone only
    for requests some call of which failed, the only ones a late call can exist for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from gateway.auth import TenantLimits
from gateway.quota import CONCURRENCY_RETRY_S, WINDOW_S, Decision, QuotaBackend
from gateway.redis_scripts import script_runner

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: log, amt, sum, slots, done. ARGV: request id, tokens, rpm, tpm, max concurrent,
# window ms, lease ms, concurrency retry ms. Returns {1} or {0, reason, retry_after_ms}; reason
# 'released' for a tombstoned id (an acquire that ran after its request was released).
_ACQUIRE = (
    _NOW_MS
    + """
local id, tokens = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, max_conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
-- Entries that left the window: drop them and their tokens (keeps sum == their total).
while true do
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window, 'LIMIT', 0, 500)
  if #old == 0 then break end
  local amts = redis.call('HMGET', KEYS[2], unpack(old))
  local freed = 0
  for i = 1, #amts do freed = freed + (tonumber(amts[i]) or 0) end
  redis.call('DECRBY', KEYS[3], freed)
  redis.call('HDEL', KEYS[2], unpack(old))
  redis.call('ZREM', KEYS[1], unpack(old))
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
if redis.call('ZSCORE', KEYS[5], id) then return {0, 'released', 0} end
if redis.call('ZSCORE', KEYS[1], id) or redis.call('ZSCORE', KEYS[4], id) then return {1} end
local count = redis.call('ZCARD', KEYS[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if count == 0 then used = 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if max_conc > 0 and redis.call('ZCARD', KEYS[4]) >= max_conc then
  return {0, 'max_concurrent', ARGV[8]}
end
if rpm > 0 and count >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, 'requests_per_min', tonumber(oldest[2]) + window - now}
end
if tpm > 0 and used + tokens > tpm then
  local excess, start = used + tokens - tpm, 0
  while true do
    local batch = redis.call('ZRANGE', KEYS[1], start, start + 99, 'WITHSCORES')
    if #batch == 0 then break end
    local ids = {}
    for i = 1, #batch, 2 do ids[#ids + 1] = batch[i] end
    local amts = redis.call('HMGET', KEYS[2], unpack(ids))
    for i = 1, #ids do
      excess = excess - (tonumber(amts[i]) or 0)
      if excess <= 0 then return {0, 'tokens_per_min', tonumber(batch[2 * i]) + window - now} end
    end
    start = start + 100
  end
  return {0, 'tokens_per_min', window}
end
redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, tokens)
redis.call('SET', KEYS[3], used + tokens)
if max_conc > 0 then redis.call('ZADD', KEYS[4], now + lease, id) end
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], window + lease) end
return {1}
"""
)

# KEYS: log, amt, sum, slots, done. ARGV: op ('adopt' | 'settle' | 'forget'), request id, tokens
# (adopt: reserved; settle: actual), has slot (adopt), tombstone (settle, forget), window ms,
# lease ms. Returns 1, or 0 for an adopt of a tombstoned id (it ran after the release).
_RECORD = (
    _NOW_MS
    + """
local op, id, tokens = ARGV[1], ARGV[2], tonumber(ARGV[3])
local has_slot, tombstone = ARGV[4] == '1', ARGV[5] == '1'
local window, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
if op == 'adopt' then
  if redis.call('ZSCORE', KEYS[5], id) then return 0 end
  if not redis.call('ZSCORE', KEYS[1], id) then
    if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('SET', KEYS[3], 0) end
    redis.call('ZADD', KEYS[1], now, id)
    redis.call('HSET', KEYS[2], id, tokens)
    redis.call('INCRBY', KEYS[3], tokens)
  end
  if has_slot then redis.call('ZADD', KEYS[4], now + lease, id) end
  for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], window + lease) end
  return 1
end
local reserved = redis.call('HGET', KEYS[2], id)
if reserved and op == 'settle' then
  redis.call('HSET', KEYS[2], id, tokens)
  redis.call('INCRBY', KEYS[3], tokens - tonumber(reserved))
elseif reserved then
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('DECRBY', KEYS[3], tonumber(reserved))
end
redis.call('ZREM', KEYS[4], id)
if tombstone then
  redis.call('ZADD', KEYS[5], now + window + lease, id)
  redis.call('PEXPIRE', KEYS[5], window + lease)
end
return 1
"""
)

# KEYS: slots of each held request. ARGV: lease ms, window ms, then one request id per key.
_RENEW = (
    _NOW_MS
    + """
local lease, window = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', now + lease, ARGV[i + 2]) == 1 then
    redis.call('PEXPIRE', KEYS[i], window + lease)
  end
end
return 1
"""
)


def _keys(quota_id: str) -> tuple[str, ...]:
    prefix = f"tandem:quota:{{{quota_id}}}"
    return tuple(f"{prefix}:{name}" for name in ("log", "amt", "sum", "slots", "done"))


@dataclass(frozen=True)
class Record:
    """One idempotent change to one request's record (see the module docstring)."""

    op: Literal["adopt", "settle", "forget"]
    quota_id: str
    request_id: str
    num_tokens: int = 0  # adopt: reserved; settle: actual
    has_slot: bool = False  # adopt: also hold a concurrency slot
    tombstone: bool = False  # settle / forget: a late acquire or adopt must not record it


class RedisQuota(QuotaBackend):
    name = "redis"

    def __init__(self, client: aioredis.Redis, lease_s: float):
        """`client`: where the scripts run (its address, timeouts and credentials; the calls
        themselves go through `gateway.redis_scripts.script_runner`)."""
        self.client = client
        self.lease_ms = int(lease_s * 1000)
        self.window_ms = int(WINDOW_S * 1000)
        self.scripts = script_runner(client)

    async def close(self) -> None:
        await self.scripts.close()

    async def acquire(
        self, quota_id: str, request_id: str, limits: TenantLimits, num_tokens: int
    ) -> Decision:
        args = [
            request_id,
            num_tokens,
            limits.requests_per_min,
            limits.tokens_per_min,
            limits.max_concurrent,
            self.window_ms,
            self.lease_ms,
            int(CONCURRENCY_RETRY_S * 1000),
        ]
        (result,) = await self.scripts.run([(_ACQUIRE, _keys(quota_id), args)])
        if int(result[0]) == 1:
            return Decision(True)
        reason = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        if reason == "released":
            raise RuntimeError(
                f"quota acquire for request {request_id!r} found it already released: request "
                "ids must be unique and acquired once (a caller bug, not a Redis fault)"
            )
        return Decision(False, reason, int(result[2]) / 1000)

    async def settle(
        self, quota_id: str, request_id: str, num_tokens: int, *, tombstone: bool = False
    ) -> None:
        await self.apply([Record("settle", quota_id, request_id, num_tokens, tombstone=tombstone)])

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        if not slots:
            return
        keys = [_keys(quota_id)[3] for quota_id, _ in slots]
        args = [self.lease_ms, self.window_ms, *(request_id for _, request_id in slots)]
        await self.scripts.run([(_RENEW, keys, args)])

    async def apply(self, records: Sequence[Record], within_s: float = 0.0) -> None:
        """Apply `records` in one round trip (pipelined; each record is atomic on its own),
        sent within `within_s` (they may wait that long to share a later call's round trip)."""
        if not records:
            return
        calls = []
        for r in records:
            args = [r.op, r.request_id, r.num_tokens, int(r.has_slot), int(r.tombstone)]
            calls.append((_RECORD, _keys(r.quota_id), [*args, self.window_ms, self.lease_ms]))
        await self.scripts.run(calls, within_s)
