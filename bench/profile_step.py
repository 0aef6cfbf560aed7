"""Where one decode step's time goes on the GPU.

Per case (model, batch, context): the mean engine step over 100 back-to-back steps, the
CUDA-graph replay alone (host overhead not hidden = the difference), the kernels of one
eager forward from torch.profiler (count, GPU time, the per-layer sequence of a middle layer,
the top kernels by name) next to two floors (every weight + KV byte; the bytes a step reads,
one row of the input-embedding table instead of all of it), and a cProfile of the engine
steps (host functions by own time).

    python -m bench.profile_step [--cases qwen3-0.6b:1:512,qwen3-8b:1:512] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import write_result
from bench.gpu_engine import ceilings, dummy_llm, make_config_dir, random_prompts, step_read_bytes
from engine import LLM, SamplingParams
from engine.request import Request


def kernel_trace(graphs, bs: int) -> list[tuple[str, float]]:
    """(name, µs) of every kernel of one eager forward over the graph's static inputs."""
    graphs._forward(bs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(bs)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name[:60], e.time_range.elapsed_us()) for e in events]


def profile_case(llm: LLM, batch: int, ctx: int, copy_bps: float) -> dict:
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, ctx, 5)):
        core.add_request(Request(f"p{batch}-{ctx}-{i}", p, params))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(10):
        core.step()
    # Steps back to back, as the engine loop runs them (async scheduling overlaps them), then
    # a separate pass under cProfile (which inflates host time) for where the host time goes.
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        core.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / 100
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        core.step()
    prof.disable()
    graphs = core.runner.graphs
    bs = graphs.graph_size(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(50):
        start.record()
        graphs.graphs[bs].replay()
        end.record()
        torch.cuda.synchronize()
        replays.append(start.elapsed_time(end))
    trace = kernel_trace(graphs, bs)
    for rid in list(core.scheduler.requests):
        core.abort_request(rid)
    layers = core.config.model.num_layers
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us in trace:
        by_name[name].append(us)
    # The per-layer period: kernels between the embedding and the LM head, split evenly.
    per_layer = (len(trace) - 4) // layers
    mid = 2 + per_layer * (layers // 2)
    kv_tok = core.config.kv_bytes_per_token()
    kv_bytes = batch * (ctx + 20) * kv_tok
    floor_s = (core.runner.weights_bytes + kv_bytes) / copy_bps  # every weight byte
    read_floor_s = (step_read_bytes(core.runner) + kv_bytes) / copy_bps  # one embedding row
    host = io.StringIO()
    pstats.Stats(prof, stream=host).sort_stats("tottime").print_stats(14)
    step_ms, replay_ms = step_s * 1e3, statistics.median(replays)
    return {
        "batch": batch,
        "ctx": ctx,
        "step_ms": step_ms,
        "graph_replay_ms": replay_ms,
        "host_ms": step_ms - replay_ms,
        "floor_ms": floor_s * 1e3,
        "read_floor_ms": read_floor_s * 1e3,
        "eager_kernels": len(trace),
        "eager_kernel_sum_ms": sum(us for _, us in trace) / 1e3,
        "kernels_per_layer": per_layer,
        "middle_layer": [(n, round(us, 2)) for n, us in trace[mid : mid + per_layer]],
        "top_kernels": sorted(
            ((n, len(v), round(sum(v), 1)) for n, v in by_name.items()), key=lambda x: -x[2]
        )[:10],
        "host_profile": host.getvalue().splitlines()[:40],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="qwen3-0.6b:1:512,qwen3-8b:1:512,qwen3-8b:64:1024")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    copy_bps = ceilings()["copy_GBps"] * 1e9
    cases: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for c in args.cases.split(","):
        model, batch, ctx = c.split(":")
        cases[model].append((int(batch), int(ctx)))
    results = {"copy_GBps": copy_bps / 1e9}
    with tempfile.TemporaryDirectory() as tmp:
        for model, shapes in cases.items():
            llm = dummy_llm(make_config_dir(model, Path(tmp)))
            for batch, ctx in shapes:
                r = profile_case(llm, batch, ctx, copy_bps)
                results[f"{model}:b{batch}:ctx{ctx}"] = r
                print(f"\n== {model} batch {batch} ctx {ctx}")
                print("\n".join(r.pop("host_profile")[8:30]))
                print(json.dumps(r, indent=None)[:3000])
            del llm
            torch.cuda.empty_cache()
    print(
        "\ncase                     | step ms | replay ms | host ms | floor ms | read floor ms "
        "| eager kernels"
    )
    for k, r in results.items():
        if isinstance(r, dict):
            print(
                f"{k:24} | {r['step_ms']:7.3f} | {r['graph_replay_ms']:9.3f} | "
                f"{r['host_ms']:7.3f} | {r['floor_ms']:8.3f} | {r['read_floor_ms']:13.3f} | "
                f"{r['eager_kernels']} "
                f"({r['eager_kernel_sum_ms']:.3f} ms)"
            )
    if args.out_dir:
        write_result("profile_step", {"cases": args.cases}, results, results_dir=Path(args.out_dir))


if __name__ == "__main__":
    main()
