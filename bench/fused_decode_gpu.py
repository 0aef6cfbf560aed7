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

import kernels.gemv
from bench.common import print_table, write_result
from bench.gpu_engine import SHAPES
from bench.kernels import copy_ceiling_gbps, timer
from kernels.activation import silu_and_mul
from kernels.gemv import CANDIDATES, GemvConfig, gemv, rms_norm_gemv, silu_mul_gemv
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


def _chain_us(ops: dict[str, list]) -> dict[bool, float]:
    """A layer's four GEMVs one after another (qkv, o, gate_up, down, then the next weight set's),
    us per layer, launched with programmatic dependent launch and without."""
    layers = list(zip(*ops.values()))
    out = {}
    for pdl in (False, True):
        kernels.gemv.PDL = pdl
        out[pdl] = graph_time_us(lambda: [op() for ls in layers for op in ls], reps=4,
                                 replays=10) / len(layers)  # fmt: skip
    kernels.gemv.PDL = False
    return out


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
            "gemv_us": {str(vars(c)): t for c, t in cands.items()}, "_t": cands,
        }  # fmt: skip
        tile = f"{best.block_n}x{best.block_k}{' re' if best.reduce_each else ''}"
        rows.append((name, p, f"{min(base.values()):.2f}", f"{cands[best]:.2f}", tile))
    chain = _chain_us({p: [fused(p, w, min(CANDIDATES, key=lambda c, p=p: out[p]["_t"][c]))
                           for w in ws] for p, ws in weights.items()})  # fmt: skip
    rows.append((name, "4 GEMVs: no PDL | PDL", f"{chain[False]:.2f}", f"{chain[True]:.2f}", ""))
    for v in out.values():
        v.pop("_t")
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
        "layer_gemv_chain_us": {"pdl": chain[True], "no_pdl": chain[False]},
        "_rows": rows,
    }


# FP8 (`--fp8`): the GEMV's tiles, including wider K tiles than the bf16 list (a byte a weight:
# half the bytes in flight per tile). (Turning the e4m3 bytes into fp32 by placing their bits
# instead of the hardware conversion was slower on every projection: H100, Qwen3-8B,
# bench/results/fused_decode_gpu_fp8-2026-12-05-h100.json. Removed.)
FP8_TILES = (
    GemvConfig(16, 512), GemvConfig(8, 1024), GemvConfig(4, 2048), GemvConfig(32, 256),
    GemvConfig(16, 1024, 8), GemvConfig(8, 2048), GemvConfig(4, 4096), GemvConfig(2, 4096),
    GemvConfig(8, 1024, reduce_each=True), GemvConfig(4, 2048, reduce_each=True),
    GemvConfig(16, 1024, 8, reduce_each=True), GemvConfig(8, 2048, reduce_each=True),
    GemvConfig(4, 4096, reduce_each=True),
)  # fmt: skip


def bench_model_fp8(name: str, copies: int, copy_gbs: float) -> dict:
    """`--quantization fp8`'s batch-1 projections: what runs today (the separate op, then
    fp8_weight_gemm's unfused GEMV at its best tile) against the fused GEMV at every FP8 tile
    and conversion, each next to its floor (the FP8 weight's bytes at the copy bandwidth)."""
    from engine.quantization import quantize_rows
    from kernels.fp8_gemm import GEMV_CANDIDATES, fp8_weight_gemm

    hidden, q, kv, inter, layers = MODELS[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter),
              "down": (inter, hidden)}  # fmt: skip
    gamma = torch.ones(hidden, device=dev, dtype=dt)
    x_h = torch.randn(1, hidden, device=dev, dtype=dt)
    res = torch.randn(1, hidden, device=dev, dtype=dt)
    x_q = torch.randn(1, q, device=dev, dtype=dt)
    x_gu = torch.randn(1, 2 * inter, device=dev, dtype=dt)

    def today(p, w, s, cfg):
        if p in ("qkv", "gate_up"):
            return lambda: fp8_weight_gemm(fused_add_rms_norm(x_h, res, gamma, EPS)[0], w, s,
                                           gemv_config=cfg)  # fmt: skip
        if p == "down":
            return lambda: fp8_weight_gemm(silu_and_mul(x_gu), w, s, gemv_config=cfg)
        return lambda: fp8_weight_gemm(x_q, w, s, gemv_config=cfg)

    def fused(p, w, s, cfg):
        if p in ("qkv", "gate_up"):
            return lambda: rms_norm_gemv(x_h, gamma, EPS, w, residual=res, config=cfg,
                                         weight_scale=s)  # fmt: skip
        if p == "down":
            return lambda: silu_mul_gemv(x_gu, w, config=cfg, weight_scale=s)
        return lambda: gemv(x_q, w, config=cfg, weight_scale=s)

    rows, out, chain_ops = [], {}, {}
    for p, (k, n) in shapes.items():
        ws = []
        for _ in range(copies):
            w_q, scale = quantize_rows(torch.randn(n, k, device=dev, dtype=dt) * 0.02)
            ws.append((w_q, scale.reshape(-1).contiguous()))
        floor = ws[0][0].nbytes / copy_gbs / 1e3
        base = {c: _time([today(p, w, s, c) for w, s in ws]) for c in GEMV_CANDIDATES}
        cands = {c: _time([fused(p, w, s, c) for w, s in ws]) for c in FP8_TILES}
        base_best, best = min(base, key=base.get), min(cands, key=cands.get)
        out[p] = {
            "floor_us": floor, "today_us": base[base_best], "today_tile": vars(base_best),
            "fused_best_us": cands[best], "fused_best": vars(best),
            "fused_us": {str(vars(c)): t for c, t in cands.items()},
        }  # fmt: skip
        chain_ops[p] = [fused(p, w, s, best) for w, s in ws]
        rows.append((name, p, f"{floor:.2f}", f"{base[base_best]:.2f}", f"{cands[best]:.2f}",
                     best.name))  # fmt: skip
    chain = _chain_us(chain_ops)
    rows.append(
        (name, "4 GEMVs: no PDL | PDL", "", f"{chain[False]:.2f}", f"{chain[True]:.2f}", "")
    )
    layer = {key: sum(v[key] for v in out.values()) for key in ("floor_us", "today_us")}
    layer["fused_best_us"] = sum(min(v["today_us"], v["fused_best_us"]) for v in out.values())
    rows.append((name, "layer", *(f"{layer[k]:.2f}" for k in ("floor_us", "today_us")),
                 f"{layer['fused_best_us']:.2f}", "best of each"))  # fmt: skip
    return {"projections": out, **{f"layer_{k}": v for k, v in layer.items()},
            "predicted_step_saving_ms": (layer["today_us"] - layer["fused_best_us"]) * layers / 1e3,
            "layer_gemv_chain_us": {"pdl": chain[True], "no_pdl": chain[False]},
            "_rows": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--copies", type=int, default=4, help="weight sets per graph (> L2)")
    ap.add_argument("--fp8", action="store_true", help="also FP8 weights (--quantization fp8)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbs = copy_ceiling_gbps(dev, 1 << 30, timer(dev))
    results, rows = {"copy_GBps": copy_gbs}, []
    for name in args.models.split(","):
        res = bench_model(name, args.copies)
        rows += res.pop("_rows")
        results[name] = res
    fp8_rows = []
    if args.fp8:
        for name in args.models.split(","):
            res = bench_model_fp8(name, args.copies, copy_gbs)
            fp8_rows += res.pop("_rows")
            results[f"{name}-fp8"] = res
    print(f"copy {copy_gbs:,.0f} GB/s")
    print_table(rows, ("model", "projection", "cuBLAS (+ op) us", "fused GEMV us", "tile"))
    if fp8_rows:
        print_table(fp8_rows, ("model", "FP8 projection", "floor us", "today us", "fused GEMV us",
                               "best tile"))  # fmt: skip
    if args.out_dir:
        write_result("fused_decode_gpu", {"models": args.models, "copies": args.copies,
                                          "fp8": args.fp8}, results,
                     results_dir=Path(args.out_dir))  # fmt: skip


if __name__ == "__main__":
    main()
