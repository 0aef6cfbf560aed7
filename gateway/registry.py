"""Instance discovery: where the decode and prefill services are.

For now the lists come from settings (`StaticRegistry`). A later change adds a Redis registry
(heartbeats with TTL, epochs, load); routers depend only on `InstanceRegistry`, so swapping the
source does not touch routing or the request path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Instance:
    """One service instance. `instance_id` is stable for the instance's lifetime (its epoch)."""

    address: str  # host:port of its gRPC server
    instance_id: str


class InstanceRegistry(ABC):
    """Source of the current instances, per role.

    Contract: calls are cheap and non-blocking (the router calls them once per request on the
    event loop; a networked registry must cache and refresh in the background); the returned
    lists are snapshots in a stable order (so round-robin over them is fair) and may change
    between calls.
    """

    @abstractmethod
    def decodes(self) -> Sequence[Instance]: ...

    @abstractmethod
    def prefills(self) -> Sequence[Instance]: ...


class StaticRegistry(InstanceRegistry):
    """Fixed instance lists, e.g. from `--decode h:p,... --prefill h:p,...`."""

    def __init__(self, decode_addresses: Sequence[str], prefill_addresses: Sequence[str] = ()):
        # The address is the id: a static instance has no epoch to tell restarts apart.
        self._decodes = tuple(Instance(a, a) for a in dict.fromkeys(decode_addresses))
        self._prefills = tuple(Instance(a, a) for a in dict.fromkeys(prefill_addresses))

    def decodes(self) -> Sequence[Instance]:
        return self._decodes

    def prefills(self) -> Sequence[Instance]:
        return self._prefills
