"""The transfer backend contract. `Agent` validates; a backend moves bytes.

Contract (every backend, checked by `tests/kv_transfer/test_conformance.py`):

- `register(tensors)` appends memory regions; region i is the i-th tensor ever registered.
  The agent keeps the tensors alive; the backend may pin/map them. Regions are never removed
  while the agent lives.
- `blob()` returns the backend's part of the agent metadata (opaque to `Agent`): whatever a
  peer needs to reach this agent's regions. It reflects the regions registered so far.
- `connect(meta)` makes a peer reachable; connecting a known name again replaces it (a peer
  restarted with new metadata). `disconnect(name)` forgets it; its in-flight requests end in
  ERR. `mark_dead(name, reason)` keeps the name but declares the peer dead: in-flight requests
  end in ERR at once, nothing more is sent to it (no flush, queued operations cancelled), and
  later posts to it return requests already in ERR, until `connect` replaces it. None of these
  raise for a peer that already died.
- `post(op, remote, local_descs, remote_descs, notif)` starts one transfer of already
  validated descriptors and returns an `XferRequest`. Failures of the peer or the transport
  are reported through the request (`ERR` with a message), never raised from `poll`; `post`
  raises only for programming errors.
- WRITE/READ semantics: when the request reports DONE, every byte is visible at the
  destination (WRITE: in the peer's memory; READ: in ours). The notification, if any, is
  delivered to the peer only after that point (flush before notify), and DONE implies it was
  handed to the transport.
- `take_notifs()` returns `(sender_name, payload)` pairs received since the last call, in
  arrival order. Receiving needs no prior `connect` to the sender.
- `progress()` advances the transport; it is the only place work happens besides `post`, and
  `poll`/`take_notifs` call it. It never blocks for longer than a bounded slice of work.
- A backend may detect a dead peer by itself (UCX: the peer's process is gone); it then
  behaves as if `mark_dead` had been called.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

from kv_transfer.descriptors import Desc
from kv_transfer.metadata import AgentMetadata


class XferState(enum.StrEnum):
    """Handle states, as NIXL names them."""

    PROC = "PROC"  # in flight
    DONE = "DONE"  # data visible at the destination, notification handed off
    ERR = "ERR"  # failed; `error` says why. The destination contents are undefined.


class XferOp(enum.StrEnum):
    WRITE = "WRITE"  # local -> remote
    READ = "READ"  # remote -> local


class XferRequest(ABC):
    """One posted transfer, owned by the backend that made it."""

    remote: str
    error: str | None = None

    @abstractmethod
    def poll(self) -> XferState:
        """Advance (without blocking) and report the state. Terminal states are sticky."""

    @abstractmethod
    def fail(self, reason: str) -> None:
        """Give up: the state becomes ERR (if not already terminal) and stays so."""


class TransferBackend(ABC):
    name: str  # the owning agent's name

    @abstractmethod
    def register(self, tensors: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def blob(self) -> bytes: ...

    @abstractmethod
    def connect(self, meta: AgentMetadata) -> None: ...

    @abstractmethod
    def disconnect(self, name: str) -> None: ...

    @abstractmethod
    def mark_dead(self, name: str, reason: str) -> None: ...

    @abstractmethod
    def post(
        self,
        op: XferOp,
        remote: str,
        local_descs: list[Desc],
        remote_descs: list[Desc],
        notif: bytes | None,
    ) -> XferRequest: ...

    @abstractmethod
    def progress(self) -> None: ...

    @abstractmethod
    def take_notifs(self) -> list[tuple[str, bytes]]: ...

    @property
    def num_rejected_messages(self) -> int:
        """Messages from peers that were malformed or unexpected, dropped and counted."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release everything; in-flight requests end in ERR."""
