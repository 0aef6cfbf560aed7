"""The transfer agent: NIXL-style register / exchange metadata / WRITE-READ / notify.

Lifecycle on the prefill (P) and decode (D) side of one KV hand-off:

    D: agent.register_memory(kv_tensors); send agent.get_agent_metadata() to P (control plane)
    P: name = agent.add_remote_agent(d_metadata)
    P: h = agent.write(local_descs, name, remote_descs, notif=transfer_id)   # one-sided
    P: h.wait(timeout_s) == "DONE"  -> the bytes are in D's blocks
    D: agent.get_notifs()[p_name] contains transfer_id, delivered only after the bytes landed

Nothing runs in the background: `poll`, `wait`, `get_notifs` and `progress` drive the transport,
so a process that receives notifications must call one of them regularly (its engine loop).

All input is validated here, once, for every backend: descriptors must lie inside registered
regions (local ones inside ours, remote ones inside the regions the peer's metadata lists) and
pair up with equal lengths; errors raise ValueError naming the offending descriptor. Transport
and peer failures do not raise: they end the handle in ERR with a reason (`handle.error`).

Dead peers: `handle.wait(timeout_s)` never waits longer than `timeout_s` and turns a timeout
into ERR; `mark_peer_dead(name)` (from the control plane, e.g. a failed heartbeat) ends every
in-flight transfer to that peer in ERR and makes later ones fail at once, until the peer is
added again with fresh metadata. A backend may also detect death itself (see `ucx.py`).
After ERR the destination range is undefined: the owner must not trust those blocks, and a
READ's local blocks must not be reused until the peer is marked dead (which cancels its ops).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import torch

from kv_transfer.backend import TransferBackend, XferOp, XferRequest, XferState
from kv_transfer.descriptors import Desc
from kv_transfer.metadata import AgentMetadata, own_identity

BACKENDS = ("ucx", "inproc")


class TransferHandle:
    """One WRITE or READ. States: "PROC" (in flight), "DONE", "ERR" (see `error`)."""

    def __init__(self, request: XferRequest, op: XferOp, num_bytes: int, num_descs: int) -> None:
        self._request = request
        self.op = op
        self.remote = request.remote
        self.num_bytes = num_bytes
        self.num_descs = num_descs

    @property
    def error(self) -> str | None:
        return self._request.error

    def poll(self) -> XferState:
        """Advance without blocking. XferState is a str: compare with "DONE" etc."""
        return self._request.poll()

    def wait(self, timeout_s: float) -> XferState:
        """Poll until DONE or ERR; after `timeout_s` give up and end in ERR (never hangs)."""
        deadline = time.monotonic() + timeout_s
        while (state := self._request.poll()) is XferState.PROC:
            if time.monotonic() >= deadline:
                self._request.fail(
                    f"{self.op.value} to {self.remote!r} timed out after {timeout_s} s"
                )
                return XferState.ERR
        return state


class Agent:
    def __init__(
        self,
        name: str,
        backend: str = "ucx",
        *,
        peer_error_handling: bool = False,
        net_devices: str | None = None,
    ):
        """`peer_error_handling` (UCX only): let UCX detect dead peers itself, at the cost of
        one-sided RMA (see `ucx.py`). Off by default: the peer-process check covers one host.
        `net_devices` (UCX only): the network devices UCX may use and listen on, e.g. "lo" or
        "eth1" (UCX_NET_DEVICES); None: all of them."""
        if not name:
            raise ValueError("agent name must be non-empty")
        self.name = name
        self.backend_name = backend
        self._backend = self._make_backend(name, backend, peer_error_handling, net_devices)
        self._tensors: list[torch.Tensor] = []  # keeps registered memory alive
        self._remotes: dict[str, AgentMetadata] = {}

    @staticmethod
    def _make_backend(
        name: str, backend: str, peer_error_handling: bool, net_devices: str | None
    ) -> TransferBackend:
        if backend == "ucx":
            from kv_transfer.ucx import UcxBackend

            return UcxBackend(
                name, peer_error_handling=peer_error_handling, net_devices=net_devices
            )
        if backend == "inproc":
            from kv_transfer.inproc import InprocBackend

            return InprocBackend(name)
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")

    def register_memory(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register regions; they get the next indices. Peers need fresh metadata afterwards."""
        for i, t in enumerate(tensors):
            if not t.is_contiguous() or t.nbytes == 0:
                raise ValueError(
                    f"tensor {i}: only non-empty contiguous tensors can be "
                    f"registered (shape {tuple(t.shape)}, strides {t.stride()})"
                )
        self._backend.register(list(tensors))
        self._tensors.extend(tensors)

    def get_agent_metadata(self) -> bytes:
        host, pid, ticks = own_identity()
        return AgentMetadata(
            name=self.name,
            backend=self.backend_name,
            host_id=host,
            pid=pid,
            pid_start_ticks=ticks,
            region_addrs=tuple(t.data_ptr() for t in self._tensors),
            region_nbytes=tuple(t.nbytes for t in self._tensors),
            backend_blob=self._backend.blob(),
        ).to_bytes()

    def add_remote_agent(self, metadata: bytes) -> str:
        """Connect to a peer; a known name is replaced (e.g. the peer restarted)."""
        meta = AgentMetadata.from_bytes(metadata)
        if meta.backend != self.backend_name:
            raise ValueError(
                f"remote agent {meta.name!r} uses backend {meta.backend!r}, "
                f"this agent {self.backend_name!r}"
            )
        if meta.name == self.name:
            raise ValueError(f"remote agent has this agent's own name {meta.name!r}")
        self._backend.connect(meta)
        self._remotes[meta.name] = meta
        return meta.name

    def remove_remote_agent(self, name: str) -> None:
        """Forget a peer; transfers to it still in flight end in ERR."""
        self._check_remote(name)
        self._backend.disconnect(name)
        del self._remotes[name]

    def mark_peer_dead(self, name: str, reason: str = "marked dead by the control plane") -> None:
        self._check_remote(name)
        self._backend.mark_dead(name, reason)

    def write(
        self,
        local_descs: Sequence[Desc],
        remote_name: str,
        remote_descs: Sequence[Desc],
        notif: bytes | None = None,
    ) -> TransferHandle:
        """Copy local ranges into the peer's; `notif` reaches it after the bytes do."""
        return self._post(XferOp.WRITE, local_descs, remote_name, remote_descs, notif)

    def read(
        self,
        local_descs: Sequence[Desc],
        remote_name: str,
        remote_descs: Sequence[Desc],
        notif: bytes | None = None,
    ) -> TransferHandle:
        """Copy the peer's ranges into local ones; `notif` reaches it once they are read."""
        return self._post(XferOp.READ, local_descs, remote_name, remote_descs, notif)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, per sender name, in arrival order."""
        notifs: dict[str, list[bytes]] = {}
        for sender, payload in self._backend.take_notifs():
            notifs.setdefault(sender, []).append(payload)
        return notifs

    def progress(self) -> None:
        self._backend.progress()

    @property
    def num_rejected_messages(self) -> int:
        """Malformed or unexpected messages peers sent us: dropped, never raised."""
        return self._backend.num_rejected_messages

    def close(self) -> None:
        """Release the backend; in-flight transfers end in ERR."""
        self._backend.close()
        self._remotes.clear()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_remote(self, name: str) -> AgentMetadata:
        meta = self._remotes.get(name)
        if meta is None:
            raise ValueError(f"unknown remote agent {name!r}; known: {sorted(self._remotes)}")
        return meta

    def _post(
        self,
        op: XferOp,
        local_descs: Sequence[Desc],
        remote_name: str,
        remote_descs: Sequence[Desc],
        notif: bytes | None,
    ) -> TransferHandle:
        meta = self._check_remote(remote_name)
        if len(local_descs) != len(remote_descs):
            raise ValueError(f"{len(local_descs)} local descriptors vs {len(remote_descs)} remote")
        if notif is not None and not isinstance(notif, bytes):
            raise ValueError(f"notif must be bytes, got {type(notif).__name__}")
        local_nbytes = [t.nbytes for t in self._tensors]
        local = [
            _checked(d, local_nbytes, f"local descriptor {i}") for i, d in enumerate(local_descs)
        ]
        remote = [
            _checked(d, meta.region_nbytes, f"remote descriptor {i} ({remote_name!r})")
            for i, d in enumerate(remote_descs)
        ]
        for i, (ld, rd) in enumerate(zip(local, remote)):
            if ld.length_bytes != rd.length_bytes:
                raise ValueError(
                    f"descriptor pair {i}: local length {ld.length_bytes} != "
                    f"remote length {rd.length_bytes}"
                )
        request = self._backend.post(op, remote_name, local, remote, notif)
        return TransferHandle(request, op, sum(d.length_bytes for d in local), len(local))


def _checked(desc: Sequence[int], region_nbytes: Sequence[int], what: str) -> Desc:
    try:
        d = Desc(*(operator.index(x) for x in desc))
    except TypeError as e:
        raise ValueError(
            f"{what}: expected (region, offset_bytes, length_bytes) ints, got {desc!r}"
        ) from e
    if not 0 <= d.region < len(region_nbytes):
        raise ValueError(f"{what}: region {d.region} out of range ({len(region_nbytes)} regions)")
    if d.offset_bytes < 0 or d.length_bytes <= 0:
        raise ValueError(f"{what}: bad offset/length {d.offset_bytes}/{d.length_bytes}")
    if d.offset_bytes + d.length_bytes > region_nbytes[d.region]:
        raise ValueError(
            f"{what}: [{d.offset_bytes}, {d.offset_bytes + d.length_bytes}) exceeds "
            f"region {d.region} of {region_nbytes[d.region]} bytes"
        )
    return d
