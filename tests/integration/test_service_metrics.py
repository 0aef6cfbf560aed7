"""Services expose Prometheus metrics with vLLM's names on an internal port, updated by work."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.sampling_params import SamplingParams
from tandem.launcher import Cluster
from tests.integration.services import (
    ENGINE_FLAGS,
    collect,
    decode_stub,
    free_port,
    generate_request,
    metric_value,
)


@pytest.fixture(scope="module")
def services(tiny_qwen3_path):
    ports = [free_port(), free_port()]
    cluster = Cluster(log_prefix=False)
    p = cluster.start(
        "prefill", [str(tiny_qwen3_path), *ENGINE_FLAGS, "--metrics-port", str(ports[0])]
    )
    d = cluster.start(
        "decode", [str(tiny_qwen3_path), *ENGINE_FLAGS, "--metrics-port", str(ports[1])]
    )
    yield p.address, d.address, ports
    cluster.stop()


def test_metrics_follow_the_work(services):
    p_addr, d_addr, (p_port, d_port) = services
    before_d = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        metric_value(before_d, name)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = list(range(10, 60))

    async def run():
        stub = decode_stub(d_addr)
        await collect(stub, generate_request("m1", prompt, params, [p_addr]))
        await collect(stub, generate_request("m2", prompt + [1], params, [p_addr]))

    asyncio.run(run())
    after_d = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
    after_p = httpx.get(f"http://127.0.0.1:{p_port}/metrics").text
    assert metric_value(after_d, "vllm:time_to_first_token_seconds_count") == 2
    assert metric_value(after_d, "vllm:inter_token_latency_seconds_count") == 8
    assert metric_value(after_d, "tandem:num_remote_prefills_total") == 2
    # A remote prefill's parts at the decode, one each per remote prefill; the reservation and
    # the Prefill call come before the first token, the call's transit is part of the call.
    parts = {
        part: metric_value(after_d, f"tandem:remote_prefill_{part}_seconds_sum")
        - metric_value(before_d, f"tandem:remote_prefill_{part}_seconds_sum")
        for part in ("setup", "rpc", "transit")
    }
    for part in parts:
        assert metric_value(after_d, f"tandem:remote_prefill_{part}_seconds_count") == 2
    ttft_s = metric_value(after_d, "vllm:time_to_first_token_seconds_sum")
    assert 0 < parts["setup"] + parts["rpc"] <= ttft_s and 0 <= parts["transit"] <= parts["rpc"]
    assert metric_value(after_p, "tandem:kv_transfer_bytes_total") > 0
    assert metric_value(after_p, "vllm:prefix_cache_hits_total") >= 48  # 2nd prompt reuses 3 blocks
    # vLLM's queue and prefill phases: for the prompts D prefills itself only (a remote
    # prefill's first token is P's, out before D schedules the request).
    assert metric_value(after_d, "vllm:request_queue_time_seconds_count") == 0
    assert metric_value(after_d, "vllm:request_prefill_time_seconds_count") == 0

    async def local():
        await collect(decode_stub(d_addr), generate_request("m3", prompt + [2], params))

    asyncio.run(local())
    local_d = httpx.get(f"http://127.0.0.1:{d_port}/metrics").text
    assert metric_value(local_d, "vllm:request_queue_time_seconds_count") == 1
    assert metric_value(local_d, "vllm:request_prefill_time_seconds_count") == 1
    queue_s, prefill_s = (
        metric_value(local_d, f"vllm:request_{phase}_time_seconds_sum")
        - metric_value(after_d, f"vllm:request_{phase}_time_seconds_sum")
        for phase in ("queue", "prefill")
    )
    ttft_s = metric_value(local_d, "vllm:time_to_first_token_seconds_sum") - metric_value(
        after_d, "vllm:time_to_first_token_seconds_sum"
    )
    assert prefill_s > 0 and queue_s >= 0
    assert queue_s + prefill_s <= ttft_s  # both inside the handler's TTFT
    # Internal port only: the gRPC port does not serve it.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{d_addr}/metrics", timeout=2)
