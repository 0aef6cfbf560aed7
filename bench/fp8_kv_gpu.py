"""FP8 KV cache against bf16 on the H200, in one run (issue "Speed round 2", item 2).

Qwen3-8B shape, dummy bf16 weights, CUDA graphs; the copy ceiling measured in the same run.
For `--kv-cache-dtype auto` (bf16) and `fp8`:
- KV capacity: the tokens the cache holds at the same `gpu_memory_utilization` (the start-up
  log's figure: fp8 should double it);
- decode step time at batch B and context C (`--points`, B:C pairs), next to its floor
  (weights + B x C x KV bytes per token) / copy bandwidth: where the KV read dominates (long
  contexts, large batches) FP8 should approach half the KV time;
- with `--accuracy`: `bench.fp8_kv_accuracy --device cuda --dtype bfloat16` afterwards (SmolLM2,
  real weights, bf16 cache vs FP8 cache), written as its own file.

    TRITON_INTERPRET=0 python -m bench.fp8_kv_gpu --out-dir bench/results [--accuracy]
Writes `fp8_kv_gpu-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import print_table, write_result
from bench.gpu_engine import ceilings, dummy_llm, make_config_dir, random_prompts, step_times

MODES = ("auto", "fp8")


def speed(path: Path, kv_cache_dtype: str, ceil: dict, points: list[tuple[int, int]]) -> dict:
    llm = dummy_llm(path, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    kv_tok = llm.config.kv_bytes_per_token()
    weights = runner.weights_bytes
    res: dict = {
        "kv_cache_dtype": str(runner.kv_cache.dtype),
        "kv_bytes_per_token": kv_tok,
        "kv_capacity_tokens": (runner.kv_cache.shape[0] - 1) * llm.config.cache.block_size,
    }
    step_times(llm, random_prompts(2, 64, 99), 8)  # warm-up
    for batch, ctx in points:
        # Decode until every prompt of the batch has been prefilled (8,192 tokens a step) and
        # then for 32 steps more, so some steps give every request a token.
        prefill_steps = -(-batch * ctx // 8192)
        _, step = step_times(llm, random_prompts(batch, ctx, batch + ctx), 32 + 2 * prefill_steps)
        assert step > 0, f"no step decoded all {batch} requests"

        kv_bytes = batch * (ctx + 16) * kv_tok  # the mean context over the measured steps
        floor = (weights + kv_bytes) / (ceil["copy_GBps"] * 1e9)
        res[f"b{batch}_ctx{ctx}"] = {
            "step_ms": step * 1e3,
            "floor_ms": floor * 1e3,
            "over_floor": step / floor,
            "kv_share_of_floor": kv_bytes / (weights + kv_bytes),
        }
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--points", default="1:512,1:4096,32:4096,64:4096", help="batch:context")
    ap.add_argument("--accuracy", action="store_true", help="then bench.fp8_kv_accuracy on GPU")
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    ceil = ceilings()
    results: dict = {"ceilings": ceil}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir("qwen3-8b", Path(tmp))
        for mode in MODES:
            results[mode] = speed(path, mode, ceil, points)
            print(mode, results[mode], flush=True)
    bf16, fp8 = results["auto"], results["fp8"]
    results["fp8_over_bf16"] = {
        "kv_capacity_tokens": fp8["kv_capacity_tokens"] / bf16["kv_capacity_tokens"],
        **{f"b{b}_ctx{c}_step": fp8[f"b{b}_ctx{c}"]["step_ms"] / bf16[f"b{b}_ctx{c}"]["step_ms"]
           for b, c in points},
    }  # fmt: skip
    config = {"model_shape": "qwen3-8b", "weights": "dummy bf16", "points": args.points}
    write_result("fp8_kv_gpu", config, results, Path(args.out_dir))
    rows = [("KV capacity (tokens)", f"{bf16['kv_capacity_tokens']:,}",
             f"{fp8['kv_capacity_tokens']:,}", "")]  # fmt: skip
    for b, c in points:
        key = f"b{b}_ctx{c}"
        rows.append((f"step ms, batch {b}, ctx {c}",
                     f"{bf16[key]['step_ms']:.2f} ({bf16[key]['over_floor']:.2f}x floor)",
                     f"{fp8[key]['step_ms']:.2f} ({fp8[key]['over_floor']:.2f}x floor)",
                     f"{results['fp8_over_bf16'][key + '_step']:.2f}"))  # fmt: skip
    print_table(rows, ("figure", "bf16 KV", "fp8 KV", "fp8 / bf16"))
    if args.accuracy:
        cmd = [sys.executable, "-m", "bench.fp8_kv_accuracy", "--device", "cuda",
               "--dtype", "bfloat16", "--out-dir", args.out_dir]  # fmt: skip
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
