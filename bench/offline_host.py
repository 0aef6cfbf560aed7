"""Where the host's time between engine steps goes in the offline job (GPU; CPU for a smoke
test). `gpu_engine`'s offline job (N prompts of 512 in / 128 out, Qwen3-8B shape, dummy bf16
weights) with cProfile on outside `ModelRunner.execute` (the synchronous steps' own work):
what the host does while the GPU waits between two steps. Also the host-side gap between
consecutive synchronous steps, by the kinds of step around it.

    python -m bench.offline_host --out-dir bench/results [--num-prompts 1000]
Writes `offline_host-<date>.json` (the top functions by own time) and prints them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_result
from bench.gpu_engine import OFFLINE_PARAMS, SHAPES, make_config_dir, offline_llm, random_prompts
from engine import SamplingParams

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        name = "qwen3-8b" if cuda else "tiny"
        path = make_config_dir(name, Path(tmp), SHAPES["qwen3-8b"] if cuda else TINY)
        on = {} if cuda else {"dtype": "float32", "device": "cpu"}
        llm = offline_llm(path, max_num_seqs=256, max_batched=8192, **on)
    runner, prof = llm.engine.runner, cProfile.Profile()
    execute, marks, profiling = runner.execute, [], [False]

    def unprofiled(sched, kv):  # the step itself: off the profile
        if profiling[0]:
            prof.disable()
        t = time.perf_counter()
        out = execute(sched, kv)
        mixed = max(s.num_new_tokens for s in sched.scheduled) > 1
        marks.append((t, time.perf_counter(), "mixed" if mixed else "decode"))
        if profiling[0]:  # (Python 3.12: enabling an enabled profiler raises)
            prof.enable()
        return out

    runner.execute = unprofiled
    llm.generate(random_prompts(64, 512, 4), SamplingParams(temperature=0, max_tokens=8))
    marks.clear()
    t = time.perf_counter()
    profiling[0] = True
    prof.enable()
    llm.generate(random_prompts(args.num_prompts, 512, 3), OFFLINE_PARAMS)
    prof.disable()
    profiling[0] = False
    wall = time.perf_counter() - t
    gaps: dict[str, list[float]] = {}
    for (_, end, k0), (start, _, k1) in zip(marks, marks[1:]):
        gaps.setdefault(f"{k0}->{k1}", []).append(start - end)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # own time
    top = [
        {
            "function": f"{Path(f).name}:{line}({fn})",
            "calls": nc,
            "own_s": tt,
            "cumulative_s": ct,
        }
        for (f, line, fn), (_, nc, tt, ct, _) in rows
    ]
    figures = {
        "wall_s": wall,
        "sync_steps": len(marks),
        "sync_execute_s": sum(b - a for a, b, _ in marks),
        "host_gap_between_sync_steps": {
            k: {"n": len(v), "sum_s": sum(v), "mean_ms": 1e3 * statistics.mean(v)}
            for k, v in gaps.items()
        },
        "profiled_s": stats.total_tt,
        "top_own_time": top,
    }
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    print({k: v for k, v in figures.items() if k != "top_own_time"})
    if args.out_dir:
        config = {"model": name, "num_prompts": args.num_prompts, "cuda": cuda}
        write_result("offline_host", config, figures, results_dir=Path(args.out_dir))


if __name__ == "__main__":
    main()
