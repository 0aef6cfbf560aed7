"""Remote prefill from the decode side: reserve blocks, call `P.Prefill`, verify the KV landed.

Transfer states live in `receiver.py`. On failure before WRITTEN the request's blocks are
quarantined: released at once when P acknowledged (it answered with an error, which it does only
after its writes settled), else when the lease ends; the prompt then goes to the next candidate,
and after `MAX_PREFILL_ATTEMPTS` the caller prefills locally.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

import grpc

from decode_svc.receiver import KVReceiver, TransferState
from engine import internal_auth
from engine.async_engine import AsyncEngine
from engine.kv_cache_manager import cdiv
from engine.metrics import KV_TRANSFER_SECONDS
from engine.request import Request, RequestStatus
from engine.scheduler import SchedulerFullError
from engine.serving import logprobs_from_proto, sampling_params_to_proto
from kv_transfer import Agent
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)
# Replies that prove P is alive and has settled its writes: blocks can be released at once.
_ACKNOWLEDGED = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
}
MAX_PREFILL_ATTEMPTS = 2


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncEngine,
        agent: Agent,
        receiver: KVReceiver,
        prefill_timeout_s: float,
        lease_s: float,
        counters: dict[str, int],
    ):
        self.engine = engine
        self.core = engine.core
        self.agent = agent
        self.agent_metadata = agent.get_agent_metadata()
        self.receiver = receiver
        self.prefill_timeout_s = prefill_timeout_s
        self.lease_s = lease_s
        self.counters = counters
        self._channels: dict[str, prefill_pb2_grpc.PrefillStub] = {}

    async def run(self, req: Request, request, timings):
        """An output stream once P has written the KV; None to prefill locally instead."""
        bs = self.core.config.cache.block_size
        loop = asyncio.get_running_loop()
        received = time.monotonic()
        for attempt, target in enumerate(request.prefill[:MAX_PREFILL_ATTEMPTS]):
            transfer_id = request.transfer_id or uuid.uuid4().hex
            if attempt:
                transfer_id += f"-retry{attempt}"
            token = secrets.token_hex(16)
            arrived = loop.create_future()

            def reserve(tid=transfer_id, token=token, arrived=arrived):
                """One engine-thread hop: blocks, then the expected notification."""
                alloc = self.core.allocate_for_remote_prefill(req)
                if alloc is not None:
                    self.receiver.expect(tid, token, loop, arrived)
                return alloc

            alloc = await self.engine.call(reserve)
            if alloc is None:
                raise SchedulerFullError("no free KV blocks for the prompt; retry elsewhere")
            first_block = alloc.num_hit_tokens // bs
            msg = prefill_pb2.PrefillRequest(
                request_id=req.request_id,
                transfer_id=transfer_id,
                prompt_token_ids=req.prompt_token_ids,
                params=sampling_params_to_proto(req.sampling_params),
                cache_salt=req.cache_salt or "",
                target=common_pb2.KVTarget(
                    agent_name=self.agent.name,
                    agent_metadata=self.agent_metadata,
                    block_ids=alloc.block_ids[first_block : cdiv(req.num_prompt_tokens, bs)],
                    first_block=first_block,
                    transfer_token=token,
                ),
            )
            t0 = time.monotonic()
            try:
                resp = await self._stub(target.address).Prefill(msg, timeout=self.prefill_timeout_s)
                t1 = time.monotonic()
                await asyncio.wait_for(arrived, timeout=5.0)
            except asyncio.CancelledError:
                self._fail_transfer(req, transfer_id, acknowledged=False)
                asyncio.ensure_future(self._abort_prefill(target.address, req.request_id))
                raise
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                ack = isinstance(e, grpc.aio.AioRpcError) and e.code() in _ACKNOWLEDGED
                logger.warning(
                    "Prefill %s on %s failed (%s); %s",
                    transfer_id,
                    target.address,
                    _describe(e),
                    "retrying" if attempt + 1 < len(request.prefill) else "prefilling locally",
                )
                self._fail_transfer(req, transfer_id, acknowledged=ack)
                continue
            self.receiver.set_state(transfer_id, TransferState.WRITTEN)
            self.counters["num_remote_prefills"] += 1
            self.counters["kv_transfer_bytes"] += resp.kv_transfer_bytes
            timings.kv_transfer_s = resp.kv_transfer_s
            KV_TRANSFER_SECONDS.observe(resp.kv_transfer_s)
            timings.kv_transfer_bytes = resp.kv_transfer_bytes
            timings.prefill_instance = target.instance_id or target.address
            timings.remote_setup_s = t0 - received
            timings.remote_rpc_s = t1 - t0
            timings.remote_compute_s = resp.compute_s
            timings.remote_server_s = resp.server_s
            timings.kv_wait_s = time.monotonic() - t1
            lp = (
                logprobs_from_proto(resp.first_logprobs)
                if resp.HasField("first_logprobs")
                else None
            )
            logger.debug("Remote prefill %s took %.3f s", transfer_id, time.monotonic() - t0)

            def add(r: Request, resp=resp, lp=lp, tid=transfer_id):
                self.receiver.set_state(tid, TransferState.FINISHED)
                return self.core.add_remote_prefilled(
                    r, resp.first_token_id, lp, resp.num_cached_tokens
                )

            return self.engine.generate(req, add=add)
        return None

    def _fail_transfer(self, req: Request, transfer_id: str, acknowledged: bool) -> None:
        """Quarantine the request's blocks; release now if P acknowledged, else at lease end."""

        def quarantine() -> None:
            self.receiver.forget(transfer_id)
            self.receiver.set_state(transfer_id, TransferState.FAILED)
            key = self.core.quarantine_blocks(req)
            req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
            if acknowledged:
                self.core.release_quarantine(key)
            else:  # call_later is not thread-safe: schedule it from the loop's own thread
                loop.call_soon_threadsafe(
                    loop.call_later,
                    self.lease_s,
                    self.engine.submit,
                    lambda: self.core.release_quarantine(key),
                )

        loop = asyncio.get_running_loop()
        self.engine.submit(quarantine)

    async def _abort_prefill(self, address: str, request_id: str) -> None:
        try:
            await self._stub(address).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=2.0
            )
        except grpc.aio.AioRpcError as e:
            logger.info("Abort on prefill %s failed: %s", address, _describe(e))

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._channels:
            self._channels[address] = prefill_pb2_grpc.PrefillStub(
                internal_auth.insecure_channel(address)
            )
        return self._channels[address]


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: no KV notification"
