"""`RedisRegistry`: the instances that registered themselves in Redis (engine/registry.py).

A background task re-reads the registry every `refresh_s` (two round trips: the id set, then
every record in one MGET); requests only ever read the last snapshot. Pools therefore grow and
shrink with the services, with no gateway restart: a new instance is routable one refresh after
it registered, a dead one disappears once its record's TTL ran out.

While Redis is unreachable the last snapshot stays in use (`is_available` is False): instances
that died meanwhile are caught by the router's UNAVAILABLE cooldown, and new ones wait for Redis.
A Redis that comes back may be empty (restarted): for `recovery_grace_s` after it returns,
instances of the last snapshot stay in the pool while they re-register, instead of the pool
emptying for a heartbeat or two.

Records are untrusted input (engine/record_auth.py): one that is forged (bad MAC) or malformed
(schema) is skipped, counted in `num_rejected_records` and logged once per instance and reason;
the rest of the refresh goes on, so no record can stop discovery. `Instance.registration` keeps
the sealed bytes of each accepted record, which decodes re-verify before they hand a prefill
their KV metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from engine.record_auth import RecordAuth, RecordError
from engine.registry import INSTANCES_KEY, InstanceRecord, instance_key
from gateway.registry import Instance, InstanceRegistry, InstanceStatus

logger = logging.getLogger(__name__)

_STATUS_FIELDS = {
    "num_waiting",
    "num_running",
    "num_free_blocks",
    "kv_cache_usage",
    "num_pending_prefill_tokens",
    "prefill_tokens_per_s",
}


def status_from_record(record: InstanceRecord) -> InstanceStatus:
    load = {k: v for k, v in record.load.items() if k in _STATUS_FIELDS}
    return InstanceStatus(
        epoch=record.epoch,
        block_size=record.block_size,
        kv_bytes_per_block=record.kv_bytes_per_block,
        max_num_batched_tokens=record.max_num_batched_tokens,
        as_of_s=record.published_at,
        **load,
    )


class RedisRegistry(InstanceRegistry):
    def __init__(self, client, refresh_s: float = 0.25, recovery_grace_s: float = 3.0):
        """`client`: a `redis.asyncio.Redis` (connections are made lazily on the event loop)."""
        self.client = client
        self.auth = RecordAuth.from_env()
        self.num_rejected_records = 0
        self._logged_rejections: set[tuple[str, str]] = set()
        self.refresh_s = refresh_s
        self.recovery_grace_s = recovery_grace_s
        self._recovering_until = 0.0
        self._decodes: tuple[Instance, ...] = ()
        self._prefills: tuple[Instance, ...] = ()
        self._statuses: dict[str, InstanceStatus] = {}
        self._is_available = False
        self._task: asyncio.Task | None = None
        self.last_refresh_s = 0.0

    def decodes(self) -> tuple[Instance, ...]:
        return self._decodes

    def prefills(self) -> tuple[Instance, ...]:
        return self._prefills

    def status(self, instance: Instance) -> InstanceStatus | None:
        status = self._statuses.get(instance.instance_id)
        return status if status is not None and status.epoch == instance.epoch else None

    @property
    def is_available(self) -> bool:
        return self._is_available

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    async def refresh(self) -> bool:
        """Read every record once; False (and the old snapshot kept) when Redis fails."""
        import redis

        try:
            ids = sorted(i.decode() for i in await self.client.smembers(INSTANCES_KEY))
            values = await self.client.mget([instance_key(i) for i in ids]) if ids else []
            dead = [i for i, v in zip(ids, values) if v is None]
            if dead:  # their TTL ran out: tidy the listing
                await self.client.srem(INSTANCES_KEY, *dead)
        except (redis.RedisError, OSError) as e:
            if self._is_available:
                logger.warning("Redis registry unreachable (%s); keeping the last instances", e)
            self._is_available = False
            return False
        if not self._is_available:
            logger.info("Redis registry reachable")
            if self.last_refresh_s:  # back after an outage, not the first read
                self._recovering_until = time.monotonic() + self.recovery_grace_s
        self._is_available = True
        self.last_refresh_s = time.monotonic()
        self._apply([rv for i, v in zip(ids, values) if v is not None and (rv := self._open(i, v))])
        return True

    def _open(self, listed_id: str, value: bytes) -> tuple[InstanceRecord, bytes] | None:
        try:
            record = InstanceRecord.unseal(value, self.auth)
            if record.instance_id != listed_id:
                raise RecordError(f"record of {record.instance_id!r} under another id's key")
        except RecordError as e:
            self.num_rejected_records += 1
            reason = str(e)
            if (listed_id, reason) not in self._logged_rejections:
                if len(self._logged_rejections) < 1000:  # bounded: ids are attacker-chosen
                    self._logged_rejections.add((listed_id, reason))
                logger.warning("Ignoring registry record %r: %s", listed_id[:64], reason)
            return None
        return record, value

    def _apply(self, records: list[tuple[InstanceRecord, bytes]]) -> None:
        pools: dict[str, list[Instance]] = {"decode": [], "prefill": []}
        statuses = {}
        for r, sealed in records:
            instance = Instance(r.address, r.instance_id, r.epoch, sealed)
            for role in ("decode", "prefill") if r.role == "both" else (r.role,):
                pools[role].append(instance)
            statuses[r.instance_id] = status_from_record(r)
        if time.monotonic() < self._recovering_until:
            for role, old in (("decode", self._decodes), ("prefill", self._prefills)):
                pools[role] += [i for i in old if i.instance_id not in statuses]
            for i in (*self._decodes, *self._prefills):
                if i.instance_id in self._statuses:
                    statuses.setdefault(i.instance_id, self._statuses[i.instance_id])
        self._decodes, self._prefills = tuple(pools["decode"]), tuple(pools["prefill"])
        self._statuses = statuses

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bad record must not end discovery
                logger.exception("registry refresh failed")
