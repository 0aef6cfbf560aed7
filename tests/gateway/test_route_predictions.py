"""Each prefill in a route carries its predicted time, which the decode bounds its wait by."""

from __future__ import annotations

import asyncio

from gateway.cost_model import CostParams
from gateway.index import EmbeddedIndex
from gateway.kv_router import KVRouter
from gateway.registry import InstanceStatus, StaticRegistry


def _status(**kw) -> InstanceStatus:
    return InstanceStatus(epoch="e", block_size=16, kv_bytes_per_block=4096, **kw)


def test_routes_carry_each_prefills_predicted_time_from_its_rate_and_queue():
    registry = StaticRegistry(["d1:1"], ["p-fast:1", "p-slow:1"])
    registry.set_status("d1:1", _status(num_free_blocks=1000, kv_cache_usage=0.1))
    registry.set_status("p-fast:1", _status(prefill_tokens_per_s=10_000.0))
    # The 3,000 queued tokens fit in one of its 8,192-token steps with the prompt, yet the
    # prompt's first token waits for all of them: a step takes as long as its tokens take.
    busy = _status(
        prefill_tokens_per_s=1_000.0, num_pending_prefill_tokens=3_000, max_num_batched_tokens=8192
    )
    registry.set_status("p-slow:1", busy)
    params = CostParams(local_min_gain_s=10.0)  # keep it remote
    router = KVRouter(registry, EmbeddedIndex(), params)
    (route,) = asyncio.run(router.plan(list(range(1_000))))
    predicted = dict(zip((p.address for p in route.prefills), route.predicted_prefill_s))
    assert set(predicted) == {"p-fast:1", "p-slow:1"}
    # 1,000 tokens at 10k tok/s ~ 0.1 s; at 1k tok/s behind 3,000 queued tokens ~ 4 s.
    assert 0.1 <= predicted["p-fast:1"] < 0.2
    assert 3.9 <= predicted["p-slow:1"] < 4.2
