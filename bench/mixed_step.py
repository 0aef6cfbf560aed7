"""Mixed steps (decodes plus a prefill chunk) on the GPU: wall time, GPU kernel time, roofline.

Why: through `tandem serve` colocated with `--max-prefill-tokens-while-decoding 512`, a step of
~128 decodes plus one 512-token chunk shows as an inter-token gap of ~37 ms on the H200
(`results/serve_gpu_backlog-2026-12-02.json`), about twice a roofline estimate. Such steps run
eagerly (no CUDA graph) and synchronously (the engine pipelines only decode-only steps); this
measures how much of a mixed step is the GPU's work and how much is the host's, next to the
decode-only step of the same batch.

Per point (batch B decoding at context C, chunk P): B requests are prefilled and decoding;
then long prompts are queued, so that each following step carries B decodes plus P prompt
tokens (the engine's `max_prefill_tokens_while_decoding` = P). Reported:
- `decode_step_ms`, `mixed_step_ms`: median wall time of back-to-back engine steps;
- `mixed_gpu_ms`: the kernels' summed GPU time per mixed step (torch.profiler), and
  `mixed_host_exposed_ms` = wall - GPU: host time the GPU waited for;
- `mixed_roofline_ms`: max(2 x params x (B + P) FLOPs / matmul ceiling, (weights + KV read)
  bytes / copy ceiling), ceilings measured in the same run.

- with `--host-profile`, `host_top`: the functions taking the most host time in the mixed
  steps (cProfile, own time per step), to tell launch overhead from scheduling.

    TRITON_INTERPRET=0 python -m bench.mixed_step [--points 128:512:512,64:1024:512]
    python -m bench.mixed_step --tiny      # CPU smoke check (no GPU figures)
Writes `mixed_step-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, prompt_tokens_left, write_result
from bench.gpu_engine import ceilings, dummy_llm, make_config_dir, param_count, random_prompts
from engine import LLM, SamplingParams
from engine.request import Request

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32)  # fmt: skip
FEEDER_LEN = 4096  # the queued prompts: P tokens of one of them per step


def make_llm(path: Path, chunk: int, tiny: bool, mode: str) -> LLM:
    """The latency benchmarks' engine, its prompt tokens beside decodes capped at `chunk`,
    with CUDA graphs in `mode` (vLLM's cudagraph_mode)."""
    return dummy_llm(
        path,
        dtype="float32" if tiny else "bfloat16",
        max_prefill_tokens_while_decoding=chunk,
        enable_prefix_caching=False,
        cudagraph_mode=mode,
    )


def timed_steps(llm: LLM, num_steps: int) -> tuple[list[float], list[int]]:
    """Wall seconds of each of `num_steps` engine steps, and the prompt tokens each computed
    (the check that a window is what it claims: 0 for decode-only, the chunk for mixed)."""
    core, times, prompt_tokens = llm.engine, [], []

    for _ in range(num_steps):
        left = prompt_tokens_left(core)
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        prompt_tokens.append(left - prompt_tokens_left(core))
    return times, prompt_tokens


def gpu_ms_per_step(llm: LLM, num_steps: int, top: int = 12) -> tuple[float, list[dict]]:
    """Summed CUDA kernel time of `num_steps` engine steps, per step, and the `top` kernels by
    their share of it (name, ms and launches per step)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            llm.engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in events)
    kernels = [{"kernel": e.key[:120], "ms_per_step": e.self_device_time_total / 1e3 / num_steps,
                "launches_per_step": e.count / num_steps} for e in events[:top]]  # fmt: skip
    return total_us / 1e3 / num_steps, kernels


def host_profile(llm: LLM, num_steps: int, top: int = 25) -> list[dict]:
    """cProfile over `num_steps` engine steps: the `top` functions by own time, per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(num_steps):
        llm.engine.step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(file).name}:{line}:{func}" if line else func
        rows.append({"func": where, "calls_per_step": ncalls / num_steps,
                     "own_ms_per_step": 1e3 * tottime / num_steps,
                     "cum_ms_per_step": 1e3 * cumtime / num_steps})  # fmt: skip
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:top]


def point(
    llm: LLM, batch: int, ctx: int, chunk: int, ceil: dict | None, seed: int, profile: bool
) -> dict:
    core = llm.engine
    steps = 12
    # Enough tokens for the decode-only and mixed windows and the profiled steps after them.
    params = SamplingParams(temperature=0, max_tokens=8 * steps + 64, ignore_eos=True)
    rids = [f"d{seed}-{i}" for i in range(batch)]
    for rid, p in zip(rids, random_prompts(batch, ctx, seed)):
        core.add_request(Request(rid, p, params))

    def all_decoding() -> bool:
        running = core.scheduler.running
        return len(running) == batch and all(r.num_output_tokens > 1 for r in running)

    while not all_decoding():
        core.step()  # every prompt in, every request decoding
    decode, decode_prompt = timed_steps(llm, steps)
    # Feeders: each step takes `chunk` of their prompt tokens (one feeder lasts
    # FEEDER_LEN / chunk steps; 4 of them outlast the windows below).
    num_feeders = -(-3 * steps * chunk // FEEDER_LEN) + 1
    fparams = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(random_prompts(num_feeders, FEEDER_LEN, seed + 1)):
        core.add_request(Request(f"f{seed}-{i}", p, fparams))
    core.step()  # the first chunk: a step that also decides what is admitted
    mixed, mixed_prompt = timed_steps(llm, steps)
    assert not any(decode_prompt) and set(mixed_prompt) == {chunk}, (decode_prompt, mixed_prompt)
    res = {
        "batch": batch,
        "ctx": ctx,
        "chunk": chunk,
        "decode_step_ms": 1e3 * statistics.median(decode),
        "mixed_step_ms": 1e3 * statistics.median(mixed),
    }
    if ceil is not None:
        res["mixed_gpu_ms"], res["mixed_kernels"] = gpu_ms_per_step(llm, steps)
        res["mixed_host_exposed_ms"] = res["mixed_step_ms"] - res["mixed_gpu_ms"]
        weights = llm.engine.runner.weights_bytes
        flops = 2 * param_count(llm) * (batch + chunk)
        kv_read = batch * (ctx + 4 * steps) * llm.config.kv_bytes_per_token()
        compute_s = flops / (ceil["matmul_bf16_TFLOPs"] * 1e12)
        memory_s = (weights + kv_read) / (ceil["copy_GBps"] * 1e9)
        res["mixed_roofline_ms"] = 1e3 * max(compute_s, memory_s)
        res["mixed_over_roofline"] = res["mixed_step_ms"] / res["mixed_roofline_ms"]
    if profile:
        res["host_top"] = host_profile(llm, steps // 2)
    for rid in [*rids, *(f"f{seed}-{i}" for i in range(num_feeders))]:
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    return res


def capture_stats(llm: LLM) -> dict | None:
    """What capturing the piecewise graphs took (None: no piecewise graphs)."""
    pieces = llm.engine.runner.piecewise
    if pieces is None:
        return None
    return {"seconds": pieces.capture_s, "bytes": pieces.capture_bytes, "sizes": pieces.sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="128:512:512,64:1024:512,128:512:2048",
                    help="batch:context:chunk")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check: a 2-layer model")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the mixed steps")
    ap.add_argument("--cudagraph-modes", default="FULL_AND_PIECEWISE,FULL_DECODE_ONLY",
                    help="engines to compare, one after the other (comma-separated)")  # fmt: skip
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    modes = args.cudagraph_modes.split(",")
    if args.tiny:
        points = [(4, 32, 16)]
    ceil = None if args.tiny else ceilings()
    results: dict = {"ceilings": ceil, "points": [], "capture": {}}
    with tempfile.TemporaryDirectory() as tmp:
        shape = TINY if args.tiny else None
        path = make_config_dir("qwen3-8b", Path(tmp), shape)
        for mode in modes:
            llms: dict[int, LLM] = {}
            for i, (batch, ctx, chunk) in enumerate(points):
                if chunk not in llms:
                    llms.clear()  # one engine on the GPU at a time
                    llms[chunk] = make_llm(path, chunk, args.tiny, mode)
                    results["capture"][mode] = capture_stats(llms[chunk])
                res = point(llms[chunk], batch, ctx, chunk, ceil, i, args.host_profile)
                results["points"].append({"cudagraph_mode": mode, **res})
                shown = {k: v for k, v in results["points"][-1].items()
                         if k not in ("host_top", "mixed_kernels")}  # fmt: skip
                print(shown, flush=True)
            llms.clear()  # the next engine needs the memory
    config = {"model_shape": "tiny" if args.tiny else "qwen3-8b", "weights": "dummy",
              "points": args.points, "tiny": args.tiny, "cudagraph_modes": modes}  # fmt: skip
    write_result("mixed_step", config, results, Path(args.out_dir))
    rows = []
    for r in results["points"]:
        gpu = f"{r['mixed_gpu_ms']:.1f}" if "mixed_gpu_ms" in r else "-"
        roof = f"{r['mixed_roofline_ms']:.1f}" if "mixed_roofline_ms" in r else "-"
        shape = f"{r['batch']} x {r['ctx']} + {r['chunk']}"
        rows.append((r["cudagraph_mode"], shape, f"{r['decode_step_ms']:.1f}",
                     f"{r['mixed_step_ms']:.1f}", gpu, roof))  # fmt: skip
    print_table(
        rows, ("graphs", "decodes x ctx + chunk", "decode ms", "mixed ms", "GPU ms", "roofline ms")
    )
    for r in results["points"]:
        if r.get("mixed_kernels"):
            print(f"GPU, {r['cudagraph_mode']}, {r['batch']} x {r['ctx']} + {r['chunk']}: "
                  "ms per step, launches")  # fmt: skip
            for k in r["mixed_kernels"][:8]:
                print(
                    f"  {k['ms_per_step']:6.2f} {k['launches_per_step']:5.0f}  {k['kernel'][:70]}"
                )
    for r in results["points"]:
        if "host_top" in r:
            print(f"host, {r['cudagraph_mode']}, {r['batch']} x {r['ctx']} + {r['chunk']}: "
                  "ms per step (own / cum), calls")  # fmt: skip
            for h in r["host_top"][:12]:
                print(f"  {h['own_ms_per_step']:6.2f} {h['cum_ms_per_step']:6.2f} "
                      f"{h['calls_per_step']:6.0f}  {h['func'][-70:]}")  # fmt: skip


if __name__ == "__main__":
    main()
