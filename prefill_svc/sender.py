"""The prefill side of a KV hand-off: ship a request's blocks as its chunks finish.

Runs on the engine thread (an `AsyncEngine` hook), which owns the transfer agent.

Per transfer: `PREFILLING` → (all blocks written and flushed, notification sent) `WRITTEN`, or
`FAILED` (peer error, lease expired, request aborted). Every block the prefill has computed is
written as soon as its chunk finishes, so the transfer overlaps the rest of the prompt's
compute. The final write carries the notification `transfer_id:token`; the backend flushes the
endpoint first, so D sees the notification only after all of the KV.
Local blocks stay held (`hold_blocks`) until no WRITE reads them any more.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

from engine.engine_core import EngineCore
from engine.kv_cache_manager import cdiv
from engine.request import Request, RequestStatus
from kv_transfer import Agent, TransferHandle, paired_block_descs

logger = logging.getLogger(__name__)


class SendState(enum.Enum):
    PREFILLING = "prefilling"
    WRITTEN = "written"
    FAILED = "failed"


@dataclass
class KVSend:
    request: Request
    transfer_id: str
    token: str
    remote: str
    dst_block_ids: list[int]  # D's blocks for prompt blocks first_block, first_block+1, ...
    first_block: int
    deadline: float  # lease: no WRITE is issued after this (monotonic)
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    state: SendState = SendState.PREFILLING
    num_sent_blocks: int = 0  # prompt blocks [first_block, first_block + num_sent) issued
    handles: list[TransferHandle] = field(default_factory=list)
    num_bytes: int = 0
    num_descs: int = 0
    start_time: float = field(default_factory=time.monotonic)
    error: str | None = None

    @property
    def num_prompt_blocks(self) -> int:
        return self.first_block + len(self.dst_block_ids)


class KVSender:
    def __init__(self, core: EngineCore, agent: Agent, transfer_timeout_s: float):
        self.core = core
        self.agent = agent
        self.transfer_timeout_s = transfer_timeout_s
        self.sends: dict[str, KVSend] = {}
        self.block_bytes = core.runner.kv_cache[0].nbytes
        self.total_bytes = 0

    def start(self, send: KVSend) -> None:
        assert send.request.hold_blocks
        self.sends[send.request.request_id] = send

    def fail(self, request_id: str, reason: str) -> None:
        send = self.sends.get(request_id)
        if send is not None and send.state is SendState.PREFILLING:
            send.state, send.error = SendState.FAILED, reason

    def fail_matching(self, prefix: str, reason: str) -> None:
        """Fail every send whose request id starts with `prefix`: no new WRITE is issued."""
        for request_id in [r for r in self.sends if r.startswith(prefix)]:
            self.fail(request_id, reason)

    def done_futures(self, prefix: str) -> list[asyncio.Future]:
        """The `done` futures of the matching sends: each resolves once the send settled (no
        WRITE of it in flight any more; see `_settle`)."""
        return [s.done for r, s in self.sends.items() if r.startswith(prefix)]

    def poll(self) -> bool:
        """The hook: issue writes for newly computed blocks, settle finished sends."""
        for rid, send in list(self.sends.items()):
            try:
                self._advance(send)
            except Exception as e:  # noqa: BLE001 - the send fails, the error goes to the caller
                logger.exception("KV send %s failed", send.transfer_id)
                send.state, send.error = SendState.FAILED, f"{type(e).__name__}: {e}"
            if self._settle(send):
                del self.sends[rid]
        return bool(self.sends)

    def _advance(self, send: KVSend) -> None:
        if send.state is not SendState.PREFILLING:
            return
        r = send.request
        if r.status is RequestStatus.FINISHED_ABORTED:
            send.state, send.error = SendState.FAILED, "request aborted"
            return
        if time.monotonic() > send.deadline:
            send.state, send.error = SendState.FAILED, "lease expired before the KV was written"
            return
        if any(h.poll() == "ERR" for h in send.handles):
            errors = [h.error for h in send.handles if h.error]
            send.state, send.error = SendState.FAILED, f"KV write failed: {errors[0]}"
            return
        bs = self.core.config.cache.block_size
        computed = r.num_computed_tokens
        ready = cdiv(computed, bs) if computed >= r.num_prompt_tokens else computed // bs
        ready = min(ready, send.num_prompt_blocks)
        if ready < send.num_prompt_blocks:
            self._write(send, ready, notif=None)  # every computed block, as its chunk finishes
        elif send.first_block + send.num_sent_blocks < send.num_prompt_blocks:
            # The rest, with the notification: the backend flushes the endpoint (all earlier
            # WRITEs too) before sending it, so D sees it only after all of the KV.
            notif = f"{send.transfer_id}:{send.token}".encode()
            self._write(send, send.num_prompt_blocks, notif=notif)
        elif all(h.poll() == "DONE" for h in send.handles):
            send.state = SendState.WRITTEN

    def _write(self, send: KVSend, upto_block: int, notif: bytes | None) -> None:
        start = send.first_block + send.num_sent_blocks
        if upto_block <= start:
            return
        local_ids = self.core.kv.get_block_ids(send.request.request_id)[start:upto_block]
        remote_ids = send.dst_block_ids[start - send.first_block : upto_block - send.first_block]
        local, remote = paired_block_descs(local_ids, remote_ids, [self.block_bytes])
        handle = self.agent.write(local, send.remote, remote, notif=notif)
        send.handles.append(handle)
        send.num_sent_blocks += upto_block - start
        send.num_bytes += handle.num_bytes
        send.num_descs += handle.num_descs

    def _settle(self, send: KVSend) -> bool:
        """Finished sends release their blocks once no WRITE is in flight; True when gone."""
        if send.state is SendState.PREFILLING:
            return False
        in_flight = [h for h in send.handles if h.poll() == "PROC"]
        if in_flight:
            if time.monotonic() - send.start_time < self.transfer_timeout_s:
                return False
            for h in in_flight:  # gives up on the peer: the handle ends in ERR
                h.wait(0)
        if send.request.is_finished:
            self.core.release_blocks(send.request)
        elif send.state is SendState.FAILED:
            self.core.abort_request(send.request.request_id)
            self.core.release_blocks(send.request)
        if send.state is SendState.WRITTEN:
            self.total_bytes += send.num_bytes
        result = (send.state, send.error)
        send.loop.call_soon_threadsafe(_resolve, send.done, result)
        return True


def _resolve(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)
