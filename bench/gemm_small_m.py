"""cuBLAS at decode shapes: which torch call reads the weights fastest for small M?

Decode GEMMs are weight reads (M = batch rows, K x N bf16 weights). The profile of a Qwen3-0.6B
step showed cuBLAS's pick for o_proj (M=1, K=2048, N=1024) at 12 µs for 4 MB; this measures
each linear of Qwen3-0.6B and -8B at M in {1, 8, 64} through F.linear, through the swapped
product (W @ x^T)^T and, for M=1, torch.mv, timed as CUDA-graph replays with an L2 flush.

    python -m bench.gemm_small_m [--out-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import write_result
from bench.kernels import timer

SHAPES = {  # name: (K, N)
    "0.6b qkv": (1024, 4096),
    "0.6b o": (2048, 1024),
    "0.6b gate_up": (1024, 6144),
    "0.6b down": (3072, 1024),
    "0.6b lm_head": (1024, 151936),
    "8b qkv": (4096, 6144),
    "8b o": (4096, 4096),
    "8b gate_up": (4096, 24576),
    "8b down": (12288, 4096),
    "8b lm_head": (4096, 151936),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    time_s = timer(dev)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / time_s(lambda: dst.copy_(src))
    rows = []
    print(f"copy {copy_bps / 1e9:,.0f} GB/s")
    print(f"{'shape':14} {'M':>3} | {'linear us':>9} {'swap us':>8} {'mv us':>7} | best % copy")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in (1, 8, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t = {
                "linear": time_s(lambda x=x, w=w: F.linear(x, w)),
                "swap": time_s(lambda x=x, w=w: torch.mm(w, x.t()).t()),
            }
            if m == 1:
                t["mv"] = time_s(lambda x=x, w=w: torch.mv(w, x[0]))
            best = min(t, key=t.get)
            pct = 100 * w.nbytes / t[best] / copy_bps
            rows.append({"shape": name, "M": m, **{f"{k}_us": v * 1e6 for k, v in t.items()},
                         "best": best, "best_pct_of_copy": pct})  # fmt: skip
            print(
                f"{name:14} {m:3} | {t['linear'] * 1e6:9.2f} {t['swap'] * 1e6:8.2f} "
                f"{t.get('mv', float('nan')) * 1e6:7.2f} | {best} {pct:.0f}%"
            )
    if args.out_dir:
        write_result(
            "gemm_small_m", {"dtype": "bfloat16"}, {"copy_GBps": copy_bps / 1e9, "rows": rows},
            results_dir=Path(args.out_dir),
        )  # fmt: skip


if __name__ == "__main__":
    main()
