"""Remote prefill from the decode side: reserve blocks, call `P.Prefill`, verify the KV landed.

Transfer states live in `receiver.py`. Who gets our KV metadata (its rkeys let the holder write
into any of our blocks; no transport here can narrow that, see docs/security.md): only a
prefill the caller (authenticated by the internal token) named, and, when this decode is part
of a Redis registry, only one whose sealed registration record verifies here (a forged Redis
record never gets it).

How long we wait: a bound derived from the predicted prefill time (the gateway's prediction,
else this decode's measured seconds per prompt token of that prefill), never more than
`--prefill-timeout-s`; past it the prompt goes to the next candidate, and after
`MAX_PREFILL_ATTEMPTS` the caller prefills locally.

Fencing: blocks a prefill may still write are quarantined after any failure and released only
once that prefill acknowledged (it answered, which it does only after its writes settled: an
error reply, or an `Abort` reply, sent again with back-off until one arrives) or is known dead
(its port refuses connections). A prefill that is stopped or hung therefore keeps its blocks out
of use for as long as it might still write them; a zombie resuming later writes only into
blocks nobody else was given. P also refuses a `Prefill` whose transfer was already aborted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from decode_svc.receiver import KVReceiver, TransferState
from engine import internal_auth
from engine.async_engine import AsyncEngine
from engine.kv_cache_manager import cdiv
from engine.metrics import (
    KV_TRANSFER_SECONDS,
    REMOTE_PREFILL_RPC_SECONDS,
    REMOTE_PREFILL_SETUP_SECONDS,
    REMOTE_PREFILL_TRANSIT_SECONDS,
)
from engine.record_auth import RecordAuth, RecordError
from engine.registry import InstanceRecord
from engine.request import Request, RequestStatus
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
    grpc.StatusCode.UNAUTHENTICATED,
}
MAX_PREFILL_ATTEMPTS = 2
# Bound on one prefill: BASE + FACTOR x predicted, within [MIN, --prefill-timeout-s].
_WAIT_BASE_S, _WAIT_FACTOR, _WAIT_MIN_S = 1.0, 4.0, 2.0
_NOTIF_WAIT_S = 5.0  # P replied (its writes are flushed): the notification is on its way
_RATE_EMA = 0.2
# A registration older than this is stale (records are rewritten every heartbeat, ~1 s).
MAX_REGISTRATION_AGE_S = 60.0
_ABORT_TIMEOUT_S = 2.0
_ABORT_BACKOFF_MAX_S = 5.0


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncEngine,
        agent: Agent,
        receiver: KVReceiver,
        prefill_timeout_s: float,
        lease_s: float,
        counters: dict[str, int],
        require_registration: bool = False,
        max_tenant_kv_fraction: float = 1.0,
    ):
        self.engine = engine
        self.core = engine.core
        self.agent = agent
        self.agent_metadata = agent.get_agent_metadata()
        self.block_bytes = self.core.runner.kv_cache[0].nbytes  # what P checks its layout against
        self.receiver = receiver
        self.prefill_timeout_s = prefill_timeout_s
        self.lease_s = lease_s
        self.counters = counters
        # Exported as metrics (not part of GetLoad's reply, which `counters` feeds).
        self.stats = dict.fromkeys(
            (
                "num_rejected_prefill_targets",
                "num_prefill_timeouts",
                "num_fenced_transfers",
                "num_queued_for_blocks",
            ),
            0,
        )
        self.require_registration = require_registration
        if not 0 < max_tenant_kv_fraction <= 1:
            raise ValueError(
                f"max_tenant_kv_fraction must be in (0, 1], got {max_tenant_kv_fraction}"
            )
        # Blocks one tenant (cache salt) may hold in remote prefills at once: one caller with
        # many long prompts must not take every block (and so every other tenant's service).
        num_usable = self.core.kv.pool.num_blocks - 1
        self.max_blocks_per_salt = (
            max(1, int(max_tenant_kv_fraction * num_usable)) if max_tenant_kv_fraction < 1 else None
        )
        self.auth = RecordAuth.from_env()
        self._channels: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._s_per_token: dict[str, float] = {}  # measured per prefill address
        self._tokens_at: dict[str, int] = {}  # prompt tokens of ours a prefill is working on
        self._tasks: set[asyncio.Task] = set()  # kept alive until done: fences, leaving the line
        # Request id -> (its reserve, the future its allocation is handed back through), from
        # before its first reserve until it has blocks or left the line.
        self._line: dict[str, tuple[Callable[[], Any], asyncio.Future]] = {}
        engine.hooks.append(self._serve_line)

    async def run(self, req: Request, request, timings):
        """An output stream once P has written the KV; None to prefill locally instead."""
        bs = self.core.config.cache.block_size
        loop = asyncio.get_running_loop()
        received = time.monotonic()
        targets = [t for t in request.prefill if self._is_trusted(t)]
        for attempt, target in enumerate(targets[:MAX_PREFILL_ATTEMPTS]):
            transfer_id = request.transfer_id or uuid.uuid4().hex
            if attempt:
                transfer_id += f"-retry{attempt}"
            token = secrets.token_hex(16)
            arrived = loop.create_future()

            def reserve(tid=transfer_id, token=token, arrived=arrived):
                """One engine-thread hop: blocks, then the expected notification."""
                limit = self.max_blocks_per_salt if req.cache_salt else None
                alloc = self.core.allocate_for_remote_prefill(req, limit)
                if alloc is not None:
                    self.receiver.expect(tid, token, loop, arrived)
                return alloc

            try:
                alloc = await self._reserve_in_line(req, reserve)
            except asyncio.CancelledError:
                # A `reserve` may still run (queued, or the line's hook mid-pass); this runs
                # after it (engine-thread work runs in order). No prefill has seen these
                # blocks: release them at once.
                self._fail_transfer(req, transfer_id, target.address, acknowledged=True)
                raise
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
                    block_bytes=self.block_bytes,
                ),
            )
            # This decode's prompt tokens at that prefill, this one's included: a burst sent at
            # once is computed one after another, and the last one's bound must cover them all.
            num_new = req.num_prompt_tokens - alloc.num_hit_tokens
            ahead = self._tokens_at.get(target.address, 0) + num_new
            self._tokens_at[target.address] = ahead
            wait_s = self._wait_s(target, ahead)
            t0 = time.monotonic()
            try:
                resp = await self._stub(target.address).Prefill(msg, timeout=wait_s)
                t1 = time.monotonic()
                await asyncio.wait_for(arrived, timeout=_NOTIF_WAIT_S)
            except asyncio.CancelledError:
                self._fail_transfer(req, transfer_id, target.address, acknowledged=False)
                raise
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                # P's reply (an error, or a success whose notification we then missed) comes
                # only after its writes settled: that acknowledges the blocks.
                ack = not isinstance(e, grpc.aio.AioRpcError) or e.code() in _ACKNOWLEDGED
                if isinstance(e, grpc.aio.AioRpcError):
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self.stats["num_prefill_timeouts"] += 1
                logger.warning(
                    "Prefill %s on %s failed after %.2f s (%s); %s",
                    transfer_id,
                    target.address,
                    time.monotonic() - t0,
                    _describe(e, wait_s),
                    "retrying" if attempt + 1 < len(targets) else "prefilling locally",
                )
                self._fail_transfer(req, transfer_id, target.address, acknowledged=ack)
                continue
            finally:
                self._tokens_at[target.address] -= num_new
            if req.wants_prompt_logprobs and len(resp.prompt_logprobs) != req.num_prompt_tokens - 1:
                # A prefill that does not send them (an older version): never lose them.
                logger.warning(
                    "Prefill %s on %s returned %d prompt logprobs for %d prompt tokens; %s",
                    transfer_id,
                    target.address,
                    len(resp.prompt_logprobs),
                    req.num_prompt_tokens,
                    "retrying" if attempt + 1 < len(targets) else "prefilling locally",
                )
                self._fail_transfer(req, transfer_id, target.address, acknowledged=True)
                continue
            self._learn(target.address, t1 - t0, ahead)
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
            REMOTE_PREFILL_SETUP_SECONDS.observe(timings.remote_setup_s)
            REMOTE_PREFILL_RPC_SECONDS.observe(timings.remote_rpc_s)
            REMOTE_PREFILL_TRANSIT_SECONDS.observe(max(timings.remote_rpc_s - resp.server_s, 0.0))
            timings.kv_wait_s = time.monotonic() - t1
            lp = (
                logprobs_from_proto(resp.first_logprobs)
                if resp.HasField("first_logprobs")
                else None
            )
            logger.debug("Remote prefill %s took %.3f s", transfer_id, time.monotonic() - t0)

            def add(r: Request, resp=resp, lp=lp, tid=transfer_id):
                self.receiver.set_state(tid, TransferState.FINISHED)
                out = self.core.add_remote_prefilled(
                    r, resp.first_token_id, lp, resp.num_cached_tokens
                )
                if r.wants_prompt_logprobs:  # P computed them; the first output carries them
                    out.prompt_logprobs = [None, *map(logprobs_from_proto, resp.prompt_logprobs)]
                return out

            return self.engine.generate(req, add=add)
        return None

    async def _reserve_in_line(self, req: Request, reserve):
        """Blocks for the prompt; while the cache is full the request waits in line (FIFO,
        counted by the queue limits: SchedulerFullError past them) and the engine loop
        reserves its blocks once they are free (`_serve_line`), as the scheduler queues a
        local prompt."""
        granted = asyncio.get_running_loop().create_future()
        self._line[req.request_id] = (reserve, granted)
        alloc = None
        try:
            alloc = await self.engine.call(reserve)
            if alloc is None:
                self.stats["num_queued_for_blocks"] += 1
                alloc = await granted
            return alloc
        finally:
            self._line.pop(req.request_id, None)
            if alloc is None:  # cancelled (the client went away) or refused: leave the line
                self._leave_line(req.request_id)

    def _leave_line(self, request_id: str) -> None:
        task = asyncio.ensure_future(self.engine.call(self.core.stop_awaiting, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _serve_line(self) -> bool:
        """Engine-loop hook: reserve blocks for the requests in line, first first, for as many
        as the free blocks hold now, and hand each its allocation. All in one pass: waking one
        request per engine step let a line formed in a burst (256 prompts at once) drain at one
        prompt per step, no faster than new ones joined it; on one H100 at 256 streams the
        requests then waited 2.9 s on average here with a third of the blocks free
        (bench/README.md, 2026-12-06)."""
        for request in self.core.awaiting_in_order():
            waiter = self._line.get(request.request_id)
            if waiter is None:  # its caller is gone (cancelled); its own stop_awaiting follows
                self.core.stop_awaiting(request.request_id)
                continue
            reserve, granted = waiter
            try:
                alloc = reserve()
            except Exception as e:  # noqa: BLE001 - refused (its tenant's share): raised there
                granted.get_loop().call_soon_threadsafe(_settle, granted, None, e)
                continue
            if alloc is None:
                break
            granted.get_loop().call_soon_threadsafe(_settle, granted, alloc, None)
        return False

    # ---- whom to trust, how long to wait -------------------------------------------------
    def _is_trusted(self, target) -> bool:
        """May this prefill have our KV metadata? (see the module docstring)"""
        if not self.require_registration:
            return True
        try:
            record = InstanceRecord.unseal(target.registration, self.auth)
        except RecordError as e:
            reason = str(e)
        else:
            age_s = time.time() - record.published_at
            if record.role not in ("prefill", "both"):
                reason = f"its record is a {record.role}'s"
            elif record.address != target.address:
                reason = "its record names another address"
            elif target.instance_id and record.instance_id != target.instance_id:
                reason = "its record names another instance"
            elif age_s > MAX_REGISTRATION_AGE_S:
                reason = f"its record is {age_s:.0f} s old"
            else:
                return True
        self.stats["num_rejected_prefill_targets"] += 1
        logger.warning(
            "Not sending KV metadata to prefill %r: registration does not verify (%s)",
            target.address[:100],
            reason,
        )
        return False

    def _wait_s(self, target, num_new_tokens: int) -> float:
        """How long to wait for P's reply: a bound derived from the predicted prefill time of
        `num_new_tokens` (this request's and those of ours P has yet to answer). Counting only
        the request's own let a burst time out at P while P worked through it: 256 prompts
        sent at once on one H100, 29 went back to be prefilled here and waited 12.5 s for it
        (bench/README.md, 2026-12-06)."""
        # The larger of the gateway's prediction (from P's reported rate and queue) and ours
        # (P's measured replies to us): a healthy P should never hit the bound.
        s_per_token = self._s_per_token.get(target.address, _PRIOR_S_PER_TOKEN)
        predicted_s = max(target.predicted_prefill_s, s_per_token * max(num_new_tokens, 1))
        bound_s = max(_WAIT_MIN_S, _WAIT_BASE_S + _WAIT_FACTOR * predicted_s)
        return min(self.prefill_timeout_s, bound_s)

    def _learn(self, address: str, rpc_s: float, num_new_tokens: int) -> None:
        """P's seconds per prompt token, from a reply that took `rpc_s` for `num_new_tokens`
        (the request's and those of ours it had yet to answer)."""
        sample = rpc_s / max(num_new_tokens, 1)
        prev = self._s_per_token.get(address)
        self._s_per_token[address] = sample if prev is None else prev + _RATE_EMA * (sample - prev)

    # ---- failure and fencing -------------------------------------------------------------
    def _fail_transfer(
        self, req: Request, transfer_id: str, address: str, acknowledged: bool
    ) -> None:
        """Quarantine the request's blocks; release now if P acknowledged, else fence."""
        loop = asyncio.get_running_loop()

        def quarantine() -> None:
            self.receiver.forget(transfer_id)
            self.receiver.set_state(transfer_id, TransferState.FAILED)
            key = self.core.quarantine_blocks(req)
            req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
            if acknowledged:
                self.core.release_quarantine(key)
            else:
                args = (key, address, req.request_id, transfer_id)
                loop.call_soon_threadsafe(self._start_fence, *args)

        self.engine.submit(quarantine)

    def _start_fence(self, key: str, address: str, request_id: str, transfer_id: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._fence(key, address, request_id, transfer_id)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fence(self, key: str, address: str, request_id: str, transfer_id: str) -> None:
        """Release quarantined blocks once P acknowledged the abort or is known dead."""
        self.stats["num_fenced_transfers"] += 1
        abort = common_pb2.AbortRequest(request_id=request_id, transfer_id=transfer_id)
        start, backoff_s, has_warned = time.monotonic(), 0.05, False
        while True:
            try:
                await self._stub(address).Abort(abort, timeout=_ABORT_TIMEOUT_S)
                break  # P answered: it replies only once its writes for the transfer settled
            except grpc.aio.AioRpcError as e:
                if e.code() in _ACKNOWLEDGED or _is_refused(e):
                    break  # a process answered (P, or a successor on its port), or none listens
            if not has_warned and time.monotonic() - start > self.lease_s:
                has_warned = True
                logger.warning(
                    "Blocks of transfer %s stay quarantined: prefill %s has not acknowledged "
                    "its abort for %.0f s (stopped or partitioned?); retrying",
                    transfer_id,
                    address,
                    time.monotonic() - start,
                )
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _ABORT_BACKOFF_MAX_S)
        self.engine.submit(lambda: self.core.release_quarantine(key))

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._channels:
            self._channels[address] = prefill_pb2_grpc.PrefillStub(
                internal_auth.internal_channel(address)
            )
        return self._channels[address]


_PRIOR_S_PER_TOKEN = 1e-3  # until measured: 1,000 prompt tokens/s (slow CPU prefill)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the future's loop. A waiter cancelled meanwhile drops its blocks itself
    (`RemotePrefill.run`'s cancellation path quarantines whatever the request holds)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _is_refused(e: grpc.aio.AioRpcError) -> bool:
    """No process listens at the address any more (not: it is slow or stopped)."""
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in details


def _describe(e: BaseException, wait_s: float) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no reply within the {wait_s:.1f} s bound"
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: no KV notification"
