"""Choosing (P, D) for a request: a replaceable policy behind `Router`.

The gateway asks the router for an ordered plan, tries the decodes in that order until one
admits the request, and reports every attempt's outcome back. Health lives in the router, not
in the request path, so a smarter policy (`KVRouter` in gateway/kv_router.py: KV-aware,
load-aware, cost-model local prefill) replaces `RoundRobinRouter` without touching anything
else.
"""

from __future__ import annotations

import enum
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.registry import Instance, InstanceRegistry


@dataclass(frozen=True)
class Route:
    """One attempt: call `decode.Generate` with `prefills` (empty = D prefills locally)."""

    decode: Instance
    prefills: tuple[Instance, ...]
    # Per prefill, the predicted seconds to the first token (queue + compute + transfer); empty
    # when the router does not predict. The decode bounds its wait for that prefill by it.
    predicted_prefill_s: tuple[float, ...] = ()
    # The router's prediction of this attempt's time to first token and why it chose it; what
    # was measured comes back through `Router.observe`.
    predicted_ttft_s: float = 0.0
    reason: str = ""


class Outcome(enum.Enum):
    OK = "ok"  # the instance answered (admitted the request, or answered a probe)
    REFUSED = "refused"  # RESOURCE_EXHAUSTED: alive but full; try another, keep it healthy
    UNAVAILABLE = "unavailable"  # UNAVAILABLE: unreachable or shutting down; skip for a while


class Router(ABC):
    """Routing policy.

    Contract:
    - `plan(prompt_token_ids, cache_salt)` returns the routes to try for one request (one n>1
      child), best first, each with a different decode. The gateway stops at the first decode
      that admits the request; an empty plan means "nothing routable" and becomes a 503.
    - Each route's `prefills` is the list D should try, in order; empty = local prefill.
    - `report(instance, outcome)` is called for every attempt and health probe, for decodes (and
      for prefills once the gateway learns about their health); a router may ignore it.
    - Both run on the event loop per request. `report` does no I/O; `plan` may do at most one
      bounded round trip (an index lookup) and must still answer when that fails.
    - `start()` / `close()` bracket the gateway's lifetime (background work, connections).
    """

    @abstractmethod
    async def plan(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[Route]: ...

    @abstractmethod
    def report(self, instance: Instance, outcome: Outcome) -> None: ...

    registry: InstanceRegistry

    async def start(self) -> None:
        return None  # stateless by default

    async def close(self) -> None:
        return None

    def observe(self, route: Route, ttft_s: float, timings, num_prompt_tokens: int) -> None:
        """A request admitted on `route` finished: its TTFT as the gateway saw it and D's
        `Timings`. Called on the event loop; no I/O beyond a buffered log line."""
        return None

    async def refresh_instances(self) -> bool:
        """Re-read the instance registry now: when every known decode is unreachable, one may
        have joined since the last background refresh (a rolling restart's replacement)."""
        return await self.registry.refresh()


class HealthMarks:
    """Instances in an UNAVAILABLE cooldown, shared by the routers.

    Why a cooldown rather than removal: a static instance list has no other signal that an
    instance came back, so after `cooldown_s` the instance is tried again (and a successful
    `/health` probe clears the mark early).
    """

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._unhealthy_until: dict[str, float] = {}  # instance_id -> clock time

    def is_healthy(self, instance: Instance) -> bool:
        until = self._unhealthy_until.get(instance.instance_id)
        if until is None:
            return True
        if self._clock() >= until:
            del self._unhealthy_until[instance.instance_id]
            return True
        return False

    def report(self, instance: Instance, outcome: Outcome) -> None:
        if outcome is Outcome.UNAVAILABLE:
            self._unhealthy_until[instance.instance_id] = self._clock() + self.cooldown_s
        else:  # OK and REFUSED both prove the instance is up
            self._unhealthy_until.pop(instance.instance_id, None)


class RoundRobinRouter(Router):
    """Rotate over healthy decodes and healthy prefills; skip instances in an UNAVAILABLE
    cooldown (`HealthMarks`)."""

    def __init__(
        self,
        registry: InstanceRegistry,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = registry
        self.health = HealthMarks(cooldown_s, clock)
        self.is_healthy = self.health.is_healthy
        self._decode_turn = itertools.count()
        self._prefill_turn = itertools.count()

    async def plan(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[Route]:
        decodes = _rotate(
            [d for d in self.registry.decodes() if self.is_healthy(d)], next(self._decode_turn)
        )
        prefills = tuple(
            _rotate(
                [p for p in self.registry.prefills() if self.is_healthy(p)],
                next(self._prefill_turn),
            )
        )
        return [Route(d, prefills) for d in decodes]

    def report(self, instance: Instance, outcome: Outcome) -> None:
        self.health.report(instance, outcome)


def _rotate(items: list[Instance], turn: int) -> list[Instance]:
    if not items:
        return items
    k = turn % len(items)
    return items[k:] + items[:k]
