"""Thin ctypes bindings to the UCP calls that ucxx's Python API does not expose.

ucxx (the Python package) creates the context and worker, but has no memory registration and no
RMA, and its endpoints hide the close mode we need for dead peers. We reach the same
`libucp.so` that ucxx already loaded (so the `.handle` pointers of ucxx objects are valid here)
and call the C API directly. Only the calls Tandem needs are bound; struct layouts are copied
from `ucp/api/ucp.h` of UCX 1.21 (LP64) and checked by size below.

Requests: we never pass a completion callback (no Python called from UCX threads). A call
returns NULL (done at once), an error pointer, or a request that we poll with
`request_check_status` and free with `request_free`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from ctypes import (
    POINTER,
    byref,
    c_char_p,
    c_int,
    c_int8,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100

# ucp_mem_map_params_t.field_mask bits
_MEM_MAP_FIELD_ADDRESS = 1 << 0
_MEM_MAP_FIELD_LENGTH = 1 << 1
# ucp_request_param_t.op_attr_mask bits
_OP_ATTR_FIELD_FLAGS = 1 << 4
_OP_ATTR_FIELD_MEMH = 1 << 8
# ucp_ep_params_t.field_mask bits and error handling modes
_EP_FIELD_REMOTE_ADDRESS = 1 << 0
_EP_FIELD_ERR_HANDLING_MODE = 1 << 1
_ERR_HANDLING_MODE_NONE = 0
_ERR_HANDLING_MODE_PEER = 1
# ucp_ep_close_nbx flags
_EP_CLOSE_FLAG_FORCE = 1 << 0

TAG_MASK_FULL = (1 << 64) - 1


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    ]


class _RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", c_void_p),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),
        ("memh", c_void_p),
    ]


class _EpParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", c_uint64),
        ("address", c_char_p),
        ("err_mode", c_int),
        ("err_handler_cb", c_void_p),
        ("err_handler_arg", c_void_p),
        ("user_data", c_void_p),
        ("flags", c_uint),
        ("sockaddr", c_void_p),
        ("sockaddr_len", c_uint32),
        ("conn_request", c_void_p),
        ("name", c_char_p),
        ("local_sockaddr", c_void_p),
        ("local_sockaddr_len", c_uint32),
    ]


class _TagRecvInfo(ctypes.Structure):
    _fields_ = [("sender_tag", c_uint64), ("length", c_size_t)]


assert ctypes.sizeof(_MemMapParams) == 48 and ctypes.sizeof(_RequestParam) == 72
assert ctypes.sizeof(_EpParams) == 104


class UcxError(RuntimeError):
    """A UCX call failed; `status` is the ucs_status_t code."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed: {status_string(status)} ({status})")
        self.status = status


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """Open the libucp/libucs that ucxx loaded (libucx wheel), never a second copy."""
    import libucx  # noqa: F401  (ships the libraries ucxx links against)
    import ucxx  # noqa: F401  (loads them first)

    paths = {ln.split()[-1] for ln in open("/proc/self/maps") if "/libuc" in ln}
    ucp = [p for p in paths if os.path.basename(p).startswith("libucp.so")]
    ucs = [p for p in paths if os.path.basename(p).startswith("libucs.so")]
    assert len(ucp) == 1 and len(ucs) == 1, f"expected one libucp/libucs mapped, got {paths}"
    return ctypes.CDLL(ucp[0]), ctypes.CDLL(ucs[0])


_ucp, _ucs = _load()


def _bind(lib: ctypes.CDLL, name: str, restype, *argtypes):  # noqa: ANN001, ANN202
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


# ucs_status_t is a packed enum: one signed byte (c_int would read garbage upper bits).
_Status = c_int8
_ReqP = POINTER(_RequestParam)
# fmt: off
_status_string = _bind(_ucs, "ucs_status_string", c_char_p, _Status)
_mem_map = _bind(_ucp, "ucp_mem_map", _Status, c_void_p, POINTER(_MemMapParams), POINTER(c_void_p))
_mem_unmap = _bind(_ucp, "ucp_mem_unmap", _Status, c_void_p, c_void_p)
_rkey_pack = _bind(_ucp, "ucp_rkey_pack", _Status, c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_size_t))  # noqa: E501
_rkey_buffer_release = _bind(_ucp, "ucp_rkey_buffer_release", None, c_void_p)
_rkey_unpack = _bind(_ucp, "ucp_ep_rkey_unpack", _Status, c_void_p, c_char_p, POINTER(c_void_p))
_rkey_destroy = _bind(_ucp, "ucp_rkey_destroy", None, c_void_p)
_ep_create = _bind(_ucp, "ucp_ep_create", _Status, c_void_p, POINTER(_EpParams), POINTER(c_void_p))
_put_nbx = _bind(_ucp, "ucp_put_nbx", c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, _ReqP)  # noqa: E501
_get_nbx = _bind(_ucp, "ucp_get_nbx", c_void_p, c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, _ReqP)  # noqa: E501
_flush_nbx = _bind(_ucp, "ucp_ep_flush_nbx", c_void_p, c_void_p, _ReqP)
_close_nbx = _bind(_ucp, "ucp_ep_close_nbx", c_void_p, c_void_p, _ReqP)
_tag_send_nbx = _bind(_ucp, "ucp_tag_send_nbx", c_void_p, c_void_p, c_char_p, c_size_t, c_uint64, _ReqP)  # noqa: E501
_tag_probe_nb = _bind(_ucp, "ucp_tag_probe_nb", c_void_p, c_void_p, c_uint64, c_uint64, c_int, POINTER(_TagRecvInfo))  # noqa: E501
_tag_msg_recv_nbx = _bind(_ucp, "ucp_tag_msg_recv_nbx", c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, _ReqP)  # noqa: E501
_check_status = _bind(_ucp, "ucp_request_check_status", _Status, c_void_p)
_request_free = _bind(_ucp, "ucp_request_free", None, c_void_p)
_worker_progress = _bind(_ucp, "ucp_worker_progress", c_uint, c_void_p)
# fmt: on

_NO_PARAM = _RequestParam()


def status_string(status: int) -> str:
    return _status_string(status).decode()


def _check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcxError(what, status)


def _as_request(what: str, ptr: int | None) -> int | None:
    """Turn a ucs_status_ptr_t into None (completed) or a request pointer; raise on error."""
    if ptr is None:
        return None
    if ptr >= (1 << 64) + _UCS_ERR_LAST:  # UCS_PTR_IS_ERR: error codes in the top 100 values
        raise UcxError(what, ptr - (1 << 64))
    return ptr


def mem_map(context: int, address: int, length: int) -> int:
    """Register [address, address+length) for RMA (all access rights, memory type detected)."""
    params = _MemMapParams(
        field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH, address=address, length=length
    )
    memh = c_void_p()
    _check("ucp_mem_map", _mem_map(context, byref(params), byref(memh)))
    return memh.value


def mem_unmap(context: int, memh: int) -> None:
    _check("ucp_mem_unmap", _mem_unmap(context, memh))


def rkey_pack(context: int, memh: int) -> bytes:
    buf, size = c_void_p(), c_size_t()
    _check("ucp_rkey_pack", _rkey_pack(context, memh, byref(buf), byref(size)))
    try:
        return ctypes.string_at(buf.value, size.value)
    finally:
        _rkey_buffer_release(buf)


def rkey_unpack(ep: int, packed: bytes) -> int:
    rkey = c_void_p()
    _check("ucp_ep_rkey_unpack", _rkey_unpack(ep, packed, byref(rkey)))
    return rkey.value


def rkey_destroy(rkey: int) -> None:
    _rkey_destroy(rkey)


def memh_param(memh: int) -> _RequestParam:
    """Request parameters naming the local buffer's registration (no lookup per operation)."""
    return _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMH, memh=memh)


def post_rma(is_put: bool, ep: int, ops: Iterable[tuple[int, int, int, int, object]]) -> None:
    """Post PUTs/GETs `(local_addr, length, remote_addr, rkey, memh_param)` and let go of their
    requests at once: UCX keeps progressing them, and an ep flush reports their completion."""
    fn, what = (_put_nbx, "ucp_put_nbx") if is_put else (_get_nbx, "ucp_get_nbx")
    for local_addr, length, remote_addr, rkey, param in ops:
        ptr = fn(ep, local_addr, length, remote_addr, rkey, param)
        if ptr is not None:
            _request_free(_as_request(what, ptr))


def ep_create(worker: int, worker_address: bytes, peer_error_handling: bool) -> int:
    """Endpoint to a remote worker. Error handling PEER makes peer failures complete requests
    with an error instead of aborting the process, at the cost of one-sidedness (see ucx.py)."""
    params = _EpParams(
        field_mask=_EP_FIELD_REMOTE_ADDRESS | _EP_FIELD_ERR_HANDLING_MODE,
        address=worker_address,
        err_mode=_ERR_HANDLING_MODE_PEER if peer_error_handling else _ERR_HANDLING_MODE_NONE,
    )
    ep = c_void_p()
    _check("ucp_ep_create", _ep_create(worker, byref(params), byref(ep)))
    return ep.value


def ep_flush(ep: int) -> int | None:
    return _as_request("ucp_ep_flush_nbx", _flush_nbx(ep, _NO_PARAM))


def ep_close(ep: int, force: bool) -> int | None:
    """Start closing `ep`. `force` skips the flush and cancels outstanding operations: for dead
    peers only (UCX: undefined behaviour for a live remote without error handling)."""
    param = _RequestParam(
        op_attr_mask=_OP_ATTR_FIELD_FLAGS, flags=_EP_CLOSE_FLAG_FORCE if force else 0
    )
    return _as_request("ucp_ep_close_nbx", _close_nbx(ep, param))


def tag_send(ep: int, payload: bytes, tag: int) -> int | None:
    """Send `payload` (caller keeps it alive until the request completes)."""
    return _as_request("ucp_tag_send_nbx", _tag_send_nbx(ep, payload, len(payload), tag, _NO_PARAM))


def tag_try_recv(
    worker: int, tag: int, tag_mask: int = TAG_MASK_FULL, max_bytes: int | None = None
) -> tuple[ctypes.Array, int | None, int, int] | None:
    """Take one message matching `tag` under `tag_mask` (0: any) off the unexpected queue, if
    there is one: (buffer, request or None when done at once, the sender's tag, the status if
    done at once). A message longer than `max_bytes` is received truncated: it completes (now
    or later) with an error status."""
    info = _TagRecvInfo()
    msg = _tag_probe_nb(worker, tag, tag_mask, 1, byref(info))
    if not msg:
        return None
    length = info.length if max_bytes is None else min(info.length, max_bytes)
    buf = ctypes.create_string_buffer(max(length, 1))
    try:
        req = _as_request(
            "ucp_tag_msg_recv_nbx", _tag_msg_recv_nbx(worker, buf, length, msg, _NO_PARAM)
        )
    except UcxError as e:  # completed at once with an error (e.g. truncated)
        return buf, None, info.sender_tag, e.status
    return buf, req, info.sender_tag, UCS_OK


def request_status(req: int) -> int:
    """UCS_INPROGRESS while pending; UCS_OK or an error code once complete."""
    return _check_status(req)


def request_free(req: int) -> None:
    _request_free(req)


def worker_progress(worker: int) -> int:
    return _worker_progress(worker)
