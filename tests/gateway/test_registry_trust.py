"""Redis is shared state, not a root of trust (engine/record_auth.py).

Reproductions of a reviewer's findings against a real Redis: one hand-written registry record
made the gateway route tenants' prompts to a fake prefill; one malformed record stopped
discovery for everyone; anyone could claim a prompt's blocks in a block set.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio

from engine.record_auth import RecordAuth, RecordError
from engine.registry import INSTANCES_KEY, InstanceRecord, blocks_key, instance_key, new_epoch
from gateway.index import IndexTarget, lookup_hashes
from gateway.redis_index import RedisBlockIndex
from gateway.redis_registry import RedisRegistry
from tests.gateway.test_registry_redis import BS, PROMPT, FakeEngine, eventually, publisher
from tests.redis_server import redis_server  # noqa: F401  (the fixture)

TOKEN = "a-test-internal-token-0123456789"


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", TOKEN)
    e = FakeEngine()
    yield e
    e.stop()


def _forged(instance_id: str, role: str, address: str) -> bytes:
    return InstanceRecord(instance_id, role, address, "m", BS, new_epoch(), 4096).to_json().encode()


def test_forged_and_malformed_records_are_skipped_and_discovery_goes_on(
    redis_server,  # noqa: F811
    engine,
):
    url = redis_server.url
    r = redis.Redis.from_url(url)
    pub = publisher(url, engine, "d1")
    attacker_address = "127.0.0.1:6666"
    forged = {
        "p-evil": _forged("p-evil", "prefill", attacker_address),  # plain JSON, no MAC
        "p-wrongkey": RecordAuth("another-secret-0123456789").seal(
            _forged("p-wrongkey", "prefill", attacker_address)
        ),
        "junk": b"\xff{not json",
        # Authentic MAC, broken schema (e.g. written by an older or buggy build).
        "bad-schema": RecordAuth(TOKEN).seal(json.dumps({"instance_id": "bad-schema"}).encode()),
        # An authentic record replayed under another id's key.
        "p-replayed": r.get(instance_key("d1")),
    }
    for instance_id, value in forged.items():
        r.sadd(INSTANCES_KEY, instance_id)
        r.set(instance_key(instance_id), value)

    async def run():
        registry = RedisRegistry(redis.asyncio.Redis.from_url(url), refresh_s=0.05)
        await registry.start()
        try:
            assert [d.instance_id for d in registry.decodes()] == ["d1"]
            assert registry.prefills() == ()
            # A new instance joins after the bad records: still discovered.
            pub2 = publisher(url, engine, "p1", role="prefill")
            await eventually(lambda: _async([p.instance_id for p in registry.prefills()]))
            assert [p.instance_id for p in registry.prefills()] == ["p1"]
            assert all(i.address != attacker_address for i in registry.prefills())
            assert registry.num_rejected_records >= len(forged)
            sealed = registry.prefills()[0].registration  # kept for decodes to re-verify
            assert InstanceRecord.unseal(sealed, RecordAuth(TOKEN)).instance_id == "p1"
            pub2.stop()
        finally:
            await registry.close()

    asyncio.run(run())
    pub.stop()


def test_block_sets_hold_keyed_digests_that_a_writer_without_the_key_cannot_forge(
    redis_server,  # noqa: F811
    engine,
):
    url = redis_server.url
    r = redis.Redis.from_url(url)
    pub = publisher(url, engine, "d1")
    victim = PROMPT
    other = [t + 1000 for t in PROMPT]
    engine.compute(other)
    key = blocks_key("d1", pub.record.epoch)
    # The attacker knows the hashing scheme and writes the victim prompt's raw block hashes.
    r.sadd(key, *lookup_hashes(victim, BS, None))

    async def run():
        index = RedisBlockIndex(redis.asyncio.Redis.from_url(url))
        target = [IndexTarget("d1", pub.record.epoch, BS)]
        try:
            assert await eventually(lambda: index.lookup(other, None, target)) == {"d1": 5}
            assert await index.lookup(victim, None, target) == {}
        finally:
            await index.close()

    asyncio.run(run())
    assert not any(h in r.smembers(key) for h in lookup_hashes(other, BS, None))  # not raw
    pub.stop()


def test_sealed_records_round_trip_and_reject_tampering():
    auth = RecordAuth(TOKEN)
    record = InstanceRecord("d1", "decode", "10.0.0.1:5000", "m", 16, "e1", 4096)
    sealed = record.seal(auth)
    assert InstanceRecord.unseal(sealed, auth) == record
    tampered = sealed.replace(b"10.0.0.1", b"10.6.6.6")
    for value in (tampered, sealed[:-1], b"", b"x" * 200):
        with pytest.raises(RecordError):
            InstanceRecord.unseal(value, auth)
    with pytest.raises(RecordError):
        InstanceRecord.unseal(sealed, RecordAuth("some-other-secret-000000"))
    for bad in (
        {"role": "admin"},
        {"address": "no-port"},
        {"block_size": -1},
        {"load": {"num_free_blocks": float("nan")}},
        {"shell": "rm -rf /"},
    ):
        text = json.dumps(json.loads(record.to_json()) | bad)
        with pytest.raises(RecordError):
            InstanceRecord.from_json(text)


async def _async(value):
    return value
