"""The UCX backend's transfer request state machine and notification inbox.

A request moves FLUSH -> (NOTIFY) -> DONE; any UCX error or `fail()` ends it in ERR. The
notification is tag-sent only once the flush has completed, i.e. once every PUT is visible in
the peer's memory (or every GET in ours). A request given up on while UCX still owns one of its
operations hands that operation to the backend (`orphan`), which frees it on completion;
the notification payload travels with it so its buffer outlives the send.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import TYPE_CHECKING

from kv_transfer import ucp_ctypes as ucp
from kv_transfer.backend import XferRequest, XferState

if TYPE_CHECKING:
    from kv_transfer.ucx import UcxBackend

logger = logging.getLogger(__name__)

_NOTIF_TAG = 0x5444_4D4B_5654_0001  # "TDMKVT" + 1: tag of every notification message
_MAGIC = b"TKV1"
_HEADER = struct.Struct("<4sH")  # magic, sender name length


class UcxRequest(XferRequest):
    def __init__(
        self,
        backend: UcxBackend | None,
        remote: str,
        ep: int | None,
        flush_req: int | None,
        payload: bytes | None,
    ) -> None:
        self._backend = backend
        self.remote = remote
        self._ep = ep
        self._req = flush_req  # the UCX operation we are waiting on, if any
        self._payload = payload  # encoded notification, sent after the flush
        self._is_flushed = False
        self._state = XferState.PROC
        self.error: str | None = None

    @classmethod
    def failed(cls, remote: str, reason: str) -> UcxRequest:
        req = cls(None, remote, None, None, None)
        req._state, req.error = XferState.ERR, reason
        return req

    def poll(self) -> XferState:
        if self._state is XferState.PROC:
            assert self._backend is not None
            self._backend.progress()  # advances every in-flight request, this one included
        return self._state

    def advance(self) -> XferState:
        """Step the state machine without progressing the worker (the backend does that)."""
        while self._state is XferState.PROC:
            if self._req is not None:
                status = ucp.request_status(self._req)
                if status == ucp.UCS_INPROGRESS:
                    return self._state
                ucp.request_free(self._req)
                self._req = None
                if status != ucp.UCS_OK:
                    stage = "notification" if self._is_flushed else "flush"
                    self._finish_err(
                        f"{stage} to {self.remote!r} failed: {ucp.status_string(status)}"
                    )
                    break
            if not self._is_flushed:
                self._is_flushed = True
                if self._payload is not None:
                    assert self._ep is not None
                    try:
                        self._req = ucp.tag_send(self._ep, self._payload, _NOTIF_TAG)
                    except ucp.UcxError as e:
                        self._finish_err(f"notification to {self.remote!r} failed: {e}")
                    continue
            self._state = XferState.DONE
        return self._state

    def fail(self, reason: str) -> None:
        if self._state is not XferState.PROC:
            return
        if self._req is not None:
            assert self._backend is not None
            self._backend.orphan(self._req, self._payload)
            self._req = None
        self._finish_err(reason)

    def _finish_err(self, reason: str) -> None:
        self._state, self.error = XferState.ERR, reason


class NotifInbox:
    """Receives notification messages (any sender) from the worker's unexpected-tag queue."""

    def __init__(self, worker: int) -> None:
        self._worker = worker
        self._receiving: list[tuple[ctypes.Array, int | None]] = []  # in arrival order
        self._ready: list[tuple[str, bytes]] = []

    @staticmethod
    def encode(sender: str, notif: bytes) -> bytes:
        name = sender.encode()
        return _HEADER.pack(_MAGIC, len(name)) + name + bytes(notif)

    def poll(self) -> None:
        while (got := ucp.tag_try_recv(self._worker, _NOTIF_TAG)) is not None:
            self._receiving.append(got)
        while self._receiving:  # deliver in arrival order: stop at the first incomplete one
            buf, req = self._receiving[0]
            if req is not None:
                status = ucp.request_status(req)
                if status == ucp.UCS_INPROGRESS:
                    return
                ucp.request_free(req)
                if status != ucp.UCS_OK:
                    raise ucp.UcxError("notification receive", status)
            self._receiving.pop(0)
            self._deliver(buf.raw)

    def _deliver(self, msg: bytes) -> None:
        if len(msg) < _HEADER.size or msg[:4] != _MAGIC:
            logger.error(
                "dropping a %d-byte message with the notification tag: bad header", len(msg)
            )
            return
        _, name_len = _HEADER.unpack_from(msg)
        name = msg[_HEADER.size : _HEADER.size + name_len].decode()
        self._ready.append((name, msg[_HEADER.size + name_len :]))

    def take(self) -> list[tuple[str, bytes]]:
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        for _, req in self._receiving:
            if req is not None:
                ucp.request_free(req)  # buffers stay referenced here until the worker is gone
