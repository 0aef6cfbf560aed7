"""`KVRouter`: (P, D) by predicted TTFT from cache locations and load (gateway/cost_model.py).

Per request: healthy instances from the registry → one index lookup (how many leading prompt
blocks each holds; one round trip) → candidates (reported load + what this gateway routed since
that report) → `plan_routes` → routes, best first. The first route's decision is counted by
reason (`RoutingStats`) and its work is remembered as pending until the instances report it;
a failed attempt (refused, unreachable) takes back that request's own work, moved to its next
route. An instance that has not reported its load yet is routable (unknown free blocks are not
none).

Degraded mode: when the index cannot answer (Redis down), every hit is unknown and the same
model routes by load alone; requests keep flowing and `is_degraded` says so.
"""

from __future__ import annotations

import collections
import contextvars
import json
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.cost_model import (
    Calibration,
    Candidate,
    CostParams,
    Decision,
    plan_routes,
    pool_rate,
    ttft_local,
    ttft_remote,
)
from gateway.index import BlockIndex, IndexTarget, IndexUnavailable
from gateway.registry import Instance, InstanceRegistry, InstanceStatus
from gateway.router import HealthMarks, Outcome, Route, Router

logger = logging.getLogger(__name__)


@dataclass
class RoutingStats:
    """Counters for the metrics module: `tandem:route_decisions{reason}` and
    `tandem:local_prefill_decisions` (see `RoutingCollector`)."""

    route_decisions: collections.Counter = field(default_factory=collections.Counter)
    local_prefill_decisions: int = 0
    index_errors: int = 0
    # |measured - predicted| / measured TTFT of recent finished requests (prediction quality).
    ttft_errors: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))

    def ttft_error_quantiles(self) -> tuple[float, float]:
        """(median, p90) of the recent relative TTFT prediction errors; (0, 0) before any."""
        if len(self.ttft_errors) < 2:
            return (self.ttft_errors[0],) * 2 if self.ttft_errors else (0.0, 0.0)
        cuts = statistics.quantiles(self.ttft_errors, n=10, method="inclusive")
        return statistics.median(self.ttft_errors), cuts[8]


class RouteLog:
    """`--route-log`: one JSON line per finished request (append, line-buffered)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the gateway's life

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


@dataclass(eq=False)  # identity: two requests' equal work are two entries
class PendingEntry:
    """One request's work at one instance: `PendingWork.add` returns it, `drop` takes it back."""

    instance_id: str
    added_s: float
    num_tokens: int


class PendingWork:
    """Work this gateway routed that an instance's last report may not include yet.

    Why: reports arrive every few tens of milliseconds (embedded) to a few hundred (Redis); a
    burst routed in between would otherwise all see the same stale load and pile onto one
    instance. An entry counts until a report taken `margin_s` after it arrives, or `ttl_s`.
    """

    def __init__(self, ttl_s: float = 2.0, margin_s: float = 0.05, clock=time.time):
        self.ttl_s, self.margin_s, self._clock = ttl_s, margin_s, clock
        self._entries: dict[str, collections.deque[PendingEntry]] = {}
        # Each instance's entries' tokens, kept as they come and go: `get` runs for every
        # candidate of every request, and between two reports a busy gateway holds hundreds.
        self._num_tokens: dict[str, int] = {}

    def add(self, instance_id: str, num_tokens: int) -> PendingEntry:
        entry = PendingEntry(instance_id, self._clock(), num_tokens)
        self._entries.setdefault(instance_id, collections.deque()).append(entry)
        self._num_tokens[instance_id] = self._num_tokens.get(instance_id, 0) + num_tokens
        return entry

    def drop(self, entry: PendingEntry) -> None:
        """Forget `entry` (its instance never took the request); nothing once it expired."""
        entries = self._entries.get(entry.instance_id)
        if entries is not None and entry in entries:
            entries.remove(entry)
            self._num_tokens[entry.instance_id] -= entry.num_tokens

    def get(self, instance_id: str, as_of_s: float) -> tuple[int, int]:
        """(requests, prompt tokens) not yet in a report taken at `as_of_s` (wall clock)."""
        entries = self._entries.get(instance_id)
        if not entries:
            return 0, 0
        horizon = max(as_of_s - self.margin_s, self._clock() - self.ttl_s)
        num_tokens = self._num_tokens[instance_id]
        while entries and entries[0].added_s < horizon:
            num_tokens -= entries.popleft().num_tokens
        self._num_tokens[instance_id] = num_tokens
        return len(entries), num_tokens


@dataclass
class _Attempts:
    """One request's plan as the gateway walks it: `decisions[current]` is being tried, and
    `entries` is the pending work recorded for that attempt."""

    decisions: list[Decision]
    num_tokens: int
    current: int = 0
    entries: list[PendingEntry] = field(default_factory=list)

    def is_trying(self, instance: Instance) -> bool:
        if self.current >= len(self.decisions):
            return False
        return self.decisions[self.current].decode.instance.instance_id == instance.instance_id


# The request whose task this is: `plan` sets it and `report` reads it, so a failed attempt takes
# back that request's own pending work. `Router.report` carries no request id, and the gateway
# admits every request (every n>1 child) in a task of its own (gateway/dispatch.py), which gets
# its own copy of the context; a /health probe runs in another task and finds no attempts.
_ATTEMPTS: contextvars.ContextVar[_Attempts | None] = contextvars.ContextVar(
    "kv_router_attempts", default=None
)


def reported_free_blocks(status: InstanceStatus) -> int | None:
    """The instance's free KV blocks, or None while it has reported no load.

    An instance's first record can precede its engine's first load snapshot; the registry then
    leaves every load field at its default, 0 free blocks at 0.0 usage. No real report says that
    (usage = 1 - free / usable, so no free block is usage 1.0): it means unknown, not full, and a
    new decode must get traffic before its first load report.
    """
    if status.num_free_blocks == 0 and status.kv_cache_usage == 0.0:
        return None
    return status.num_free_blocks


class KVRouter(Router):
    def __init__(
        self,
        registry: InstanceRegistry,
        index: BlockIndex | None,
        params: CostParams | None = None,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        pending: PendingWork | None = None,
        route_log: RouteLog | None = None,
    ):
        self.registry = registry
        self.index = index
        self.calibration = Calibration(params or CostParams())
        self.route_log = route_log
        self.health = HealthMarks(cooldown_s, clock)
        self.pending = pending or PendingWork()
        self.stats = RoutingStats()

    @property
    def is_degraded(self) -> bool:
        """Routing by load alone: no index, or its store (or the registry's) is unreachable."""
        index_ok = self.index is not None and self.index.is_available
        return not (index_ok and self.registry.is_available)

    async def start(self) -> None:
        if self.index is not None:
            await self.index.start()

    @property
    def params(self) -> CostParams:
        """The cost model's parameters as calibrated so far."""
        return self.calibration.params

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()
        if self.route_log is not None:
            self.route_log.close()

    def observe(self, route: Route, ttft_s: float, timings, num_prompt_tokens: int) -> None:
        if route.prefills and not timings.local_prefill:
            self.calibration.observe_remote(ttft_s, timings)
        elif not route.prefills and route.predicted_ttft_s > 0:
            compute_s = route.predicted_ttft_s - self.params.local_overhead_s
            self.calibration.observe_local(ttft_s, compute_s)
        if route.predicted_ttft_s > 0 and ttft_s > 0:
            self.stats.ttft_errors.append(abs(ttft_s - route.predicted_ttft_s) / ttft_s)
        if self.route_log is None:
            return
        self.route_log.write(
            {
                "time": round(time.time(), 4),
                "decode": route.decode.instance_id,
                "prefill": "" if timings.local_prefill else timings.prefill_instance,
                "planned": "local" if not route.prefills else "remote",
                "reason": route.reason,
                "num_prompt_tokens": num_prompt_tokens,
                "predicted_ttft_s": round(route.predicted_ttft_s, 5),
                "measured_ttft_s": round(ttft_s, 5),
                # D's own: its handler's start to its first token (the rest of measured_ttft_s
                # is the way there and back: transport and both event loops).
                "decode_ttft_s": round(timings.prefill_s, 5),
                "kv_transfer_bytes": timings.kv_transfer_bytes,
                "kv_transfer_s": round(timings.kv_transfer_s, 5),
                "remote_compute_s": round(timings.remote_compute_s, 5),
                "kv_wait_s": round(timings.kv_wait_s, 5),
                "link_bytes_per_s": round(self.params.link_bytes_per_s),
                "remote_overhead_s": round(self.params.remote_overhead_s, 5),
                "local_overhead_s": round(self.params.local_overhead_s, 5),
            }
        )

    def report(self, instance: Instance, outcome: Outcome) -> None:
        self.health.report(instance, outcome)
        attempts = _ATTEMPTS.get()
        if outcome is Outcome.OK or attempts is None or not attempts.is_trying(instance):
            return  # admitted, or not a request's attempt (a /health probe)
        # D never took the request (nor called its prefill): take back this request's work, and
        # count it where the gateway tries next.
        for entry in attempts.entries:
            self.pending.drop(entry)
        attempts.current += 1
        attempts.entries = []
        if attempts.current < len(attempts.decisions):
            decision = attempts.decisions[attempts.current]
            attempts.entries = self._add_pending(decision, attempts.num_tokens)

    async def plan(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[Route]:
        _ATTEMPTS.set(None)
        decodes = [d for d in self.registry.decodes() if self.health.is_healthy(d)]
        if not decodes:
            return []
        prefills = [p for p in self.registry.prefills() if self.health.is_healthy(p)]
        statuses = {i.instance_id: self.registry.status(i) for i in (*decodes, *prefills)}
        hits, is_known = await self._lookup(prompt_token_ids, cache_salt, statuses)
        num_tokens = len(prompt_token_ids)
        decode_ids = {d.instance_id for d in decodes}
        prefill_candidates = [
            self._candidate(p, statuses, hits, num_tokens, False, p.instance_id in decode_ids)
            for p in prefills
        ]
        decisions = plan_routes(
            [self._candidate(d, statuses, hits, num_tokens, True) for d in decodes],
            prefill_candidates,
            num_tokens,
            self.params,
        )
        self._record(decisions[0], num_tokens, is_known)
        entries = self._add_pending(decisions[0], num_tokens)
        _ATTEMPTS.set(_Attempts(decisions, num_tokens, entries=entries))
        rate = pool_rate(prefill_candidates, self.params)
        return [self._route(x, num_tokens, rate) for x in decisions]

    def _route(self, x: Decision, num_tokens: int, rate: float) -> Route:
        """The decision as an attempt, with each prefill's predicted time: the decode derives
        how long to wait for that prefill from it."""
        d, params = x.decode, self.params
        predicted = [
            ttft_remote(p, p.num_hit_tokens, d, d.num_hit_tokens, num_tokens, params)
            for p in x.prefills
        ]
        ttft_s = (
            predicted[0] if predicted else ttft_local(d, d.num_hit_tokens, num_tokens, rate, params)
        )
        return Route(
            d.instance, tuple(p.instance for p in x.prefills), tuple(predicted), ttft_s, x.reason
        )

    async def _lookup(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        statuses: dict[str, InstanceStatus | None],
    ) -> tuple[dict[str, int], bool]:
        """(leading cached blocks per instance id, whether the index answered)."""
        if self.index is None:
            return {}, False
        targets = [
            IndexTarget(i, s.epoch, s.block_size)
            for i, s in statuses.items()
            if s is not None and s.block_size > 0
        ]
        if not targets:
            return {}, True
        try:
            return await self.index.lookup(prompt_token_ids, cache_salt, targets), True
        except IndexUnavailable as e:
            self.stats.index_errors += 1
            logger.debug("index unavailable, routing by load: %s", e)
            return {}, False

    def _candidate(
        self,
        instance: Instance,
        statuses: dict[str, InstanceStatus | None],
        hits: dict[str, int],
        num_tokens: int,
        is_decode: bool,
        also_decodes: bool = False,
    ) -> Candidate:
        s = statuses[instance.instance_id]
        num_reqs, num_tokens_sent = self.pending.get(instance.instance_id, s.as_of_s if s else 0)
        if s is None:
            return Candidate(instance, num_outstanding=num_reqs, num_pending_tokens=num_tokens_sent)
        num_hit_blocks = hits.get(instance.instance_id, 0)
        num_needed_blocks = -(-num_tokens // s.block_size) - num_hit_blocks if s.block_size else 0
        num_free_blocks = reported_free_blocks(s)
        is_full = num_free_blocks is not None and num_free_blocks < num_needed_blocks
        return Candidate(
            instance,
            num_hit_tokens=min(num_hit_blocks * s.block_size, num_tokens - 1),
            num_outstanding=s.num_outstanding + num_reqs,
            num_pending_tokens=s.num_pending_prefill_tokens + num_tokens_sent,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            kv_bytes_per_token=s.kv_bytes_per_block / s.block_size if s.block_size else 0.0,
            has_room=not (is_decode and is_full),
            num_decoding=s.num_running if also_decodes else 0,
        )

    def _record(self, decision: Decision, num_tokens: int, is_index_known: bool) -> None:
        reason = decision.reason
        if not is_index_known and reason in ("load", "local_busy"):
            reason = "degraded"
        self.stats.route_decisions[reason] += 1
        if not decision.prefills:
            self.stats.local_prefill_decisions += 1

    def _add_pending(self, decision: Decision, num_tokens: int) -> list[PendingEntry]:
        d = decision.decode
        if not decision.prefills:
            return [self.pending.add(d.instance.instance_id, num_tokens - d.num_hit_tokens)]
        p = decision.prefills[0]
        return [
            self.pending.add(p.instance.instance_id, num_tokens - p.num_hit_tokens),
            self.pending.add(d.instance.instance_id, 0),
        ]


class RoutingCollector:
    """A prometheus_client collector over `RoutingStats`; register it where metrics are served:
    `prometheus_client.REGISTRY.register(RoutingCollector(router))`."""

    def __init__(self, router: KVRouter):
        self.router = router

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.router.stats
        decisions = CounterMetricFamily(
            "tandem:route_decisions", "Routing decisions by reason", labels=["reason"]
        )
        for reason, n in sorted(stats.route_decisions.items()):
            decisions.add_metric([reason], n)
        yield decisions
        yield CounterMetricFamily(
            "tandem:local_prefill_decisions",
            "Requests routed to prefill locally on the decode",
            value=stats.local_prefill_decisions,
        )
        p50, p90 = stats.ttft_error_quantiles()
        errors = GaugeMetricFamily(
            "tandem:route_ttft_prediction_error",
            "Relative error |measured - predicted| / measured of the cost model's TTFT, over the "
            "last 1000 finished requests",
            labels=["quantile"],
        )
        errors.add_metric(["0.5"], p50)
        errors.add_metric(["0.9"], p90)
        yield errors
        yield GaugeMetricFamily(
            "tandem:routing_degraded",
            "1 while routing by load alone (block index unavailable)",
            value=float(self.router.is_degraded),
        )
