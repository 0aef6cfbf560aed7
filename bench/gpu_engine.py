"""Engine speed on one GPU (H200), next to the ceilings and the HF baseline measured in the
same run. Random weights (`load_format="dummy"`), Qwen3-0.6B and Qwen3-8B shapes, bf16.

Measured:
- ceilings: device-to-device copy (bytes read + written / s) and an 8192^3 bf16 matmul;
- decode TPOT at batch 1, context 512 (engine steps back to back, CUDA graphs, async
  scheduling), and two floors at the copy bandwidth: `floor_ms`, every weight byte + KV
  (the convention of issue 15 and FACTS: Qwen3-8B's 3.87 ms on the H200), and `read_floor_ms`,
  the bytes a step reads, which leaves out the input-embedding table (a step reads one row
  of it per token; 1.2 GB of Qwen3-8B, whose LM head is its own matrix);
- Qwen3-8B decode step at batch 64, context 1024, vs max(memory floor, compute floor);
- Qwen3-8B prefill of one 4096-token prompt: achieved TFLOP/s (GEMMs + causal attention);
- offline throughput, Qwen3-8B, N prompts of 512 in / 128 out: output tok/s vs the compute floor;
- HF transformers `generate` TPOT at batch 1 on the same shapes (eager, SDPA).

With `--variants bf16,fp8,kv-fp8` the same figures for FP8 weights and the FP8 KV cache, under
`results.<model>.fp8` / `.kv-fp8` beside the bf16 ones. The offline job also reports the GPU's
idle time between engine steps (CUDA events around every step), by the kinds of step around it.

    python -m bench.gpu_engine --out-dir bench/results [--models qwen3-8b] [--skip-hf]
        [--variants bf16,fp8,kv-fp8] [--offline-configs 256:8192]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from transformers import Qwen3Config

from bench.common import write_result
from engine import LLM, SamplingParams
from engine.request import Request
from engine.step_trace import KINDS, StepTrace, summarize

# The engine variants a run can measure: bf16 as the baseline, FP8 weights (`--quantization
# fp8`) and the FP8 KV cache (`--kv-cache-dtype fp8`). bf16's figures sit at the top of a
# model's results, as before variants existed; the others' under their name.
VARIANTS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "sync-mixed": {"async_mixed_steps": False},  # steps with prompt chunks run synchronously
    # batch-1 decode on cuBLAS and the separate norm/act kernels (bf16 runs the fused GEMVs
    # wherever its start-up timing finds them faster)
    "no-fused-decode": {"fused_decode": False},
    "fp8-no-fused-decode": {"quantization": "fp8", "fused_decode": False},
    # the fused GEMVs launched without programmatic dependent launch (kernels.gemv.PDL, on by
    # default)
    "no-pdl": {"gemv_pdl": False},
    "rope-attention": {"rope_in_attention": True},
    "rope-attention-pdl": {"rope_in_attention": True, "attention_pdl": True},
    "fp8-rope-attention": {"quantization": "fp8", "rope_in_attention": True},
    "fp8-no-pdl": {"quantization": "fp8", "gemv_pdl": False},
}

SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def make_config_dir(name: str, root: Path, shape: dict | None = None, **config) -> Path:
    """`root/name` with a Qwen3 config.json (weights come from `load_format="dummy"`): the
    shape `SHAPES[name]` unless one is given; `config` adds Qwen3Config fields."""
    cfg = Qwen3Config(
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
        **(shape or SHAPES[name]),
        **config,
    )
    path = root / name
    cfg.save_pretrained(path)
    return path


def ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    copy_gbs = 2 * x.numel() * 20 / (time.perf_counter() - t) / 1e9
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12
    return {"copy_GBps": copy_gbs, "matmul_bf16_TFLOPs": tflops}


def step_times(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(TTFT s of the first token, median s per decode step) of a batch run alone, driving
    the core as the engine loop does: steps back to back, no synchronization between them
    (async scheduling overlaps the host's work for step N+1 with the GPU's step N). A decode
    step's time is the interval between consecutive steps that each gave every request a
    token (steady state: the whole batch decoding)."""
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"b{time.monotonic_ns()}-{i}", p, params))
    torch.cuda.synchronize()
    start = time.perf_counter()
    first, full = None, []
    while core.has_unfinished_requests():
        outs = core.step()
        now = time.perf_counter()
        if outs and first is None:
            first = now
        full.append((now, len(outs) == len(prompts)))
    steady = [b[0] - a[0] for a, b in zip(full, full[1:]) if a[1] and b[1]]
    return first - start, statistics.median(steady) if steady else 0.0


def random_prompts(n: int, length: int, seed: int = 0, vocab: int = 150000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def weight_bytes(llm: LLM) -> int:
    return llm.engine.runner.weights_bytes


def step_read_bytes(runner) -> int:
    """The weight bytes a decode step of `runner` (a ModelRunner) reads: all of them, except
    the input-embedding table, of which each token reads one row (unless it is the LM head)."""
    model = runner.model
    if model.tie_word_embeddings:
        return runner.weights_bytes
    table = model.embed_tokens.weight
    return runner.weights_bytes - (table.shape[0] - 1) * table.shape[1] * table.element_size()


def param_count(llm: LLM) -> int:
    """Weights counted once whatever their storage (FP8 weights are buffers)."""
    model = llm.engine.runner.model
    return sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("weight")
    )


def hf_tpot(path: Path, prompt_len: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config.from_pretrained(path), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    ids = torch.randint(100, 150000, (1, prompt_len), device="cuda")
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return (total - ttft) / (new_tokens - 1)


def dummy_llm(path: Path, dtype: str = "bfloat16", **llm_kwargs) -> LLM:
    """The latency benchmarks' engine: random weights (bf16 unless `dtype`), room for a
    4,096-token prompt; `llm_kwargs`: more engine arguments (e.g. quantization="fp8")."""
    return LLM(
        str(path),
        **llm_kwargs,
        load_format="dummy",
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=4096 + 256,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
    )


def bench_model(
    name: str,
    path: Path,
    ceil: dict,
    args,
    gemv_pdl=True,
    rope_in_attention=False,
    attention_pdl=False,
    **llm_kwargs,
) -> dict:
    """`llm_kwargs`: a variant's engine arguments (`VARIANTS`); `gemv_pdl`: kernels.gemv.PDL,
    `rope_in_attention`: engine.attention_triton.ROPE_IN_ATTENTION, `attention_pdl`:
    kernels.paged_decode_attention.PDL (this runs in a process of its own)."""
    import engine.attention_triton
    import kernels.gemv
    import kernels.paged_decode_attention

    kernels.gemv.PDL = gemv_pdl
    kernels.paged_decode_attention.PDL = attention_pdl
    engine.attention_triton.ROPE_IN_ATTENTION = rope_in_attention
    copy_bps = ceil["copy_GBps"] * 1e9
    t = time.perf_counter()
    llm = dummy_llm(path, **llm_kwargs)
    res: dict = {"init_s": time.perf_counter() - t}  # with FP8 weights: their tile tuning
    res["decode_gemv"] = getattr(llm.engine.runner, "gemv_report", None)  # us per layer
    kv_tok = llm.config.kv_bytes_per_token()
    wb, n_params, rb = (
        weight_bytes(llm),
        param_count(llm),
        step_read_bytes(llm.engine.runner),
    )
    res["weight_GB"], res["step_read_weight_GB"] = wb / 1e9, rb / 1e9
    step_times(llm, random_prompts(2, 64, 99), 8)  # warm-up
    ttft, tpot = step_times(llm, random_prompts(1, 512), 128)
    floor, read_floor = ((b + 640 * kv_tok) / copy_bps for b in (wb, rb))
    res["b1_ctx512"] = {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "floor_ms": floor * 1e3,
        "tpot_over_floor": tpot / floor,
        "read_floor_ms": read_floor * 1e3,
        "tpot_over_read_floor": tpot / read_floor,
    }

    def batch_step(llm: LLM, batch: int, ctx: int, seed: int) -> dict:
        """A decode step of `batch` sequences of ~`ctx` tokens, next to its floors."""
        _, step = step_times(llm, random_prompts(batch, ctx, seed), 48)
        mem, read_mem = ((b + batch * (ctx + 8) * kv_tok) / copy_bps for b in (wb, rb))
        comp = 2 * n_params * batch / (ceil["matmul_bf16_TFLOPs"] * 1e12)
        return {
            "step_ms": step * 1e3,
            "memory_floor_ms": mem * 1e3,
            "compute_floor_ms": comp * 1e3,
            "step_over_floor": step / max(mem, comp),
            "read_memory_floor_ms": read_mem * 1e3,
            "step_over_read_floor": step / max(read_mem, comp),
        }

    for batch in (8, 32):  # small batches: past the GEMVs (at most 2 rows), on the GEMMs
        res[f"b{batch}_ctx512"] = batch_step(llm, batch, 512, batch)
    if name == "qwen3-8b":
        res["b64_ctx1024"] = batch_step(llm, 64, 1024, 1)
        pre, _ = step_times(llm, random_prompts(1, 4096, 2), 1)
        hf = llm.config.model.hf_config
        attn = 2 * 2 * hf.num_hidden_layers * hf.num_attention_heads * 128 * 4096 * 4096 / 2
        flops = 2 * n_params * 4096 + attn
        res["prefill_4096"] = {
            "s": pre,
            "TFLOPs": flops / pre / 1e12,
            "fraction_of_matmul_ceiling": flops / pre / 1e12 / ceil["matmul_bf16_TFLOPs"],
        }
    del llm
    _free_gpu()
    if name == "qwen3-8b":
        for cfg in filter(None, args.offline_configs.split(",")):
            max_seqs, max_tokens = (int(x) for x in cfg.split(":"))
            for freeze in (False, True) if args.gc_freeze else (False,):
                key = f"offline_{max_seqs}_{max_tokens}" + ("_gc_freeze" if freeze else "")
                res[key] = offline(
                    path,
                    args.num_prompts,
                    max_seqs,
                    max_tokens,
                    n_params,
                    ceil,
                    freeze,
                    **llm_kwargs,
                )
    if not args.skip_hf and not llm_kwargs:
        res["hf_b1_tpot_ms"] = hf_tpot(path, 512, 33) * 1e3
    return res


# The offline job: N prompts of 512 random tokens, 128 out each (EOS ignored).
OFFLINE_PARAMS = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)


def offline_llm(path: Path, max_num_seqs: int, max_batched: int, **llm_kwargs) -> LLM:
    """The offline job's engine: dummy weights, bf16 unless `llm_kwargs` says otherwise."""
    kwargs = dict(load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True)
    return LLM(
        str(path),
        **{**kwargs, **llm_kwargs},
        max_model_len=1024,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        gpu_memory_utilization=0.9,
    )


def offline(
    path: Path,
    n: int,
    max_num_seqs: int,
    max_batched: int,
    n_params: int,
    ceil,
    gc_freeze: bool = False,
    **llm_kwargs,
) -> dict:
    """N prompts of 512 in / 128 out through `LLM.generate`; every engine step's execute time
    is recorded by kind (decode-only batches take the CUDA graphs, mixed ones run eager).
    `gc_freeze`: freeze the GC's heap after start-up; `llm_kwargs`: more engine arguments (e.g.
    quantization="fp8")."""
    llm = offline_llm(path, max_num_seqs, max_batched, **llm_kwargs)
    if gc_freeze:  # as vLLM does after start-up: the engine's objects out of the GC's way
        gc.collect()
        gc.freeze()
    trace = StepTrace(llm.engine).install()
    host = {"gc_s": 0.0, "gc_collections": [0, 0, 0], "gc_t0": 0.0}

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            host["gc_t0"] = time.perf_counter()
        else:
            host["gc_s"] += time.perf_counter() - host["gc_t0"]
            host["gc_collections"][info["generation"]] += 1

    llm.generate(random_prompts(64, 512, 4), SamplingParams(temperature=0, max_tokens=8))
    trace.clear()
    torch.cuda.synchronize()
    gc.callbacks.append(gc_timer)
    t = time.perf_counter()
    try:
        outs = llm.generate(random_prompts(n, 512, 3), OFFLINE_PARAMS)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        gc.callbacks.remove(gc_timer)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    floor_s = 2 * n_params * n * (512 + 128) / (ceil["matmul_bf16_TFLOPs"] * 1e12)
    steps = summarize(trace.rows())
    res = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_batched,
        "num_prompts": n,
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "compute_floor_s": floor_s,
        "wall_over_floor": wall / floor_s,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "outside_execute_s": wall - steps["runner_host_s"],
        "gpu_idle_between_steps_s": steps["gpu_idle_between_steps_s"],
        "gpu_idle_between_steps_by_kind_s": steps["gpu_idle_between_steps_by_kind_s"],
        "schedule_s": steps["schedule_s"],
        "outside_engine_step_s": wall - steps["step_s"],  # LLM.generate's own work
        "gc_freeze": gc_freeze,
        "gc_s": host["gc_s"],  # the cyclic garbage collector's pauses, by generation below
        "gc_collections": host["gc_collections"],
        **{kind: steps[kind] for kind in KINDS},
    }
    print("offline", json.dumps(res), flush=True)
    trace.remove()
    del llm, trace
    gc.unfreeze()
    _free_gpu()
    return res


def _free_gpu() -> None:
    """Drop an engine's memory before the next: its cycles (bound methods, graphs) hold it."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None, help="write gpu_engine-<date>.json here")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--offline-configs",
        default="256:8192,512:16384",
        help="max_num_seqs:max_num_batched_tokens pairs for the offline job",
    )
    ap.add_argument(
        "--gc-freeze", action="store_true", help="also run each offline job with gc.freeze()"
    )
    ap.add_argument(
        "--variants",
        default="bf16",
        help=f"comma-separated, of {sorted(VARIANTS)}; rows other than bf16 go under their name",
    )
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown --variants {sorted(unknown)}; use some of {sorted(VARIANTS)}")
    ceil = ceilings()
    print("ceilings", ceil, flush=True)
    results: dict = {}
    # One process per engine variant: an engine's memory goes with its process (freeing one
    # in-process left 115 GiB cached, and the next engine's KV allocation failed).
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = make_config_dir(name, Path(tmp))
            results[name] = {}
            for variant in variants:
                t = time.perf_counter()
                with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    res = pool.submit(bench_model, name, path, ceil, args, **VARIANTS[variant])
                    res = res.result()
                res["bench_wall_s"] = time.perf_counter() - t
                print(name, variant, json.dumps(res, indent=1), flush=True)
                if variant == "bf16":
                    results[name].update(res)
                else:
                    results[name][variant] = res
    figures = {"ceilings": ceil, **results}
    config = {
        "dtype": "bfloat16",
        "variants": {v: VARIANTS[v] for v in variants},
        "block_size": 16,
        "cuda_graphs": True,
        "gpu": torch.cuda.get_device_name(),
        "num_prompts": args.num_prompts,
        "source_commit": os.environ.get("TANDEM_COMMIT", "unknown"),
    }
    if args.out_dir:
        write_result("gpu_engine", config, figures, results_dir=Path(args.out_dir))
    print("\nmodel        | variant | TPOT b1 ms | floor ms | x floor | x read floor | HF TPOT ms")
    for name, by_model in results.items():
        for variant in variants:
            r = by_model if variant == "bf16" else by_model.get(variant)
            if r is None or "b1_ctx512" not in r:
                continue
            b1 = r["b1_ctx512"]
            print(
                f"{name:12} | {variant:7} | {b1['tpot_ms']:10.2f} | {b1['floor_ms']:8.2f} | "
                f"{b1['tpot_over_floor']:7.2f} | {b1['tpot_over_read_floor']:12.2f} | "
                f"{r.get('hf_b1_tpot_ms', float('nan')):.1f}"
            )
            for key in ("b8_ctx512", "b32_ctx512", "b64_ctx1024"):
                if key in r:
                    b = r[key]
                    print(
                        f"  {key} step {b['step_ms']:.2f} ms, {b['step_over_floor']:.2f}x floor, "
                        f"{b['step_over_read_floor']:.2f}x read floor"
                    )
            if "prefill_4096" in r:
                print(f"  prefill 4096 {r['prefill_4096']['TFLOPs']:.0f} TFLOP/s")
            for k, v in r.items():
                if k.startswith("offline"):
                    print(
                        f"  {k}: {v['output_tok_s']:.0f} tok/s, {v['wall_over_floor']:.2f}x "
                        f"floor, GPU idle between steps {v['gpu_idle_between_steps_s']:.2f} s"
                    )


if __name__ == "__main__":
    main()
