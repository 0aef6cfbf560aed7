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
# Notifications are `transfer_id:token` from a named agent: a few hundred bytes. Anything longer
# is received truncated (UCX then completes it with an error) and dropped, so a hostile peer
# cannot make us allocate what it likes.
MAX_NOTIF_BYTES = 4096


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
    """Receives notification messages (any sender) from the worker's unexpected-tag queue.

    Every message that reaches the worker is untrusted input: a message with another tag, a
    bad header, a sender name that is not UTF-8, or over `MAX_NOTIF_BYTES` is taken off the
    queue, counted in `num_rejected` and dropped (logged once per kind); nothing here raises
    on what a peer sent, so no message can stop the loop that polls us.
    """

    def __init__(self, worker: int) -> None:
        self._worker = worker
        # (buffer, request or None, has the notification tag, status if done), arrival order
        self._receiving: list[tuple[ctypes.Array, int | None, bool, int]] = []
        self._ready: list[tuple[str, bytes]] = []
        self.num_rejected = 0
        self._logged: set[str] = set()

    @staticmethod
    def encode(sender: str, notif: bytes) -> bytes:
        name = sender.encode()
        return _HEADER.pack(_MAGIC, len(name)) + name + bytes(notif)

    def poll(self) -> None:
        # Any tag: messages with tags nobody receives would otherwise pile up in UCX forever.
        while (got := ucp.tag_try_recv(self._worker, 0, 0, MAX_NOTIF_BYTES)) is not None:
            buf, req, sender_tag, status = got
            self._receiving.append((buf, req, sender_tag == _NOTIF_TAG, status))
        while self._receiving:  # deliver in arrival order: stop at the first incomplete one
            buf, req, is_notif, status = self._receiving[0]
            if req is not None:
                status = ucp.request_status(req)
                if status == ucp.UCS_INPROGRESS:
                    return
                ucp.request_free(req)
            self._receiving.pop(0)
            if not is_notif:
                self._reject("a message with an unknown tag")
            elif status != ucp.UCS_OK:  # truncated (too long) or broken
                self._reject(f"a notification that failed to arrive ({ucp.status_string(status)})")
            else:
                self._deliver(buf.raw)

    def _deliver(self, msg: bytes) -> None:
        if len(msg) < _HEADER.size or msg[:4] != _MAGIC:
            self._reject("a notification with a bad header")
            return
        _, name_len = _HEADER.unpack_from(msg)
        end = _HEADER.size + name_len
        try:
            name = msg[_HEADER.size : end].decode()
        except UnicodeDecodeError:
            self._reject("a notification whose sender name is not UTF-8")
            return
        if not name or end > len(msg):
            self._reject("a notification with a truncated sender name")
            return
        self._ready.append((name, msg[end:]))

    def _reject(self, what: str) -> None:
        self.num_rejected += 1
        if what not in self._logged:  # once per kind: a flood must not flood the log too
            self._logged.add(what)
            logger.warning("Dropped %s (counted in num_rejected; further ones not logged)", what)

    def take(self) -> list[tuple[str, bytes]]:
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        for _, req, _, _ in self._receiving:
            if req is not None:
                ucp.request_free(req)  # buffers stay referenced here until the worker is gone
