"""The gateway benchmarks' bookkeeping: stage shares weighed by thread CPU, the raw transport's
framing, per-thread counters per request."""

from __future__ import annotations

import os
import time

import pytest

from bench import gateway_stages, gateway_transport
from protos import decode_pb2

MAIN = "thread (100): MainThread;run (asyncio/runners.py:118)"
POLLER = "thread (101): Thread-1 (_poll_wrapper);run (threading.py:982)"
RAW = "\n".join(
    [
        f"{MAIN};encode_bounded (gateway/light_tokenizer.py:10) 30",
        f"{MAIN};_write (grpc/aio/_call.py:500) 10",
        f"{POLLER} 60",
    ]
)


def test_shares_without_thread_cpu_are_sample_shares():
    shares, num = gateway_stages.shares(RAW)
    assert num == 100
    assert shares == pytest.approx({"grpc": 0.7, "template_tokenize": 0.3})


def test_shares_weigh_each_thread_to_its_cpu_and_count_unsampled_threads():
    thread_cpu = {
        "100": ("python", 0.8),  # main: 40 samples stand for 0.8 s
        "101": ("python", 0.1),  # the poller drew 60 samples for 0.1 s of CPU
        "102": ("event_engine", 0.06),  # no Python frames: never sampled
        "103": ("someone_else", 0.04),
    }
    shares, num = gateway_stages.shares(RAW, thread_cpu)
    assert num == 100
    assert shares == pytest.approx(
        {
            "template_tokenize": 0.6,  # 30/40 of main's 0.8 s, of 1.0 s in all
            "grpc": 0.2 + 0.1 + 0.06,  # main's _write, the poller, event_engine
            "other_threads": 0.04,
        }
    )


def test_thread_cpu_of_this_process():
    before = gateway_stages.thread_cpu_s(os.getpid())
    sum(i * i for i in range(200_000))  # some CPU on this thread
    between = gateway_stages.thread_cpu_between(before, gateway_stages.thread_cpu_s(os.getpid()))
    name, cpu_s = between[str(os.getpid())]
    assert cpu_s > 0
    assert all(cpu >= 0 for _, cpu in between.values())


def test_frames_split_and_join_messages_at_any_boundary():
    messages = [
        decode_pb2.MuxRequest(id=i, start=decode_pb2.GenerateRequest(request_id=f"r{i}"))
        for i in range(1, 4)
    ]
    stream = b"".join(gateway_transport._frame(m) for m in messages)
    for cut in range(len(stream) + 1):
        frames = gateway_transport._Frames(decode_pb2.MuxRequest)
        got = frames.feed(stream[:cut]) + frames.feed(stream[cut:])
        assert got == messages
        assert not frames.buffer


def test_per_request_sums_threads_by_kind():
    before = {"1": ("main", 1.0, 10, 5), "2": ("poller", 0.5, 100, 1)}
    after = {
        "1": ("main", 1.3, 40, 5),
        "2": ("poller", 0.52, 120, 2),
        "3": ("event_engine", 0.01, 30, 0),  # new since `before`
    }
    r = gateway_transport.per_request(before, after, 10)
    assert r["threads"]["main"] == {
        "cpu_ms": 30.0,
        "voluntary_switches": 3.0,
        "involuntary_switches": 0.0,
    }
    assert r["threads"]["event_engine"]["cpu_ms"] == 1.0
    assert r["cpu_ms_per_request"] == pytest.approx(33.0)
    assert r["wakeups_per_request"] == pytest.approx(3.0 + 2.0 + 3.0)


def test_cache_refill_times_known_work_and_runs_every_piece():
    from bench import cache_refill

    def spin_300us():
        end = time.perf_counter() + 300e-6
        while time.perf_counter() < end:
            pass

    r = cache_refill.measure(spin_300us, gap_s=0.001, calls=5)
    assert r["cold_wall_us"] >= 300 and r["warm_wall_us"] >= 300
    assert 0 < r["warm_cpu_us"] <= r["warm_wall_us"] * 1.5
    for name, fn in cache_refill.pieces().items():  # the gateway's own code: they must work
        assert fn(), name


def test_cpu_windows_alternate_which_gateway_goes_first():
    from bench.gateway_overhead import cpu_window_order

    gateways = ["current", "baseline"]
    order = cpu_window_order(gateways, 4)
    assert order == ["current", "baseline", "baseline", "current"] * 2
    firsts = [order[i] for i in range(0, len(order), 2)]
    assert firsts.count("current") == firsts.count("baseline")
