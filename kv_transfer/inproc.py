"""In-process backend: agents in one process, bytes moved with torch copies.

For unit tests of everything above the transport (engine, services) without UCX. Same contract
as the UCX backend (`backend.py`); a transfer completes inside `post`, so a request is DONE at
its first poll. A peer "dies" when its agent is closed: later transfers to it end in ERR.
"""

from __future__ import annotations

import uuid

import torch

from kv_transfer.backend import TransferBackend, XferOp, XferRequest, XferState
from kv_transfer.descriptors import Desc
from kv_transfer.metadata import AgentMetadata, own_identity

# name -> live backend. Agents find each other here; the metadata's token tells a restarted
# agent of the same name from the one that was connected.
_LIVE: dict[str, InprocBackend] = {}


class _DoneRequest(XferRequest):
    def __init__(self, remote: str, error: str | None) -> None:
        self.remote = remote
        self.error = error

    def poll(self) -> XferState:
        return XferState.ERR if self.error is not None else XferState.DONE

    def fail(self, reason: str) -> None:
        pass  # already terminal


class InprocBackend(TransferBackend):
    def __init__(self, name: str) -> None:
        if name in _LIVE:
            raise ValueError(f"an inproc agent named {name!r} already exists in this process")
        self.name = name
        self._token = uuid.uuid4().bytes
        self._regions: list[torch.Tensor] = []  # flat uint8 views of the registered tensors
        self._peers: dict[str, bytes] = {}  # name -> token seen in its metadata
        self._dead: dict[str, str] = {}  # name -> why it was marked dead
        self._notifs: list[tuple[str, bytes]] = []
        _LIVE[name] = self

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            assert t.device.type == "cpu", "the inproc backend copies CPU memory only"
            self._regions.append(t.reshape(-1).view(torch.uint8))

    def blob(self) -> bytes:
        return self._token

    def connect(self, meta: AgentMetadata) -> None:
        host, pid, _ = own_identity()
        if (meta.host_id, meta.pid) != (host, pid):
            raise ValueError(f"inproc agent {meta.name!r} lives in another process")
        self._peers[meta.name] = meta.backend_blob
        self._dead.pop(meta.name, None)

    def disconnect(self, name: str) -> None:
        del self._peers[name]
        self._dead.pop(name, None)

    def mark_dead(self, name: str, reason: str) -> None:
        assert name in self._peers
        self._dead.setdefault(name, reason)

    def _live_peer(self, name: str) -> InprocBackend | None:
        peer = _LIVE.get(name)
        if peer is None or peer._token != self._peers[name]:
            return None
        return peer

    def post(
        self,
        op: XferOp,
        remote: str,
        local_descs: list[Desc],
        remote_descs: list[Desc],
        notif: bytes | None,
    ) -> XferRequest:
        if remote in self._dead:
            return _DoneRequest(remote, self._dead[remote])
        peer = self._live_peer(remote)
        if peer is None:
            return _DoneRequest(remote, f"peer {remote!r} is gone (agent closed)")
        for ld, rd in zip(local_descs, remote_descs, strict=True):
            local = self._regions[ld.region][ld.offset_bytes : ld.offset_bytes + ld.length_bytes]
            far = peer._regions[rd.region][rd.offset_bytes : rd.offset_bytes + rd.length_bytes]
            if op is XferOp.WRITE:
                far.copy_(local)
            else:
                local.copy_(far)
        if notif is not None:
            peer._notifs.append((self.name, bytes(notif)))
        return _DoneRequest(remote, None)

    def progress(self) -> None:
        pass

    def take_notifs(self) -> list[tuple[str, bytes]]:
        notifs, self._notifs = self._notifs, []
        return notifs

    def close(self) -> None:
        if _LIVE.get(self.name) is self:
            del _LIVE[self.name]
        self._regions.clear()
