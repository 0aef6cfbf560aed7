"""The services' side of the Redis registry and block-location index.

Key layout (one Redis, every key under `tandem:`):

- `tandem:instances`: SET of instance ids; the gateways' listing. A member whose record expired
  is removed by the gateway that notices.
- `tandem:instance:<id>`: STRING, the JSON `InstanceRecord` (role, address, model, block size,
  epoch, load), sealed with an HMAC (engine/record_auth.py): readers skip what fails it. `PX`
  TTL = 3 heartbeats, rewritten every heartbeat and whenever the load changes, so an instance
  that stops heartbeating leaves every pool within the TTL.
- `tandem:blocks:<id>:<epoch>`: SET of the keyed digests (`RecordAuth.block_member`) of the
  block hashes cached at the instance in that epoch, same TTL. The epoch is new per process
  start: the record names the live epoch, so an older epoch's set is never read; it expires,
  and a restarted process deletes its old epochs' sets at once.

Why one set per instance: a `stored` batch is one SADD, `cleared` one DEL, a reset DEL + SADD in
one MULTI, a dead instance one key expiring; a lookup walks each candidate's set along the
prompt's hash chain in one server-side script (gateway/redis_index.py), one round trip.

The publisher is a thread with its own (blocking) Redis client: Redis being slow or gone never
stalls the engine loop or the gRPC event loop. Whenever Redis may have lost writes (an error, or
our record vanished: a Redis restart), it asks the event source for a reset and re-publishes the
full cached set, so a restarted Redis heals without anyone's help.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.kv_events import EventBatch, KVEventSource, LoadSnapshot
from engine.record_auth import RecordAuth, RecordError

logger = logging.getLogger(__name__)

INSTANCES_KEY = "tandem:instances"
ROLES = ("prefill", "decode", "both")
REDIS_URL_ENV = "TANDEM_REDIS_URL"
REDIS_URL_FILE_ENV = "TANDEM_REDIS_URL_FILE"
_MAX_ARGS = 10_000  # members per SADD/SREM: keeps single commands small


def instance_key(instance_id: str) -> str:
    return f"tandem:instance:{instance_id}"


def blocks_key(instance_id: str, epoch: str) -> str:
    return f"tandem:blocks:{instance_id}:{epoch}"


def new_epoch() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class InstanceRecord:
    """What an instance says about itself; the gateway's `RedisRegistry` parses the same JSON."""

    instance_id: str
    role: str  # "prefill" | "decode" | "both" (a kv_both decode: in both pools)
    address: str  # host:port of its gRPC server
    model: str
    block_size: int
    epoch: str
    kv_bytes_per_block: int
    max_num_batched_tokens: int = 0
    load: dict[str, Any] = field(default_factory=dict)  # LoadSnapshot's fields
    published_at: float = 0.0  # wall clock, seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> InstanceRecord:
        """Parse and schema-check; RecordError names what is wrong (never the whole text)."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise RecordError(f"not JSON: {type(e).__name__}") from None
        if not isinstance(raw, dict):
            raise RecordError("not a JSON object")
        types = {"instance_id": str, "role": str, "address": str, "model": str, "epoch": str}
        types |= {"block_size": int, "kv_bytes_per_block": int, "max_num_batched_tokens": int}
        missing = [k for k in ("instance_id", "role", "address", "epoch") if k not in raw]
        unknown = sorted(set(raw) - {*types, "load", "published_at"})
        if missing or unknown:
            raise RecordError(f"missing fields {missing}, unknown fields {unknown[:5]}")
        for name, typ in types.items():
            value = raw.get(name, typ())
            if type(value) is not typ or (typ is int and value < 0) or len(str(value)) > 256:
                raise RecordError(f"field {name!r} must be a {typ.__name__} (at most 256 chars)")
        if raw["role"] not in ROLES or raw["block_size"] <= 0:
            raise RecordError("role must be prefill, decode or both, block_size positive")
        host, sep, port = raw["address"].rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise RecordError("address must be host:port")
        load = raw.get("load", {})
        if not isinstance(load, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v == v and v >= 0
            for v in load.values()
        ):
            raise RecordError("load must map names to non-negative numbers")
        published_at = raw.get("published_at", 0.0)
        if not isinstance(published_at, int | float) or isinstance(published_at, bool):
            raise RecordError("published_at must be a number")
        return cls(**raw)

    def seal(self, auth: RecordAuth) -> bytes:
        return auth.seal(self.to_json().encode())

    @classmethod
    def unseal(cls, value: bytes, auth: RecordAuth) -> InstanceRecord:
        """The record in a Redis value; RecordError when it is forged or malformed."""
        return cls.from_json(auth.open(value))


def resolve_redis_url(cli_value: str | None, flag: str = "--redis-url") -> str | None:
    """The Redis URL: `flag` (no password allowed: argv is world-readable in `ps`), else
    TANDEM_REDIS_URL, else the file named by TANDEM_REDIS_URL_FILE (a mounted secret). A
    password or ACL user goes in the URL (`redis://user:pass@host:6379/0`); TLS is `rediss://`
    (with `?ssl_ca_certs=/path` and client certificates as redis-py reads them)."""
    if cli_value:
        if urllib.parse.urlsplit(cli_value).password:
            raise ValueError(
                f"{flag} carries a password, which every local user can read in `ps`: pass the "
                f"URL in {REDIS_URL_ENV} or, better, in a file named by {REDIS_URL_FILE_ENV} "
                "(a mounted secret)."
            )
        return cli_value
    if os.environ.get(REDIS_URL_ENV):
        return os.environ[REDIS_URL_ENV]
    path = os.environ.get(REDIS_URL_FILE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            url = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read {REDIS_URL_FILE_ENV} ({path}): {e.strerror}") from None
    if not url:
        raise ValueError(f"{REDIS_URL_FILE_ENV} ({path}) is empty; put the Redis URL in it")
    return url


def add_registry_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"register and publish KV events here; without a password (use {REDIS_URL_ENV} or "
        f"{REDIS_URL_FILE_ENV} for one); off when none is given",
    )
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="record TTL is 3x this")
    parser.add_argument(
        "--advertise-address", default=None, help="host:port the gateways dial (default: bound)"
    )


def apply_batch(
    pipe, key: str, batch: EventBatch, ttl_ms: int, auth: RecordAuth | None = None
) -> None:
    """Queue the Redis commands that make `key` follow `batch` (on a MULTI pipeline). Members
    are `auth.block_member` of each hash (`auth` defaults to the environment's secret)."""
    member = (auth or RecordAuth.from_env()).block_member
    if batch.reset:
        pipe.delete(key)
    for event in batch.events:
        hashes = [member(h) for h in event.block_hashes]
        for i in range(0, len(hashes), _MAX_ARGS):
            if event.kind == "stored":
                pipe.sadd(key, *hashes[i : i + _MAX_ARGS])
            elif event.kind == "removed":
                pipe.srem(key, *hashes[i : i + _MAX_ARGS])
        if event.kind == "cleared":
            pipe.delete(key)
    pipe.pexpire(key, ttl_ms)  # a key created here never outlives a dead publisher


class RedisPublisher:
    """Heartbeat + KV events of one instance into Redis, from a background thread."""

    def __init__(
        self,
        url: str,
        source: KVEventSource,
        record: InstanceRecord,
        heartbeat_s: float = 1.0,
        flush_s: float = 0.02,
        min_load_interval_s: float = 0.1,
    ):
        import redis  # only services started with --redis-url need the client

        self._redis = redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries (the default is 10 with backoff): the loop below retries, and
        # knows that a failed write means a reset is due.
        self.client = redis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        self.source = source
        self.record = record
        self.auth = RecordAuth.from_env()
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = max(int(3000 * heartbeat_s), 100)
        self.flush_s = flush_s
        self.min_load_interval_s = min_load_interval_s
        self.blocks_key = blocks_key(record.instance_id, record.epoch)
        self._queue: queue.SimpleQueue[EventBatch] = queue.SimpleQueue()
        self._sub = source.subscribe(self._queue.put)
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_registered(self, timeout_s: float) -> bool:
        return self._registered.wait(timeout_s)

    def stop(self) -> None:
        """Leave the pool at once (not after the TTL): delete our record and blocks."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.source.unsubscribe(self._sub)
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(instance_key(self.record.instance_id), self.blocks_key)
            pipe.srem(INSTANCES_KEY, self.record.instance_id)
            pipe.execute()
        except self._redis.RedisError as e:
            logger.info("could not deregister from Redis: %s", e)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        is_synced = False  # Redis holds our full state (a reset was applied, nothing lost since)
        is_cleaned = False
        last_record_at, last_load = 0.0, None
        while not self._stop.wait(self.flush_s):
            batches = self._drain(is_synced)
            load = batches[-1].load if batches else last_load
            now = time.monotonic()
            needs_record = now - last_record_at >= self.heartbeat_s or (
                load != last_load and now - last_record_at >= self.min_load_interval_s
            )
            if not batches and not needs_record:
                continue
            try:
                if not is_cleaned:
                    self._delete_old_epochs()
                    is_cleaned = True
                pipe = self.client.pipeline(transaction=True)
                for batch in batches:
                    apply_batch(pipe, self.blocks_key, batch, self.ttl_ms, self.auth)
                if needs_record:
                    self._queue_record(pipe, load)
                results = pipe.execute()
            except self._redis.RedisError as e:
                if is_synced or self._registered.is_set():
                    logger.warning("Redis unavailable (%s); will re-publish on reconnect", e)
                is_synced = False
                self._registered.clear()
                self._sub.request_reset()
                self._stop.wait(0.5)
                continue
            if batches and batches[0].reset:
                is_synced = True
            if needs_record:
                last_record_at, last_load = now, load
                if results[-2] is None and self._registered.is_set():
                    # Our record was gone before its TTL: Redis restarted (or we stalled).
                    logger.warning("registration lost in Redis; re-publishing cached blocks")
                    is_synced = False
                    self._sub.request_reset()
                self._registered.set()

    def _drain(self, is_synced: bool) -> list[EventBatch]:
        """Queued batches to apply. Until synced, everything before the latest reset is moot."""
        batches = []
        while True:
            try:
                batches.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if is_synced:
            return batches
        resets = [i for i, b in enumerate(batches) if b.reset]
        if resets:
            return batches[resets[-1] :]
        # Keep only the freshest load; the blocks wait for the reset.
        return [EventBatch(False, (), batches[-1].load)] if batches else []

    def _queue_record(self, pipe, load: LoadSnapshot | None) -> None:
        record = replace(
            self.record, load=asdict(load) if load else {}, published_at=round(time.time(), 3)
        )
        pipe.sadd(INSTANCES_KEY, record.instance_id)
        pipe.set(instance_key(record.instance_id), record.seal(self.auth), px=self.ttl_ms, get=True)
        pipe.pexpire(self.blocks_key, self.ttl_ms)

    def _delete_old_epochs(self) -> None:
        pattern = blocks_key(self.record.instance_id, "*")
        stale = [k for k in self.client.scan_iter(match=pattern) if k != self.blocks_key.encode()]
        if stale:
            self.client.delete(*stale)
