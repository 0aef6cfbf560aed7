"""`--fused-decode`'s batch-1 projections on the GPU against what runs without it: cuBLAS plus
the separate norm / activation kernel against kernels/gemv.py's fused forms, per projection and
for a layer's four together. Each is timed as one CUDA graph over COPIES distinct weight sets
(more bytes than the L2 holds, as in a step, where each layer's weights come from HBM), every
candidate tile of the GEMV, and cuBLAS both plain and padded to 8 rows (`tune_small_m`'s
choice).

(It also timed split decode attention's merge folded into the last partition's program against
the merge kernel: slower on the H200 and the H100, 2026-12-05, so the fold was removed; the
figures are in bench/results/fused_decode_gpu-2026-12-05*.json.)

    python -m bench.fused_decode_gpu [--models qwen3-0.6b,qwen3-8b] [--out-dir DIR]

The engine-level figure (batch-1 TPOT with and without `--fused-decode`, same run):
`python -m bench.gpu_engine --models qwen3-0.6b,qwen3-8b --variants bf16,fused-decode
--skip-hf --offline-configs ""`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import print_table, write_result
from bench.gpu_engine import SHAPES
from bench.kernels import copy_ceiling_gbps, timer
from kernels.activation import silu_and_mul
from kernels.gemv import CANDIDATES, gemv, rms_norm_gemv, silu_mul_gemv
from kernels.rms_norm import fused_add_rms_norm
from kernels.utils import graph_time_us

# hidden, q heads x head_dim, kv heads x head_dim, intermediate, layers (gpu_engine's shapes)
MODELS = {
    name: (s["hidden_size"], s["num_attention_heads"] * s["head_dim"],
           s["num_key_value_heads"] * s["head_dim"], s["intermediate_size"],
           s["num_hidden_layers"])
    for name, s in SHAPES.items()
}  # fmt: skip
EPS = 1e-6


def _linear(x, w, pad):
    if pad:
        return F.linear(F.pad(x, (0, 0, 0, pad - x.shape[0])), w)[: x.shape[0]]
    return F.linear(x, w)


def _time(ops) -> float:
    """GPU us per layer: `ops` is one callable per weight copy, all in one graph."""
    return graph_time_us(lambda: [op() for op in ops], reps=4, replays=10) / len(ops)


def bench_model(name: str, copies: int) -> dict:
    hidden, q, kv, inter, layers = MODELS[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter),
              "down": (inter, hidden)}  # fmt: skip
    weights = {
        p: [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for p, (k, n) in shapes.items()
    }
    gamma = torch.ones(hidden, device=dev, dtype=dt)
    x_h = torch.randn(1, hidden, device=dev, dtype=dt)
    res = torch.randn(1, hidden, device=dev, dtype=dt)
    x_q = torch.randn(1, q, device=dev, dtype=dt)
    x_gu = torch.randn(1, 2 * inter, device=dev, dtype=dt)

    def cublas(p, w, pad):
        if p in ("qkv", "gate_up"):  # the fused add + RMSNorm kernel, then the GEMM
            return lambda: _linear(fused_add_rms_norm(x_h, res, gamma, EPS)[0], w, pad)
        if p == "down":
            return lambda: _linear(silu_and_mul(x_gu), w, pad)
        return lambda: _linear(x_q, w, pad)

    def fused(p, w, cfg):
        if p in ("qkv", "gate_up"):
            return lambda: rms_norm_gemv(x_h, gamma, EPS, w, residual=res, config=cfg)
        if p == "down":
            return lambda: silu_mul_gemv(x_gu, w, config=cfg)
        return lambda: gemv(x_q, w, config=cfg)

    rows, out = [], {}
    for p, ws in weights.items():
        base = {pad: _time([cublas(p, w, pad) for w in ws]) for pad in (0, 8)}
        cands = {cfg: _time([fused(p, w, cfg) for w in ws]) for cfg in CANDIDATES}
        best = min(cands, key=cands.get)
        bytes_ = ws[0].nbytes
        out[p] = {
            "cublas_us": base[0], "cublas_pad8_us": base[8], "gemv_best_us": cands[best],
            "gemv_best": vars(best), "weight_MB": bytes_ / 1e6,
            "gemv_us": {str(vars(c)): t for c, t in cands.items()},
        }  # fmt: skip
        tile = f"{best.block_n}x{best.block_k}{' re' if best.reduce_each else ''}"
        rows.append((name, p, f"{min(base.values()):.2f}", f"{cands[best]:.2f}", tile))
    base_layer = sum(min(v["cublas_us"], v["cublas_pad8_us"]) for v in out.values())
    best_layer = sum(
        min(v["cublas_us"], v["cublas_pad8_us"], v["gemv_best_us"]) for v in out.values()
    )
    rows.append((name, "layer", f"{base_layer:.2f}", f"{best_layer:.2f}", "best of each"))
    return {
        "projections": out,
        "layer_cublas_us": base_layer,
        "layer_best_us": best_layer,
        "predicted_step_saving_ms": (base_layer - best_layer) * layers / 1e3,
        "_rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--copies", type=int, default=4, help="weight sets per graph (> L2)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbs = copy_ceiling_gbps(dev, 1 << 30, timer(dev))
    results, rows = {"copy_GBps": copy_gbs}, []
    for name in args.models.split(","):
        res = bench_model(name, args.copies)
        rows += res.pop("_rows")
        results[name] = res
    print(f"copy {copy_gbs:,.0f} GB/s")
    print_table(rows, ("model", "projection", "cuBLAS (+ op) us", "fused GEMV us", "tile"))
    if args.out_dir:
        write_result("fused_decode_gpu", {"models": args.models, "copies": args.copies}, results,
                     results_dir=Path(args.out_dir))  # fmt: skip


if __name__ == "__main__":
    main()
