"""`WatchedIndex`: the embedded block index fed by every instance's `WatchKVEvents` stream.

Without Redis (`tandem serve`, `--decode/--prefill` flags) the gateway subscribes to each
configured instance: the first batch of a stream is a reset (every cached hash), then diffs as
the instance's cache changes, each with the instance's load, which goes to the registry as its
status. A broken stream drops the instance's blocks and status (unknown, not stale) and
reconnects after `retry_s`; the new stream's reset rebuilds them, under the instance's new epoch
if it restarted. An instance without the RPC (an older build) is simply not watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from engine import internal_auth
from engine.block_pool import KVCacheEvent
from gateway.index import EmbeddedIndex
from gateway.registry import Instance, InstanceStatus, StaticRegistry
from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# Reconnect within a second or two of an instance coming back (grpc's default backoff: minutes).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
_KINDS = {
    common_pb2.KVEvent.STORED: "stored",
    common_pb2.KVEvent.REMOVED: "removed",
    common_pb2.KVEvent.CLEARED: "cleared",
}


def status_from_load(load: common_pb2.LoadResponse) -> InstanceStatus:
    return InstanceStatus(
        epoch=load.epoch,
        block_size=load.block_size,
        kv_bytes_per_block=load.kv_bytes_per_block,
        max_num_batched_tokens=load.max_num_batched_tokens,
        num_waiting=load.num_waiting,
        num_running=load.num_running,
        num_free_blocks=load.num_free_blocks,
        kv_cache_usage=load.kv_cache_usage,
        num_pending_prefill_tokens=load.num_pending_prefill_tokens,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        as_of_s=time.time(),  # the stream pushes as it happens: receipt time is close enough
    )


def events_from_proto(batch: common_pb2.KVEventBatch) -> list[KVCacheEvent]:
    return [KVCacheEvent(_KINDS[e.kind], tuple(e.block_hashes)) for e in batch.events]


class WatchedIndex(EmbeddedIndex):
    def __init__(self, registry: StaticRegistry, retry_s: float = 0.5):
        super().__init__()
        self.registry = registry
        self.retry_s = retry_s
        self._tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        watched = set()  # a kv_both decode is in both pools: one stream for it
        for role, instances in (
            ("decode", self.registry.decodes()),
            ("prefill", self.registry.prefills()),
        ):
            for instance in instances:
                if instance.instance_id not in watched:
                    watched.add(instance.instance_id)
                    self._tasks.append(asyncio.create_task(self._watch(instance, role)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for channel in self._channels:
            await channel.close()

    async def _watch(self, instance: Instance, role: str) -> None:
        channel = internal_auth.internal_channel(instance.address, options=_CHANNEL_OPTIONS)
        self._channels.append(channel)
        stub_cls = decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
        stub = stub_cls(channel)
        while True:
            try:
                async for batch in stub.WatchKVEvents(common_pb2.WatchKVEventsRequest()):
                    self.apply(
                        instance.instance_id, batch.epoch, batch.reset, events_from_proto(batch)
                    )
                    self.registry.set_status(instance.instance_id, status_from_load(batch.load))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("%s has no WatchKVEvents; routing to it by load", instance.address)
                    return
                logger.debug("KV event stream of %s broke: %s", instance.address, e.code())
            finally:
                self.forget(instance.instance_id)
                self.registry.set_status(instance.instance_id, None)
            await asyncio.sleep(self.retry_s)
