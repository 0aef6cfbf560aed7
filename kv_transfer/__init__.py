"""NIXL-style KV-block transfer: register memory, exchange metadata, one-sided WRITE/READ of
descriptor lists, notifications after the data. Backends: UCX (ucxx + ctypes) and in-process.

Module map:
- `agent.py`: `Agent` and `TransferHandle`, the public front; validates all input.
- `descriptors.py`: `Desc` and KV block ids -> coalesced descriptor lists.
- `backend.py`: the backend contract (`TransferBackend`, `XferRequest`, `XferState`).
- `metadata.py`: agent metadata bytes (versioned JSON) and the peer-process liveness check.
- `inproc.py`: in-process backend (torch copies) for unit tests.
- `ucx.py`: UCX backend (design, choice of ucxx, dead-peer handling).
- `ucx_request.py`: UCX request state machine (flush, then notify) and notification inbox.
- `ucp_ctypes.py`: ctypes bindings to the libucp calls ucxx does not expose.
"""

from kv_transfer.agent import Agent, TransferHandle
from kv_transfer.backend import XferState
from kv_transfer.descriptors import Desc, block_descs, block_runs, paired_block_descs

__all__ = [
    "Agent",
    "Desc",
    "TransferHandle",
    "XferState",
    "block_descs",
    "block_runs",
    "paired_block_descs",
]
