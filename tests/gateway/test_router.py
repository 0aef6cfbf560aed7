"""RoundRobinRouter on its own: rotation, cooldown after UNAVAILABLE, prefill lists."""

from __future__ import annotations

import asyncio

from gateway.registry import StaticRegistry
from gateway.router import Outcome, RoundRobinRouter, Route


def plan(router: RoundRobinRouter, prompt: list[int]) -> list[Route]:
    return asyncio.run(router.plan(prompt))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _decodes(router: RoundRobinRouter) -> list[str]:
    return [r.decode.address for r in plan(router, [1, 2, 3])]


def test_round_robin_over_decodes():
    router = RoundRobinRouter(StaticRegistry(["d1:1", "d2:1", "d3:1"]))
    assert _decodes(router) == ["d1:1", "d2:1", "d3:1"]
    assert _decodes(router) == ["d2:1", "d3:1", "d1:1"]
    assert _decodes(router) == ["d3:1", "d1:1", "d2:1"]


def test_unavailable_instance_is_skipped_for_the_cooldown():
    clock = Clock()
    registry = StaticRegistry(["d1:1", "d2:1"])
    router = RoundRobinRouter(registry, cooldown_s=5.0, clock=clock)
    d1 = registry.decodes()[0]
    router.report(d1, Outcome.UNAVAILABLE)
    assert _decodes(router) == ["d2:1"]
    clock.now = 4.9
    assert _decodes(router) == ["d2:1"]
    clock.now = 5.0
    assert "d1:1" in _decodes(router)


def test_refused_and_ok_keep_or_restore_health():
    registry = StaticRegistry(["d1:1"])
    router = RoundRobinRouter(registry, cooldown_s=60.0)
    d1 = registry.decodes()[0]
    router.report(d1, Outcome.REFUSED)
    assert _decodes(router) == ["d1:1"]  # busy is not down
    router.report(d1, Outcome.UNAVAILABLE)
    assert _decodes(router) == []
    router.report(d1, Outcome.OK)  # e.g. a /health probe answered
    assert _decodes(router) == ["d1:1"]


def test_prefills_rotate_and_skip_unhealthy():
    registry = StaticRegistry(["d1:1"], ["p1:1", "p2:1", "p3:1"])
    router = RoundRobinRouter(registry)
    first, second = plan(router, [1]), plan(router, [1])
    assert [p.address for p in first[0].prefills] == ["p1:1", "p2:1", "p3:1"]
    assert [p.address for p in second[0].prefills] == ["p2:1", "p3:1", "p1:1"]
    router.report(registry.prefills()[1], Outcome.UNAVAILABLE)
    # Rotation continues over the healthy ones: turn 2 of [p1, p3].
    assert [p.address for p in plan(router, [1])[0].prefills] == ["p1:1", "p3:1"]
    assert [p.address for p in plan(router, [1])[0].prefills] == ["p3:1", "p1:1"]


def test_no_prefills_means_local_prefill():
    router = RoundRobinRouter(StaticRegistry(["d1:1"]))
    assert plan(router, [1])[0].prefills == ()
