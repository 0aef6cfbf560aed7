"""Instance discovery: where the decode and prefill services are, and how loaded they are.

Two sources: `StaticRegistry` (the `--decode/--prefill` flags; load arrives over each
instance's `WatchKVEvents` stream, see `gateway/kv_watch.py`) and `RedisRegistry`
(`gateway/redis_registry.py`: instances register themselves with a heartbeat TTL). Routers
depend only on `InstanceRegistry`, so swapping the source does not touch routing or the request
path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Instance:
    """One service instance. `instance_id` is stable for the instance's lifetime; a restarted
    instance that keeps its id gets a new `epoch` (empty when the source cannot tell)."""

    address: str  # host:port of its gRPC server
    instance_id: str
    epoch: str = ""
    # The sealed registry record it was found in (engine/record_auth.py); empty for instances
    # an operator listed. Forwarded to decodes, which verify it before trusting a prefill.
    registration: bytes = field(default=b"", compare=False, repr=False)


@dataclass(frozen=True)
class InstanceStatus:
    """What an instance last reported about itself (its engine's view, not the gateway's)."""

    epoch: str
    block_size: int
    kv_bytes_per_block: int
    max_num_batched_tokens: int = 0  # per-step token budget; 0: unknown
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_pending_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # 0.0: not measured
    as_of_s: float = 0.0  # wall clock when the instance took this snapshot

    @property
    def num_outstanding(self) -> int:
        return self.num_waiting + self.num_running


class InstanceRegistry(ABC):
    """Source of the current instances, per role.

    Contract: calls are cheap and non-blocking (the router calls them once per request on the
    event loop; a networked registry must cache and refresh in the background, started by
    `start()`); the returned lists are snapshots in a stable order (so round-robin over them is
    fair) and may change between calls. `status()` is the instance's last report, or None when
    none arrived yet (routers then treat it as idle).
    """

    @abstractmethod
    def decodes(self) -> Sequence[Instance]: ...

    @abstractmethod
    def prefills(self) -> Sequence[Instance]: ...

    def status(self, instance: Instance) -> InstanceStatus | None:
        return None

    @property
    def is_available(self) -> bool:
        """False while the source cannot be reached (the lists are then the last known)."""
        return True

    async def start(self) -> None:
        """Start background refreshing (on the gateway's event loop)."""
        return None

    async def refresh(self) -> bool:
        """Re-read the source now (not at the next background refresh); False when there is
        nothing to re-read or it failed."""
        return False

    async def close(self) -> None:
        return None


class StaticRegistry(InstanceRegistry):
    """Fixed instance lists, e.g. from `--decode h:p,... --prefill h:p,...`.

    Statuses are pushed in by whoever watches the instances (`set_status`)."""

    def __init__(self, decode_addresses: Sequence[str], prefill_addresses: Sequence[str] = ()):
        # The address is the id: a static instance has no epoch to tell restarts apart.
        self._decodes = tuple(Instance(a, a) for a in dict.fromkeys(decode_addresses))
        self._prefills = tuple(Instance(a, a) for a in dict.fromkeys(prefill_addresses))
        self._statuses: dict[str, InstanceStatus] = {}

    def decodes(self) -> Sequence[Instance]:
        return self._decodes

    def prefills(self) -> Sequence[Instance]:
        return self._prefills

    def status(self, instance: Instance) -> InstanceStatus | None:
        return self._statuses.get(instance.instance_id)

    def set_status(self, instance_id: str, status: InstanceStatus | None) -> None:
        if status is None:
            self._statuses.pop(instance_id, None)
        else:
            self._statuses[instance_id] = status
