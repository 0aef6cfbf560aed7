"""The KV-aware scorer (gateway/cost_model.py) and `KVRouter` over an embedded index: which
(P, D) wins, when local prefill pays, hot-spot protection, degraded routing, counters."""

from __future__ import annotations

import asyncio

import pytest

from engine.block_hash import hash_block_tokens
from engine.block_pool import KVCacheEvent
from gateway.cost_model import Candidate, CostParams, plan_routes, ttft_remote
from gateway.index import EmbeddedIndex, IndexUnavailable
from gateway.kv_router import KVRouter, PendingWork
from gateway.registry import Instance, InstanceStatus, StaticRegistry
from gateway.router import Outcome

PARAMS = CostParams(default_prefill_tokens_per_s=10_000.0)
P1, P2 = Instance("p1:1", "p1"), Instance("p2:1", "p2")
D1, D2 = Instance("d1:1", "d1"), Instance("d2:1", "d2")


def cand(instance, hit=0, outstanding=0, pending=0, rate=10_000.0, room=True) -> Candidate:
    return Candidate(instance, hit, outstanding, pending, rate, 4096 / 16, room)


def first(decodes, prefills, num_tokens):
    return plan_routes(decodes, prefills, num_tokens, PARAMS)[0]


def test_idle_fleet_prefills_remotely_on_the_least_loaded():
    d = first([cand(D1)], [cand(P1, outstanding=2, pending=300), cand(P2)], 500)
    assert d.reason == "load" and [p.instance for p in d.prefills] == [P2, P1]


def test_the_prefix_holder_wins():
    d = first([cand(D1)], [cand(P1), cand(P2, hit=448)], 500)
    assert d.reason == "cache_hit" and d.prefills[0].instance == P2


def test_local_prefill_when_decode_holds_most_of_a_long_prefix():
    d = first([cand(D1, hit=1984)], [cand(P1), cand(P2)], 2000)
    assert d.prefills == () and d.reason == "local_prefix"
    # ...but not for a short prompt, where it would save less than the margin.
    d = first([cand(D1, hit=48)], [cand(P1), cand(P2)], 60)
    assert d.prefills != () and d.reason == "load"
    # ...nor when the prefill holds the prefix as well.
    d = first([cand(D1, hit=1984)], [cand(P1, hit=1984), cand(P2)], 2000)
    assert d.prefills[0].instance == P1 and d.reason == "cache_hit"


def test_local_prefill_when_every_prefill_is_backed_up():
    busy = [cand(P1, outstanding=20, pending=10_000), cand(P2, outstanding=20, pending=10_000)]
    d = first([cand(D1)], busy, 300)
    assert d.prefills == () and d.reason == "local_busy"
    # A decode already running many streams does not pay: its stall counts.
    d = first([cand(D1, outstanding=64)], busy, 300)
    assert d.prefills != ()


def test_the_first_token_waits_for_every_prompt_token_queued_ahead():
    """A step takes as long as its tokens take: a burst queued at P delays the new prompt by
    all of its tokens, even when they fit in one step with it (counting only the excess over
    the step budget predicted TTFTs 2.3 x too low on the H200)."""
    idle = Candidate(P1, 0, 0, 0, 4000.0, 256.0, True)
    burst = Candidate(P1, 0, 16, 320, 4000.0, 256.0, True)
    d, params = cand(D1), CostParams()
    delay = ttft_remote(burst, 0, d, 0, 20, params) - ttft_remote(idle, 0, d, 0, 20, params)
    assert delay == pytest.approx(320 / 4000.0)
    over = [Candidate(p, 0, 30, 12_000, 4000.0, 256.0, True) for p in (P1, P2)]
    assert first([cand(D1)], over, 300).reason == "local_busy"


def test_no_prefill_pool_means_local():
    d = first([cand(D1)], [], 100)
    assert d.prefills == () and d.reason == "no_prefill"


def test_hot_spot_spreads_a_hot_prefix():
    holder = cand(P1, hit=496, outstanding=PARAMS.hot_spot_max_gap + 1, pending=80)
    d = first([cand(D1)], [holder, cand(P2)], 512)
    assert d.prefills[0].instance == P2 and d.reason == "hot_spot"
    holder = cand(P1, hit=496, outstanding=PARAMS.hot_spot_max_gap, pending=64)
    d = first([cand(D1)], [holder, cand(P2)], 512)
    assert d.prefills[0].instance == P1 and d.reason == "cache_hit"


def test_decodes_ordered_by_load_and_room():
    decisions = plan_routes(
        [cand(D1, outstanding=3), cand(D2, room=False), cand(Instance("d3:1", "d3"))],
        [cand(P1)],
        100,
        PARAMS,
    )
    assert [x.decode.instance.instance_id for x in decisions] == ["d3", "d1", "d2"]


# ---- KVRouter: registry + index + pending work ---------------------------------------------
def _status(epoch="e", **kw) -> InstanceStatus:
    return InstanceStatus(epoch=epoch, block_size=16, kv_bytes_per_block=4096, **kw)


def _router(index=None):
    registry = StaticRegistry(["d1:1", "d2:1"], ["p1:1", "p2:1"])
    for i in (*registry.decodes(), *registry.prefills()):
        registry.set_status(i.instance_id, _status(num_free_blocks=100))
    index = index or EmbeddedIndex()
    return KVRouter(registry, index, params=PARAMS), registry, index


def _plan(router, prompt, salt=None):
    return asyncio.run(router.plan(prompt, salt))


def test_router_follows_the_index_and_counts_reasons():
    router, _, index = _router()
    prompt = list(range(200))
    hashes = hash_block_tokens(prompt, 16, "t")
    index.apply("p2:1", "e", True, [KVCacheEvent("stored", tuple(hashes))])
    route = _plan(router, prompt, "t")[0]
    assert route.prefills[0].address == "p2:1"
    route = _plan(router, prompt, "other-tenant")[0]  # another salt: nothing cached
    assert router.stats.route_decisions == {"cache_hit": 1, "load": 1}
    assert router.stats.local_prefill_decisions == 0


def test_router_spreads_a_burst_of_one_hot_prefix():
    """Reports lag; the router's own pending work + the gap cap keep P2 from idling."""
    router, _, index = _router()
    prompt = list(range(200))
    index.apply("p1:1", "e", True, [KVCacheEvent("stored", tuple(hash_block_tokens(prompt, 16)))])
    firsts = [_plan(router, prompt)[0].prefills[0].address for _ in range(16)]
    assert firsts[0] == "p1:1"
    assert 4 <= firsts.count("p2:1") <= 12, firsts
    assert router.stats.route_decisions["hot_spot"] > 0
    decodes = [_plan(router, prompt)[0].decode.address for _ in range(4)]
    assert set(decodes) == {"d1:1", "d2:1"}


def test_router_degrades_to_load_when_the_index_is_down():
    class DownIndex(EmbeddedIndex):
        async def lookup(self, *args):
            raise IndexUnavailable("redis down")

        @property
        def is_available(self) -> bool:
            return False

    router, _, _ = _router(DownIndex())
    routes = _plan(router, list(range(100)))
    assert len(routes) == 2 and routes[0].prefills
    assert router.is_degraded and router.stats.route_decisions == {"degraded": 1}


def test_router_skips_unavailable_and_forgets_refused_work():
    router, registry, _ = _router()
    d1 = registry.decodes()[0]
    router.report(d1, Outcome.UNAVAILABLE)
    assert [r.decode.address for r in _plan(router, [1, 2, 3])] == ["d2:1"]
    router.report(d1, Outcome.OK)
    assert len(_plan(router, [1, 2, 3])) == 2


def test_router_without_statuses_still_routes():
    router = KVRouter(StaticRegistry(["d1:1", "d2:1"], ["p1:1"]), EmbeddedIndex(), PARAMS)
    routes = [_plan(router, [1, 2, 3]) for _ in range(2)]
    assert [r[0].decode.address for r in routes] == ["d1:1", "d2:1"]  # pending work spreads
    assert routes[0][0].prefills[0].address == "p1:1"


def test_a_decode_without_a_load_report_is_routable():
    """A new instance's first record can come before its first load report: unknown free blocks
    are not zero free blocks. The new decode gets the request; a reported full one does not."""
    registry = StaticRegistry(["d1:1", "d2:1"], ["p1:1"])
    d1, d2 = registry.decodes()
    registry.set_status("d1:1", _status(num_running=2, num_free_blocks=100, kv_cache_usage=0.5))
    registry.set_status("d2:1", _status())  # registered, no load yet
    router = KVRouter(registry, EmbeddedIndex(), PARAMS)
    assert [r.decode for r in _plan(router, list(range(40)))] == [d2, d1]
    full = _status(num_free_blocks=0, kv_cache_usage=1.0)  # reported, and full
    registry.set_status("d2:1", full)
    assert [r.decode for r in _plan(router, list(range(40)))] == [d1, d2]


def test_pending_work_drops_the_given_entry():
    pending = PendingWork(clock=lambda: 100.0)
    first, second = pending.add("p1", 300), pending.add("p1", 20)
    pending.drop(first)
    assert pending.get("p1", as_of_s=0.0) == (1, 20)
    pending.drop(first)  # already gone: nothing else goes
    assert pending.get("p1", as_of_s=0.0) == (1, 20)
    pending.drop(second)
    assert pending.get("p1", as_of_s=0.0) == (0, 0)


def test_pending_work_counts_what_is_left_after_expiry_and_drops():
    """The running token count equals the sum over the entries still pending, through
    expiry by a later report (`as_of_s`), by ttl, and drops of expired and live entries."""
    now = [10.0]
    pending = PendingWork(ttl_s=2.0, margin_s=0.05, clock=lambda: now[0])
    entries = []
    for i, tokens in enumerate([100, 7, 30, 5, 64]):
        now[0] = 10.0 + i  # added at 10, 11, 12, 13, 14
        entries.append(pending.add("d1", tokens))
    pending.add("d2", 1000)  # another instance's entries are its own
    assert pending.get("d1", as_of_s=0.0) == (3, 30 + 5 + 64)  # ttl: before 12.0 expired
    pending.drop(entries[0])  # expired already: nothing changes
    assert pending.get("d1", as_of_s=0.0) == (3, 99)
    assert pending.get("d1", as_of_s=12.5) == (2, 69)  # a report taken after the third
    pending.drop(entries[4])
    assert pending.get("d1", as_of_s=12.5) == (1, 5)
    now[0] = 20.0
    assert pending.get("d1", as_of_s=0.0) == (0, 0)
    assert pending.get("d2", as_of_s=0.0) == (0, 0)
    pending.add("d1", 3)
    assert pending.get("d1", as_of_s=0.0) == (1, 3)


def _admit_concurrently(router, requests) -> list:
    """As gateway/dispatch.py does: each request plans, then reports its first attempt, in a task
    of its own. Every request plans before any reports. Returns each request's first route."""
    routes: list = []

    async def admit(prompt, outcome, everyone_planned):
        route = (await router.plan(prompt))[0]
        routes.append(route)
        await everyone_planned.wait()
        router.report(route.decode, outcome)

    async def run():
        everyone_planned = asyncio.Event()
        tasks = []
        for prompt, outcome in requests:  # planned in this order
            tasks.append(asyncio.create_task(admit(prompt, outcome, everyone_planned)))
            while len(routes) < len(tasks):
                await asyncio.sleep(0)
        everyone_planned.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return routes


def test_a_refused_request_takes_back_its_own_pending_work():
    """Two requests prefill locally on the one decode; it refuses the first (planned first): the
    first's 300 prompt tokens leave its pending work, the second's 20 stay."""
    registry = StaticRegistry(["d1:1"])
    registry.set_status("d1:1", _status(num_free_blocks=100, kv_cache_usage=0.5))
    router = KVRouter(registry, EmbeddedIndex(), PARAMS)
    routes = _admit_concurrently(
        router, [(list(range(300)), Outcome.REFUSED), (list(range(1000, 1020)), Outcome.OK)]
    )
    assert [r.prefills for r in routes] == [(), ()]
    assert router.pending.get("d1:1", as_of_s=0.0) == (1, 20)
    # A /health probe's outcome (no request's attempt) takes back nobody's work.
    router.report(registry.decodes()[0], Outcome.UNAVAILABLE)
    assert router.pending.get("d1:1", as_of_s=0.0) == (1, 20)


def test_a_refused_attempt_moves_its_work_to_the_next_route():
    """D1 refuses: it never called P1, so P1's work from it goes too, and the gateway's next try
    (D2, again with P1) holds it. D2 refuses as well: nothing is headed anywhere."""
    registry = StaticRegistry(["d1:1", "d2:1"], ["p1:1"])
    for i in (*registry.decodes(), *registry.prefills()):
        registry.set_status(i.instance_id, _status(num_free_blocks=100, kv_cache_usage=0.5))
    router = KVRouter(registry, EmbeddedIndex(), PARAMS)

    def pending() -> dict[str, tuple[int, int]]:
        return {i: router.pending.get(i, as_of_s=0.0) for i in ("d1:1", "d2:1", "p1:1")}

    async def admit() -> list[dict]:
        routes = await router.plan(list(range(300)))
        assert [(r.decode.address, [p.address for p in r.prefills]) for r in routes] == [
            ("d1:1", ["p1:1"]),
            ("d2:1", ["p1:1"]),
        ]
        seen = [pending()]
        for route in routes:
            router.report(route.decode, Outcome.REFUSED)
            seen.append(pending())
        router.report(routes[-1].decode, Outcome.UNAVAILABLE)  # no attempt left: changes nothing
        assert pending() == seen[-1]
        return seen

    planned, after_d1, after_d2 = asyncio.run(admit())
    assert planned == {"d1:1": (1, 0), "d2:1": (0, 0), "p1:1": (1, 300)}
    assert after_d1 == {"d1:1": (0, 0), "d2:1": (1, 0), "p1:1": (1, 300)}
    assert after_d2 == {"d1:1": (0, 0), "d2:1": (0, 0), "p1:1": (0, 0)}
