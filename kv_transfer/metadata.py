"""Agent metadata: what a peer must know to transfer to/from an agent, as bytes.

The control plane (gRPC between prefill and decode) carries these bytes opaquely. The format
is versioned JSON with the backend's binary part base64-encoded: no pickle, because metadata
comes from the network and must not be able to run code when decoded.

Besides regions and the backend blob (for UCX: worker address and packed rkeys), metadata names
the agent's host and process (boot id, pid, process start time). On the same host this lets the
initiator check that the peer process still exists before touching its memory, which is how
the UCX backend turns a dead peer into an ERR instead of a fatal UCX error (see `ucx.py`).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import socket
from dataclasses import dataclass

_VERSION = 1


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    backend: str
    host_id: str  # hostname + kernel boot id: equal only for processes on one running host
    pid: int
    pid_start_ticks: int  # /proc/<pid>/stat field 22; tells a live peer from a reused pid
    region_addrs: tuple[int, ...]
    region_nbytes: tuple[int, ...]
    backend_blob: bytes

    def to_bytes(self) -> bytes:
        doc = {
            "version": _VERSION,
            "name": self.name,
            "backend": self.backend,
            "host_id": self.host_id,
            "pid": self.pid,
            "pid_start_ticks": self.pid_start_ticks,
            "region_addrs": list(self.region_addrs),
            "region_nbytes": list(self.region_nbytes),
            "backend_blob": base64.b64encode(self.backend_blob).decode(),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> AgentMetadata:
        try:
            doc = json.loads(data)
            if doc["version"] != _VERSION:
                raise ValueError(f"unsupported agent metadata version {doc['version']}")
            meta = cls(
                name=str(doc["name"]),
                backend=str(doc["backend"]),
                host_id=str(doc["host_id"]),
                pid=int(doc["pid"]),
                pid_start_ticks=int(doc["pid_start_ticks"]),
                region_addrs=tuple(int(a) for a in doc["region_addrs"]),
                region_nbytes=tuple(int(n) for n in doc["region_nbytes"]),
                backend_blob=base64.b64decode(doc["backend_blob"]),
            )
        except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed agent metadata: {e!r}") from e
        if len(meta.region_addrs) != len(meta.region_nbytes):
            raise ValueError("malformed agent metadata: region lists differ in length")
        return meta

    @property
    def is_same_host(self) -> bool:
        return self.host_id == host_id()

    def is_process_alive(self) -> bool:
        """True unless the peer is on this host and its process is gone (or the pid reused)."""
        if not self.is_same_host:
            return True  # nothing to check locally: the control plane reports remote deaths
        return process_start_ticks(self.pid) == self.pid_start_ticks


@functools.cache
def host_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{socket.gethostname()}/{f.read().strip()}"


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if no such (live) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # zombie / dead: its memory is already gone
        return None
    return int(fields[19])


def own_identity() -> tuple[str, int, int]:
    pid = os.getpid()
    ticks = process_start_ticks(pid)
    assert ticks is not None
    return host_id(), pid, ticks
