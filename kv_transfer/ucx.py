"""UCX backend: one-sided PUT/GET of registered memory through ucxx + ctypes into libucp.

Choice: `ucxx-cu12` (not `nixl-cu12`). ucxx gives us the UCP context and worker; the RMA calls
it lacks (mem_map, rkey pack/unpack, put/get/flush, endpoint create/close, tag send/probe) go
through `ucp_ctypes.py`. This keeps the data path to one C call per descriptor, with no
background thread and no C++ agent between us and UCX; NIXL would work too (FACTS.md) but adds
a 60 MB dependency and prefix-matched notifications.

Data path: `post` issues one `ucp_put_nbx`/`ucp_get_nbx` per descriptor (requests released at
once) and one `ucp_ep_flush_nbx`; flush completion means every byte is at its destination.
Only then is the notification tag-sent (flush before notify). Nobody runs a progress thread:
`progress()` (called by `poll`, `wait`, `get_notifs`) drives the worker and every request.

Dead peers. With endpoint error handling off (the default, `peer_error_handling=False`), UCX
picks cma (process_vm_writev) for RMA on one host: truly one-sided (a SIGSTOPped target does not
delay a WRITE) and 4-9 GB/s here. The price: UCX treats an RMA failure on such an endpoint as
fatal and aborts the process (measured: a peer killed while a 64 MiB WRITE to it is queued).
That cannot be caught, so it is avoided: before each post we check that the peer process (pid
and start time from its metadata; same host only) still exists, so a peer that died between
transfers yields ERR handles, never an abort; `Agent.mark_peer_dead` does the same on the
control plane's word (the only way for peers on other hosts). Residual risk: a peer that dies
*while* our operations to it are queued still takes this process down. Such an endpoint cannot
be force-closed (UCX refuses), so a dead peer's endpoint is parked, never touched again.
With `peer_error_handling=True` (UCX_MM_ERROR_HANDLING=y, error mode PEER, keepalive 1 s), UCX
completes requests with errors instead, and the liveness check in `progress()` ends a dead
peer's transfers within ~2 ms. But UCX then never picks cma for RMA lanes: RMA is emulated
with messages over shared memory, so the target must call `progress()` for data to land, and
throughput is noisy (first transfer ~0.3 GB/s, then 1-10 GB/s).
"""

from __future__ import annotations

import struct
import time

import torch

from kv_transfer import ucp_ctypes as ucp
from kv_transfer.backend import TransferBackend, XferOp, XferRequest, XferState
from kv_transfer.descriptors import Desc
from kv_transfer.metadata import AgentMetadata
from kv_transfer.ucx_request import NotifInbox, UcxRequest

_LIVENESS_PERIOD_S = 0.002
_CLOSE_TIMEOUT_S = 0.5
_MAX_PROGRESS_CALLS = 32  # bound one progress() slice (one call moves <= one 512 KiB cma segment)


class _Peer:
    def __init__(self, meta: AgentMetadata, ep: int, rkeys: list[int]) -> None:
        self.meta = meta
        self.ep: int | None = ep
        self.rkeys = rkeys
        self.dead_reason: str | None = None
        self.inflight: set[UcxRequest] = set()
        self.next_liveness_check_s = 0.0


def _pack_blob(worker_address: bytes, rkeys: list[bytes]) -> bytes:
    parts = [struct.pack("<II", len(worker_address), len(rkeys)), worker_address]
    for rkey in rkeys:
        parts += [struct.pack("<I", len(rkey)), rkey]
    return b"".join(parts)


def _unpack_blob(blob: bytes) -> tuple[bytes, list[bytes]]:
    addr_len, num_rkeys = struct.unpack_from("<II", blob)
    pos = 8 + addr_len
    address, rkeys = blob[8:pos], []
    for _ in range(num_rkeys):
        (n,) = struct.unpack_from("<I", blob, pos)
        rkeys.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if pos != len(blob):
        raise ValueError("malformed UCX metadata blob")
    return address, rkeys


class UcxBackend(TransferBackend):
    def __init__(
        self, name: str, peer_error_handling: bool = False, net_devices: str | None = None
    ) -> None:
        from ucxx._lib import libucxx

        self.name = name
        self.peer_error_handling = peer_error_handling
        # MM_ERROR_HANDLING lets shared-memory transports serve error-handling endpoints (else
        # those fall back to TCP at ~0.4 GB/s); it does not change endpoints without it.
        # WARN_UNUSED_ENV_VARS: ucxx exports UCX_MEMTYPE_CACHE, which UCX 1.21 warns about.
        config = {"MM_ERROR_HANDLING": "y", "KEEPALIVE_INTERVAL": "1s", "WARN_UNUSED_ENV_VARS": "n"}
        if net_devices:
            # UCX opens a TCP listener on every network device it may use (all by default, so
            # the external interface too). NET_DEVICES narrows TCP/RDMA to these; shared memory
            # (sysv, posix, cma) and self are no network devices and stay available.
            config["NET_DEVICES"] = net_devices
        features = (libucxx.Feature.TAG, libucxx.Feature.RMA)
        self._ctx = libucxx.UCXContext(config_dict=config, feature_flags=features)
        self._worker = libucxx.UCXWorker(self._ctx)
        self._ctx_h: int = self._ctx.handle
        self._worker_h: int = self._worker.handle
        self._region_addrs: list[int] = []
        self._memhs: list[int] = []
        self._memh_params: list[object] = []  # per region, reused by every RMA from it
        self._packed_rkeys: list[bytes] = []
        self._peers: dict[str, _Peer] = {}
        self._orphans: list[tuple[int, object]] = []  # (ucx request, what it keeps alive)
        self._parked: list[tuple[int, list[int]]] = []  # (endpoint, rkeys) of dropped peers
        self._is_closed = False
        self._inbox = NotifInbox(self._worker_h)

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            memh = ucp.mem_map(self._ctx_h, t.data_ptr(), t.nbytes)
            self._region_addrs.append(t.data_ptr())
            self._memhs.append(memh)
            self._memh_params.append(ucp.memh_param(memh))
            self._packed_rkeys.append(ucp.rkey_pack(self._ctx_h, memh))

    def blob(self) -> bytes:
        return _pack_blob(bytes(self._worker.address), self._packed_rkeys)

    def connect(self, meta: AgentMetadata) -> None:
        address, packed = _unpack_blob(meta.backend_blob)
        if len(packed) != len(meta.region_addrs):
            raise ValueError(
                f"metadata of {meta.name!r}: {len(packed)} rkeys for "
                f"{len(meta.region_addrs)} regions"
            )
        if meta.name in self._peers:
            self.disconnect(meta.name)
        ep = ucp.ep_create(self._worker_h, address, self.peer_error_handling)
        rkeys = [ucp.rkey_unpack(ep, p) for p in packed]
        self._peers[meta.name] = _Peer(meta, ep, rkeys)

    def disconnect(self, name: str) -> None:
        peer = self._peers.pop(name)
        # Without a flush: the peer is gone, or ops to it are still queued (cancel them).
        force = bool(peer.inflight) or peer.dead_reason is not None
        force = force or not peer.meta.is_process_alive()
        self._fail_inflight(peer, f"remote agent {name!r} was removed during the transfer")
        self._close_ep(peer, force)

    def mark_dead(self, name: str, reason: str) -> None:
        peer = self._peers[name]
        if peer.dead_reason is None:
            peer.dead_reason = reason
        self._fail_inflight(peer, reason)
        self._close_ep(peer, force=True)

    def _fail_inflight(self, peer: _Peer, reason: str) -> None:
        for req in list(peer.inflight):
            req.fail(reason)
        peer.inflight.clear()

    def _close_ep(self, peer: _Peer, force: bool) -> None:
        if peer.ep is None:
            return
        ep, rkeys, peer.ep, peer.rkeys = peer.ep, peer.rkeys, None, []
        if force and not self.peer_error_handling:
            # UCX refuses to force-close an endpoint without error handling, and a flushing
            # close would touch the dead peer now. Park it (and the rkeys queued ops may still
            # use) until close().
            self._parked.append((ep, rkeys))
            return
        for rkey in rkeys:
            ucp.rkey_destroy(rkey)
        self._wait_or_orphan(ucp.ep_close(ep, force))

    def _wait_or_orphan(self, req: int | None) -> None:
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while req is not None and ucp.request_status(req) == ucp.UCS_INPROGRESS:
            if time.monotonic() > deadline:
                self._orphans.append((req, None))  # a live-but-stuck peer: finish later
                return
            ucp.worker_progress(self._worker_h)
        if req is not None:
            ucp.request_free(req)

    def orphan(self, req: int, keepalive: object) -> None:
        """Take over a UCX request its owner gave up on; free it once UCX completes it."""
        self._orphans.append((req, keepalive))

    def post(
        self,
        op: XferOp,
        remote: str,
        local_descs: list[Desc],
        remote_descs: list[Desc],
        notif: bytes | None,
    ) -> XferRequest:
        peer = self._peers[remote]
        if peer.dead_reason is None and not peer.meta.is_process_alive():
            self.mark_dead(remote, f"peer {remote!r} (pid {peer.meta.pid}) has exited")
        if peer.dead_reason is not None:
            return UcxRequest.failed(remote, peer.dead_reason)
        assert peer.ep is not None
        raddrs, rkeys = peer.meta.region_addrs, peer.rkeys
        ops = (
            (
                self._region_addrs[ld.region] + ld.offset_bytes,
                ld.length_bytes,
                raddrs[rd.region] + rd.offset_bytes,
                rkeys[rd.region],
                self._memh_params[ld.region],
            )
            for ld, rd in zip(local_descs, remote_descs, strict=True)
        )
        try:
            ucp.post_rma(op is XferOp.WRITE, peer.ep, ops)
            flush_req = ucp.ep_flush(peer.ep)
        except ucp.UcxError as e:  # a failed endpoint (error handling on): report, keep going
            return UcxRequest.failed(remote, f"{op.value} to {remote!r} failed: {e}")
        payload = None if notif is None else self._inbox.encode(self.name, notif)
        req = UcxRequest(self, remote, peer.ep, flush_req, payload)
        peer.inflight.add(req)
        return req

    def progress(self) -> None:
        for _ in range(_MAX_PROGRESS_CALLS):
            if not ucp.worker_progress(self._worker_h):
                break
        now = time.monotonic()
        for name, peer in list(self._peers.items()):
            if not peer.inflight:
                continue
            if peer.dead_reason is None and now >= peer.next_liveness_check_s:
                peer.next_liveness_check_s = now + _LIVENESS_PERIOD_S
                if not peer.meta.is_process_alive():
                    self.mark_dead(name, f"peer {name!r} (pid {peer.meta.pid}) has exited")
                    continue
            for req in list(peer.inflight):
                if req.advance() is not XferState.PROC:
                    peer.inflight.discard(req)
        self._orphans = [(r, k) for r, k in self._orphans if not self._reap(r)]
        self._inbox.poll()

    @staticmethod
    def _reap(req: int) -> bool:
        if ucp.request_status(req) == ucp.UCS_INPROGRESS:
            return False
        ucp.request_free(req)
        return True

    @property
    def num_rejected_messages(self) -> int:
        return self._inbox.num_rejected

    def take_notifs(self) -> list[tuple[str, bytes]]:
        self.progress()
        return self._inbox.take()

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for name in list(self._peers):
            self.disconnect(name)
        for ep, rkeys in self._parked:
            for rkey in rkeys:
                ucp.rkey_destroy(rkey)
            self._wait_or_orphan(ucp.ep_close(ep, False))
        self._parked.clear()
        for _ in range(100):
            self.progress()
            if not self._orphans:
                break
        for memh in self._memhs:
            ucp.mem_unmap(self._ctx_h, memh)
        self._memhs.clear()
        self._inbox.close()
