"""Where one decode step's time goes on the GPU: graph replay alone vs the whole engine step
(host overhead = the difference), plus a cProfile of the engine steps.

    python -m bench.profile_step [--model qwen3-0.6b] [--batch 1]
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

from bench.gpu_engine import make_config_dir, random_prompts
from engine import LLM, SamplingParams
from engine.request import Request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(args.model, Path(tmp))
        llm = LLM(
            str(path),
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=4096,
            max_num_seqs=256,
            gpu_memory_utilization=0.5,
        )
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, p in enumerate(random_prompts(args.batch, 512)):
        core.add_request(Request(f"r{i}", p, params))
    for _ in range(20):
        core.step()
    steps = []
    prof = cProfile.Profile()
    for _ in range(200):
        torch.cuda.synchronize()
        t = time.perf_counter()
        prof.enable()
        core.step()
        prof.disable()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
    graphs = core.runner.graphs
    bs = graphs.graph_size(args.batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(50):
        start.record()
        graphs.graphs[bs].replay()
        end.record()
        torch.cuda.synchronize()
        replays.append(start.elapsed_time(end))
    step_ms, replay_ms = statistics.median(steps) * 1e3, statistics.median(replays)
    print(
        f"{args.model} batch {args.batch}: step {step_ms:.3f} ms, graph replay "
        f"{replay_ms:.3f} ms, host overhead {step_ms - replay_ms:.3f} ms"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
