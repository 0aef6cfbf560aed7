"""`RedisBlockIndex`: the block-location index read from Redis in one round trip.

Layout (written by the services, engine/registry.py): one SET of block hashes per instance and
epoch, `tandem:blocks:<id>:<epoch>`. A lookup sends one Lua script per distinct block size
(normally one, always in one pipeline): KEYS are the candidates' sets, ARGV the prompt's hash
chain (as one concatenated string); for each set the script checks the chain in chunks of 128
with SMISMEMBER and stops at the first miss, returning one integer per instance. The reply is
tiny whatever the prompt length, and the walk costs O(hits) per instance on the server.

Why not a hash -> instances layout: it needs one key per block (SADD per hash per event instead
of one SADD per batch), and a dead instance would have to be removed from every block's key;
here it is one key expiring.

Failures: the client has short socket timeouts, and after an error lookups fail fast
(`IndexUnavailable`, no I/O) for `retry_s`, so a dead Redis costs requests nothing but the
cache-awareness of their routing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.record_auth import RecordAuth
from engine.registry import blocks_key
from gateway.index import BlockIndex, IndexTarget, IndexUnavailable, lookup_hashes
from gateway.redis_scripts import script_runner

# KEYS: one block set per instance. ARGV[1]: the prompt's block hashes in chain order,
# concatenated (one argument instead of hundreds: cheaper to encode and to pass); ARGV[2]: the
# length of one hash. Returns, per key, how many leading hashes are members.
LOOKUP_SCRIPT = """
local size = tonumber(ARGV[2])
local blob = ARGV[1]
local n = #blob / size
local chain = {}
for i = 1, n do
  chain[i] = string.sub(blob, (i - 1) * size + 1, i * size)
end
local chunk = 128
local out = {}
for i, key in ipairs(KEYS) do
  local count = 0
  local j = 1
  while j <= n do
    local last = math.min(j + chunk - 1, n)
    local found = redis.call('SMISMEMBER', key, unpack(chain, j, last))
    local full = true
    for k = 1, #found do
      if found[k] == 0 then
        full = false
        break
      end
      count = count + 1
    end
    if not full then
      break
    end
    j = last + 1
  end
  out[i] = count
end
return out
"""


class RedisBlockIndex(BlockIndex):
    def __init__(self, client, retry_s: float = 0.5):
        """`client`: a `redis.asyncio.Redis` with short socket timeouts."""
        import redis

        self._errors = (redis.RedisError, OSError)
        self.client = client
        self.scripts = script_runner(client)  # its address and timeouts; EVALSHA, reloading
        self.auth = RecordAuth.from_env()  # sets hold keyed digests, not raw hashes
        self.retry_s = retry_s
        self._down_until = 0.0
        self.num_errors = 0

    @property
    def is_available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def close(self) -> None:
        await self.scripts.close()
        await self.client.aclose()

    async def lookup(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        targets: Sequence[IndexTarget],
    ) -> dict[str, int]:
        groups: dict[int, list[IndexTarget]] = {}
        for t in targets:
            groups.setdefault(t.block_size, []).append(t)
        calls = []
        for block_size, group in groups.items():
            hashes = lookup_hashes(prompt_token_ids, block_size, cache_salt)
            hashes = [self.auth.block_member(h) for h in hashes]
            if hashes:
                calls.append((group, [blocks_key(t.instance_id, t.epoch) for t in group], hashes))
        if not calls:
            return {}
        if not self.is_available:
            raise IndexUnavailable("Redis index in back-off after an error")
        try:
            replies = await self._run(calls)
        except self._errors as e:
            self.num_errors += 1
            self._down_until = time.monotonic() + self.retry_s
            raise IndexUnavailable(str(e)) from e
        counts = {}
        for (group, _, _), reply in zip(calls, replies):
            counts.update({t.instance_id: int(n) for t, n in zip(group, reply) if n})
        return counts

    async def _run(self, calls) -> list[list[int]]:
        """One round trip (the script is loaded on first use and after a Redis restart)."""
        return await self.scripts.run(
            [(LOOKUP_SCRIPT, keys, [b"".join(hashes), len(hashes[0])]) for _, keys, hashes in calls]
        )
