"""Kernel benchmark: achieved GB/s (TFLOP/s for prefill) next to the device-copy ceiling.

    python bench/kernels.py --out                 # H200: real shapes, JSON to bench/results/
    python bench/kernels.py --interpret --tiny    # CPU smoke check in Triton's interpreter

Bytes are what a kernel must read + write (KV bytes only for decode attention: the headline,
target >= 70% of the copy ceiling, is 32 seqs x 4096 ctx, 32 q / 8 kv heads, d 128, bf16,
block 16). The ceiling is a torch copy of a 1 GiB tensor in the same run, read + write counted.
Decode also sweeps split count / tile / warps so the heuristic can be checked against the best.
Timing on CUDA: `triton.testing.do_bench` (L2 flushed between calls). Its time includes the
wrapper's launch from Python (tens of µs), so batch-1 decode rows here are launch-bound; the
in-engine kernel times (graph replays) come from bench/profile_step.py. Wall-clock medians on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench`, `engine`, `kernels` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GiB = 1 << 30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--interpret", action="store_true", help="TRITON_INTERPRET=1 (CPU)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (smoke check)")
    p.add_argument("--no-sweep", action="store_true", help="skip the decode config sweep")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="decode attention's cache dtype (auto: the queries' dtype)")  # fmt: skip
    p.add_argument("--decode-only", action="store_true", help="only the decode attention rows")
    p.add_argument("--out", nargs="?", const="", default=None, metavar="DIR",
                   help="write kernels-<date>.json into DIR (default bench/results)")  # fmt: skip
    return p.parse_args()


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: do_bench's median on CUDA, a wall-clock median on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, return_mode="median") / 1e3

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return cpu_time


def copy_ceiling_gbps(device: torch.device, nbytes: int, time_s) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_s(lambda: dst.copy_(src)) / 1e9


def decode_case(num_seqs, ctx, hq, hkv, d, bs, bound, dtype, device, kv_dtype=None):
    """(run(config) -> None, KV bytes read) for one decode batch; `bound` is the static
    max_seq_len the engine passes (its max_model_len under CUDA graphs)."""
    from kernels.paged_decode_attention import paged_decode_attention

    blocks_per_seq = -(-ctx // bs)
    num_blocks = num_seqs * blocks_per_seq + 1
    cache = torch.randn(num_blocks, 2, 2, bs, hkv, d, device=device).to(kv_dtype or dtype)
    kv_layer = cache[:, 1]
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32)
    tables = tables.view(num_seqs, blocks_per_seq).contiguous()
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs, hq, d, device=device).to(dtype)
    out = torch.empty_like(q)

    def run(config=None):
        paged_decode_attention(q, kv_layer, tables, seq_lens, d**-0.5, out=out,
                               max_seq_len=bound, config=config)  # fmt: skip

    kv_bytes = num_seqs * ctx * hkv * d * 2 * cache.element_size()
    return run, kv_bytes


def bench_decode(tiny, device, dtype, time_s, ceiling, sweep, kv_dtype=None) -> list[dict]:
    from kernels.paged_decode_attention import DecodeConfig

    shapes = [(2, 40, 4, 2, 16, 4, 40)] if tiny else [
        (32, 4096, 32, 8, 128, 16, 4096),  # the headline
        (32, 4096, 32, 8, 128, 16, 40960),  # same, under Qwen3's max_model_len as the bound
        (1, 2048, 32, 8, 128, 16, 40960),  # batch 1: the latency case
        (1, 32768, 32, 8, 128, 16, 40960),
        (128, 1024, 32, 8, 128, 16, 40960),
        (256, 512, 16, 8, 128, 16, 40960),  # Qwen3-0.6B heads
    ]  # fmt: skip
    if not tiny:  # the engine's decode steps: Qwen3-8B b64 ctx 1024 and b1 ctx 512
        shapes += [(64, 1024, 32, 8, 128, 16, 4352), (1, 512, 32, 8, 128, 16, 4352)]
    swept = {0, len(shapes) - 2, len(shapes) - 1}
    rows = []
    for i, (s, ctx, hq, hkv, d, bs, bound) in enumerate(shapes):
        run, kv_bytes = decode_case(s, ctx, hq, hkv, d, bs, bound, dtype, device, kv_dtype)
        name = f"decode S={s} ctx={ctx} {hq}/{hkv}h d={d} bs={bs} bound={bound}"
        if kv_dtype is not None:
            name += " kv=fp8"
        print(name, flush=True)
        t = time_s(run)
        rows.append(_row(name, kv_bytes, t, ceiling, config="heuristic", headline=i == 0))
        if kv_dtype is not None:
            t = time_s(lambda run=run: run(DecodeConfig(f16_dots=True)))
            rows.append(_row(name, kv_bytes, t, ceiling, config="heuristic, f16_dots"))
        if sweep and i in swept:
            best = None
            f16 = (False, True) if kv_dtype is not None else (False,)
            grid = ((1, 4, 16), (32, 64, 128), (4, 8), (2, 3), f16)
            if tiny:
                grid = ((1, 2), (16,), (4,), (1,), f16)
            for splits, block_n, warps, stages, f16_dots in itertools.product(*grid):
                cfg = DecodeConfig(block_n, splits, warps, stages, f16_dots)
                t = time_s(lambda cfg=cfg, run=run: run(cfg))
                if best is None or t < best[0]:
                    best = (t, cfg)
            cfg = best[1]
            desc = f"splits={cfg.num_splits} block_n={cfg.block_n} warps={cfg.num_warps} "
            desc += f"stages={cfg.num_stages} f16_dots={cfg.f16_dots}"
            rows.append(_row(name + " (best of sweep)", kv_bytes, best[0], ceiling, config=desc))
    return rows


def bench_prefill(tiny, device, dtype, time_s) -> list[dict]:
    """One causal prompt, no prefix: TFLOP/s of the kernel next to torch SDPA's."""
    import torch.nn.functional as F

    from kernels.prefill_attention import prefill_attention

    t_len, hq, hkv, d, bs = (24, 4, 2, 16, 4) if tiny else (4096, 32, 8, 128, 16)
    num_blocks = -(-t_len // bs)
    cache = torch.randn(num_blocks + 1, 2, 2, bs, hkv, d, device=device).to(dtype)
    tables = torch.arange(1, num_blocks + 1, dtype=torch.int32, device=device)[None]
    qsl = torch.tensor([0, t_len], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([t_len], dtype=torch.int32, device=device)
    q = torch.randn(t_len, hq, d, device=device).to(dtype)
    flops = 4 * hq * d * t_len * (t_len + 1) / 2  # QK^T and PV over the causal half
    t = time_s(lambda: prefill_attention(q, cache[:, 1], tables, qsl, seq_lens, d**-0.5, t_len))
    rows = [{"kernel": f"prefill T={t_len} {hq}/{hkv}h d={d}", "time_us": t * 1e6,
             "tflops": flops / t / 1e12}]  # fmt: skip
    qh = q.transpose(0, 1)[None]
    kh = torch.randn(1, hkv, t_len, d, device=device).to(dtype)
    t = time_s(lambda: F.scaled_dot_product_attention(qh, kh, kh, is_causal=True,
                                                      enable_gqa=True))  # fmt: skip
    rows.append({"kernel": "  torch SDPA, same shape (reference)", "time_us": t * 1e6,
                 "tflops": flops / t / 1e12})  # fmt: skip
    return rows


def bench_elementwise(tiny, device, dtype, time_s, ceiling) -> list[dict]:
    from kernels import reference as ref
    from kernels.activation import silu_and_mul
    from kernels.kv_cache_write import kv_cache_write
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding

    t_len, hidden, inter, hq, hkv, d, bs = (
        (8, 64, 40, 4, 2, 16, 4) if tiny else (8192, 4096, 12288, 32, 8, 128, 16)
    )
    el = torch.empty((), dtype=dtype).element_size()
    rows = []

    cache = torch.zeros(-(-t_len // bs) + 1, 2, 2, bs, hkv, d, device=device, dtype=dtype)
    k = torch.randn(t_len, hkv, d, device=device).to(dtype)
    slots = torch.arange(bs, bs + t_len, device=device)
    t = time_s(lambda: kv_cache_write(k, k, cache[:, 1], slots))
    rows.append(_row(f"kv_cache_write T={t_len} {hkv}h d={d}", 4 * k.numel() * el, t, ceiling))

    x = torch.randn(t_len, hidden, device=device).to(dtype)
    res, w = torch.randn_like(x), torch.ones(hidden, device=device, dtype=dtype)
    out = torch.empty_like(x)
    t = time_s(lambda: rms_norm(x, w, 1e-6, out=out))
    rows.append(_row(f"rms_norm T={t_len} H={hidden}", 2 * x.numel() * el, t, ceiling))
    t = time_s(lambda: fused_add_rms_norm(out, res, w, 1e-6))  # in place; values drift, fine
    rows.append(_row(f"fused_add_rms_norm T={t_len} H={hidden}", 4 * x.numel() * el, t, ceiling))

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    cos_sin = ref.build_cos_sin_cache(inv_freq, t_len, dtype)
    positions = torch.arange(t_len, device=device)
    q = torch.randn(t_len, hq, d, device=device).to(dtype)
    kk = torch.randn(t_len, hkv, d, device=device).to(dtype)
    qw = torch.ones(d, device=device, dtype=dtype)
    rope_bytes = (2 * (q.numel() + kk.numel()) + cos_sin.numel()) * el
    t = time_s(lambda: rotary_embedding(positions, q, kk, cos_sin, qw, qw))
    rows.append(_row(f"qk_norm+rotary T={t_len} {hq}/{hkv}h d={d}", rope_bytes, t, ceiling))

    gu = torch.randn(t_len, 2 * inter, device=device).to(dtype)
    t = time_s(lambda: silu_and_mul(gu))
    rows.append(_row(f"silu_and_mul T={t_len} I={inter}", 3 * t_len * inter * el, t, ceiling))
    return rows


def _row(name, nbytes, t, ceiling, **extra) -> dict:
    gbps = nbytes / t / 1e9
    return {"kernel": name, "time_us": t * 1e6, "bytes": nbytes, "gbps": gbps,
            "pct_of_copy": 100 * gbps / ceiling, **extra}  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif "TRITON_INTERPRET" in os.environ:
        os.environ["TRITON_INTERPRET"] = "0"
    from bench.common import RESULTS_DIR, print_table, write_result

    device = torch.device("cuda" if torch.cuda.is_available() and not args.interpret else "cpu")
    if device.type == "cpu" and not args.interpret:
        sys.exit("no CUDA device: run with --interpret --tiny for a CPU smoke check")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # no bf16 on CPU here
    time_s = timer(device)
    ceiling = copy_ceiling_gbps(device, (64 << 20) if args.tiny else GiB, time_s)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    rows = bench_decode(args.tiny, device, dtype, time_s, ceiling, not args.no_sweep, kv_dtype)
    prefill = []
    if not args.decode_only:
        rows += bench_elementwise(args.tiny, device, dtype, time_s, ceiling)
        prefill = bench_prefill(args.tiny, device, dtype, time_s)

    print(f"device copy ceiling: {ceiling:,.0f} GB/s (read + write)")
    print_table(
        [(r["kernel"], f"{r['time_us']:.1f}", f"{r['gbps']:,.0f}", f"{r['pct_of_copy']:.0f}%",
          r.get("config", "")) for r in rows],
        ("kernel", "us", "GB/s", "of copy", "config"),
    )  # fmt: skip
    print_table(
        [(r["kernel"], f"{r['time_us']:.1f}", f"{r['tflops']:.1f}") for r in prefill],
        ("prefill", "us", "TFLOP/s"),
    )
    headline = next(r for r in rows if r.get("headline"))
    print(f"headline decode: {headline['pct_of_copy']:.0f}% of copy (target >= 70%)")
    if args.out:
        config = {"device": str(device), "dtype": str(dtype), "tiny": args.tiny,
                  "interpret": args.interpret, "kv_cache_dtype": args.kv_cache_dtype,
                  "decode_only": args.decode_only}  # fmt: skip
        results = {"copy_ceiling_gbps": ceiling, "bandwidth": rows, "prefill": prefill}
        print("wrote", write_result("kernels", config, results, Path(args.out or RESULTS_DIR)))


if __name__ == "__main__":
    main()
