"""The Redis quota backend: the sliding-window log of `gateway.quota`, one Lua script per step.

Each script runs atomically in Redis, so every gateway sharing the Redis sees one limit per key,
however many requests race. Time is Redis's own (`TIME`), so gateway clocks do not matter.

Keys per quota id (hash-tagged, so one key's state stays in one cluster slot):
  tandem:quota:{id}:log    ZSET  request id -> admission time (ms)
  tandem:quota:{id}:amt    HASH  request id -> tokens (reserved, then actual)
  tandem:quota:{id}:sum    STR   sum of `amt` over the entries in `log`
  tandem:quota:{id}:slots  ZSET  request id -> lease expiry (ms)
All four expire after window + lease without traffic, so idle keys leave nothing behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from gateway.auth import TenantLimits
from gateway.quota import CONCURRENCY_RETRY_S, WINDOW_S, Decision, QuotaBackend

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: log, amt, sum, slots. ARGV: request id, tokens, rpm, tpm, max concurrent, window ms,
# lease ms. Returns {1} or {0, reason, retry_after_ms}.
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

# KEYS: amt, sum, slots. ARGV: request id, actual tokens.
_SETTLE = """
local reserved = redis.call('HGET', KEYS[1], ARGV[1])
if reserved then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('INCRBY', KEYS[2], tonumber(ARGV[2]) - tonumber(reserved))
end
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

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


def _keys(quota_id: str) -> tuple[str, str, str, str]:
    prefix = f"tandem:quota:{{{quota_id}}}"
    return f"{prefix}:log", f"{prefix}:amt", f"{prefix}:sum", f"{prefix}:slots"


class RedisQuota(QuotaBackend):
    name = "redis"

    def __init__(self, client: aioredis.Redis, lease_s: float):
        self.client = client
        self.lease_ms = int(lease_s * 1000)
        self.window_ms = int(WINDOW_S * 1000)
        # Script objects: EVALSHA, reloading the script after a Redis restart (NOSCRIPT).
        self._acquire = client.register_script(_ACQUIRE)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)

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
        result = await self._acquire(keys=list(_keys(quota_id)), args=args)
        if int(result[0]) == 1:
            return Decision(True)
        reason = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        return Decision(False, reason, int(result[2]) / 1000)

    async def settle(self, quota_id: str, request_id: str, num_tokens: int) -> None:
        _, amt, total, slots = _keys(quota_id)
        await self._settle(keys=[amt, total, slots], args=[request_id, num_tokens])

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        if not slots:
            return
        keys = [_keys(quota_id)[3] for quota_id, _ in slots]
        args = [self.lease_ms, self.window_ms, *(request_id for _, request_id in slots)]
        await self._renew(keys=keys, args=args)
