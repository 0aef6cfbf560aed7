"""When P/D pays and when it does not (gateway/cost_model.py), and the model's calibration from
measured timings: the choices the goodput study (bench/goodput.py) depends on."""

from __future__ import annotations

import json

from gateway.cost_model import Calibration, Candidate, CostParams, plan_routes
from gateway.kv_router import KVRouter, RouteLog
from gateway.registry import Instance, InstanceStatus, StaticRegistry
from gateway.router import Route
from protos import common_pb2

P, D, D2 = Instance("p:1", "p"), Instance("d:1", "d"), Instance("d2:1", "d2")
KV_BYTES_PER_TOKEN = 144 * 1024  # Qwen3-8B, bf16: 36 layers x 8 KV heads x 128 x 2 x 2 bytes
RATE = 20_000.0  # prompt tokens/s, measured by the instances


def cand(instance, hit=0, outstanding=0, pending=0, rate=RATE) -> Candidate:
    return Candidate(instance, hit, outstanding, pending, rate, KV_BYTES_PER_TOKEN, True)


def decide(decodes, prefills, num_tokens, **params):
    return plan_routes(decodes, prefills, num_tokens, CostParams(**params))[0]


def test_local_when_the_transfer_costs_more_than_the_prefill_it_saves():
    # 2,000 tokens = 288 MiB of KV: 2 s over a 150 MB/s link, 0.1 s to prefill on an idle D.
    slow_link = dict(link_bytes_per_s=150e6)
    d = decide([cand(D)], [cand(P)], 2000, **slow_link)
    assert d.prefills == () and d.reason == "local_busy"
    # The same request over a fast link (the H200 pair's NVLink) goes remote.
    d = decide([cand(D)], [cand(P)], 2000, link_bytes_per_s=100e9)
    assert [p.instance for p in d.prefills] == [P]


def test_remote_when_a_long_uncached_prompt_meets_a_busy_decode():
    # D runs 64 streams: prefilling 3,000 tokens there stalls every one of them.
    busy = cand(D, outstanding=64)
    d = decide([busy], [cand(P)], 3000, link_bytes_per_s=10e9)
    assert [p.instance for p in d.prefills] == [P] and d.reason == "load"
    # An idle decode with a short prompt keeps it: the hop is not worth it.
    d = decide([cand(D)], [cand(P)], 40, link_bytes_per_s=10e9, remote_overhead_s=0.03)
    assert d.prefills == ()


def test_remote_policy_never_prefills_locally_while_a_prefill_is_up():
    d = decide([cand(D)], [cand(P)], 2000, link_bytes_per_s=150e6, allow_local=False)
    assert [p.instance for p in d.prefills] == [P]
    d = decide([cand(D)], [], 2000, allow_local=False)  # no prefill: local is all there is
    assert d.prefills == () and d.reason == "no_prefill"


def test_a_kv_both_instance_is_never_its_own_remote_prefill():
    """Two kv_both instances: each is in both pools. D's remote choice is the other one."""
    both = [cand(D, outstanding=64), cand(D2, outstanding=64)]
    plans = plan_routes(both, both, 3000, CostParams(link_bytes_per_s=10e9))
    for x in plans:
        assert all(p.instance != x.decode.instance for p in x.prefills)
    assert [p.instance for p in plans[0].prefills] in ([D2], [D])
    # Alone in its pool, a kv_both decode prefills locally.
    x = plan_routes([cand(D)], [cand(D)], 3000, CostParams())[0]
    assert x.prefills == () and x.reason == "no_prefill"


def test_the_decodes_own_measured_rate_prices_local_prefill():
    fast_d, slow_d = cand(D, rate=100_000.0), cand(D, rate=2_000.0)
    p = cand(P, rate=20_000.0)
    link = dict(link_bytes_per_s=3e9)
    assert decide([fast_d], [p], 1000, **link).prefills == ()
    assert decide([slow_d], [p], 1000, **link).prefills != ()


def timings(kv_bytes, compute_s, server_s, kv_wait_s) -> common_pb2.Timings:
    return common_pb2.Timings(
        kv_transfer_bytes=kv_bytes,
        kv_transfer_s=server_s,
        remote_compute_s=compute_s,
        remote_server_s=server_s,
        kv_wait_s=kv_wait_s,
        prefill_instance="p",
    )


def test_calibration_follows_the_measured_link_and_hop():
    cal = Calibration(CostParams(link_bytes_per_s=2e9, remote_overhead_s=0.003))
    # 400 MB whose transfer P waited 0.09 s for after computing, and D 0.01 s more: 4 GB/s.
    # The gateway saw 0.35 s: 0.2 s at P, 0.01 s of KV wait, so 0.14 s of hops.
    params = cal.observe_remote(0.35, timings(400_000_000, 0.11, 0.2, 0.01))
    assert abs(params.link_bytes_per_s - 4e9) < 1e3
    assert abs(params.remote_overhead_s - 0.14) < 1e-9
    # Later samples are folded in, not substituted: one outlier moves the estimate by a fifth.
    params = cal.observe_remote(0.35, timings(400_000_000, 0.11, 0.2 + 0.4, 0.01))
    assert 4e9 * 0.8 < params.link_bytes_per_s < 4e9
    # A small transfer says nothing about bandwidth.
    before = params.link_bytes_per_s
    assert cal.observe_remote(0.05, timings(10_000, 0.01, 0.02, 0.001)).link_bytes_per_s == before


def test_a_measured_slow_link_turns_remote_into_local(tmp_path):
    """KVRouter recalibrates from finished requests: once transfers are measured slow, the
    same prompt that went to P is prefilled on D. Each decision is logged with its prediction."""
    registry = StaticRegistry(["d:1"], ["p:1"])
    status = InstanceStatus("e", 16, 16 * KV_BYTES_PER_TOKEN, 8192, prefill_tokens_per_s=RATE)
    for i in ("d:1", "p:1"):
        registry.set_status(i, status)
    log_path = tmp_path / "routes.jsonl"
    router = KVRouter(
        registry, None, CostParams(link_bytes_per_s=50e9), route_log=RouteLog(str(log_path))
    )

    async def plan() -> Route:
        return (await router.plan(list(range(2000))))[0]

    import asyncio

    route = asyncio.run(plan())
    assert route.prefills and route.predicted_ttft_s > 0
    # The transfer of 288 MiB took 2 s beyond the compute: ~150 MB/s.
    kv_bytes = 2000 * KV_BYTES_PER_TOKEN
    router.observe(route, 2.2, timings(kv_bytes, 0.1, 2.1, 0.0), 2000)
    assert router.params.link_bytes_per_s < 200e6
    local = asyncio.run(plan())
    assert local.prefills == () and local.reason.startswith("local")
    router.observe(local, 0.12, common_pb2.Timings(local_prefill=True), 2000)
    asyncio.run(router.close())
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [x["planned"] for x in lines] == ["remote", "local"]
    assert lines[0]["prefill"] == "p" and lines[1]["prefill"] == ""
    assert lines[0]["measured_ttft_s"] == 2.2
    assert lines[1]["predicted_ttft_s"] == round(2000 / RATE + 0.003, 5)  # + the local hop
    # That local request took 0.12 s for 0.1 s of predicted compute: the hop is now 0.02 s.
    assert abs(router.params.local_overhead_s - 0.02) < 1e-9
    p50, p90 = router.stats.ttft_error_quantiles()
    assert 0 < p50 <= p90


def test_prefilling_on_a_kv_both_instance_counts_its_decoding_streams():
    idle_both = Candidate(D2, 0, 0, 0, RATE, KV_BYTES_PER_TOKEN, True, num_decoding=0)
    busy_both = Candidate(D2, 0, 40, 0, RATE, KV_BYTES_PER_TOKEN, True, num_decoding=40)
    link = dict(link_bytes_per_s=50e9)
    assert decide([cand(D, outstanding=8)], [idle_both], 3000, **link).prefills != ()
    assert decide([cand(D, outstanding=8)], [busy_both], 3000, **link).prefills == ()
