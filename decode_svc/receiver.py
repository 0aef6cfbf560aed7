"""The decode side of a KV hand-off: D owns the destination blocks.

Transfer states: `ALLOCATED` (blocks reserved here) → `PREFILLING` (P is computing and
writing) → `WRITTEN` (P replied and its notification `transfer_id:token` arrived) →
`DECODING` → `FINISHED`; or `FAILED` at any point before DECODING.

Blocks a remote writer may still write are never reused: on a failure they are quarantined
until P acknowledged (it replied with an error: it only replies once its writes have settled),
or, when P is dead or silent, until the lease expires.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

from kv_transfer import Agent

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    ALLOCATED = "allocated"
    PREFILLING = "prefilling"
    WRITTEN = "written"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


class KVReceiver:
    """Runs on the engine thread (hook); collects notifications for the transfers it awaits."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.expected: dict[str, str] = {}  # transfer_id -> token
        self.arrived: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.states: dict[str, TransferState] = {}
        self.num_bad_notifs = 0

    def expect(self, transfer_id: str, token: str, loop, fut: asyncio.Future) -> None:
        self.expected[transfer_id] = token
        self.arrived[transfer_id] = (loop, fut)
        self.states[transfer_id] = TransferState.PREFILLING

    def forget(self, transfer_id: str) -> None:
        self.expected.pop(transfer_id, None)
        self.arrived.pop(transfer_id, None)

    def set_state(self, transfer_id: str, state: TransferState) -> None:
        if state in (TransferState.FINISHED, TransferState.FAILED):
            self.states.pop(transfer_id, None)
        else:
            self.states[transfer_id] = state

    def poll(self) -> bool:
        self.agent.progress()
        for sender, notifs in self.agent.get_notifs().items():
            for payload in notifs:
                transfer_id, _, token = payload.decode(errors="replace").partition(":")
                if self.expected.get(transfer_id) != token:
                    # Not a transfer we introduced a peer for, or the wrong secret: ignore it.
                    self.num_bad_notifs += 1
                    logger.warning("Ignoring unexpected KV notification from %s", sender)
                    continue
                loop, fut = self.arrived.pop(transfer_id)
                del self.expected[transfer_id]
                loop.call_soon_threadsafe(_resolve, fut, time.monotonic())
        return bool(self.expected)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
