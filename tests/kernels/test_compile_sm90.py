"""Every kernel compiles for sm_90 (H100/H200) on a machine without a GPU.

Why: the interpreter runs kernels as numpy and misses what only codegen rejects (constexpr
misuse, unsupported control flow, tile shapes tl.dot cannot take, shared memory overflows).
Triton's wheel bundles ptxas, so the full TTIR -> PTX -> cubin pipeline runs on CPU. It runs
in a subprocess because the interpreter (on for this test session) replaces `@triton.jit`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = Path(__file__).resolve().parents[2]
H200_SHARED_BYTES = 232448  # sm_90 max dynamic shared memory per block


def _compile(jit, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 2):
    fn = getattr(jit, "fn", jit) if hasattr(jit, "configs") else jit  # unwrap autotune
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(ASTSource(fn, sig, constexprs), GPUTarget("cuda", 90, 32), options)
    return kernel.metadata.shared


def compile_all() -> None:
    from kernels import (
        activation,
        fp8_gemm,
        fp8_quant,
        gemv,
        kv_cache_write,
        prefill_attention,
        rms_norm,
        rotary,
    )
    from kernels import paged_decode_attention as decode

    bf, ptrs = "*bf16", {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qk_scale": "fp32"}
    fp8 = "*fp8e4nv"  # --kv-cache-dtype fp8: bf16 queries over an FP8 e4m3 cache
    # With ROPE (decode steps): q rotated and the new K/V stored in the kernel, Qwen3's norms on.
    for dt, kv, prec, f16_dots, rope in (("*bf16", "*bf16", "tf32", False, False),
                                         ("*fp32", "*fp32", "ieee", False, False),
                                         ("*bf16", fp8, "tf32", False, False),
                                         ("*bf16", fp8, "tf32", True, False),
                                         ("*bf16", "*bf16", "tf32", False, True),
                                         ("*bf16", fp8, "tf32", True, True)):  # fmt: skip
        for split in (False, True):
            types = dict(ptrs, q_ptr=dt, kv_ptr=kv, out_ptr=dt, m_ptr="*fp32", l_ptr="*fp32",
                         acc_ptr="*fp32", k_ptr=dt, v_ptr=dt, slot_mapping_ptr="*i64",
                         positions_ptr="*i64", cache_ptr=dt, q_norm_ptr=dt, k_norm_ptr=dt,
                         eps="fp32")  # fmt: skip
            # The wrapper's defaults: 64-token tiles when split, 128 x 3 stages unsplit.
            block_n, stages = (decode.SPLIT_BLOCK_N, 2) if split else (decode.SINGLE_BLOCK_N, 3)
            cx = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_N=block_n,
                      BLOCK_D=128, IS_SPLIT=split, DOT_PRECISION=prec,
                      F16_DOTS=f16_dots, ROPE=rope, HAS_NORM=rope,
                      FP8_MAX=448.0 if rope and kv == fp8 else 0.0, PDL=rope)  # fmt: skip
            shared = _compile(decode._paged_decode_kernel, types, cx, num_stages=stages)
            assert shared <= H200_SHARED_BYTES, f"decode {cx} needs {shared} B of shared memory"
    types = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr=bf, seq_lens_ptr="*i32")
    for pdl in (False, True):
        cx = dict(HEAD_DIM=128, BLOCK_N=64, BLOCK_P=64, BLOCK_D=128, PDL=pdl)
        _compile(decode._paged_decode_reduce_kernel, types, cx)
    for kv in (bf, fp8):
        types = dict(ptrs, q_ptr=bf, kv_ptr=kv, out_ptr=bf, query_start_loc_ptr="*i32")
        for cfg in prefill_attention._configs():
            cx = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, DOT_PRECISION="tf32",
                      **cfg.kwargs)  # fmt: skip
            shared = _compile(
                prefill_attention._prefill_attention_kernel,
                types,
                cx,
                cfg.num_warps,
                cfg.num_stages,
            )
            assert shared <= H200_SHARED_BYTES, f"prefill {cfg} needs {shared} B of shared memory"
    for kv, fp8_max in ((bf, 0.0), (fp8, 448.0)):
        _compile(kv_cache_write._kv_cache_write_kernel,
                 dict(k_ptr=bf, v_ptr=bf, kv_ptr=kv, slot_mapping_ptr="*i64"),
                 dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128,
                      FP8_MAX=fp8_max))  # fmt: skip
    for has_residual in (False, True):
        types = dict(x_ptr=bf, residual_ptr=bf, weight_ptr=bf, out_ptr=bf, eps="fp32")
        _compile(rms_norm._rms_norm_kernel, types, dict(HAS_RESIDUAL=has_residual, BLOCK=4096), 8)
    for has_norm in (False, True):
        for write_kv, kv, fp8_max in ((False, bf, 0.0), (True, bf, 0.0), (True, fp8, 448.0)):
            types = dict(positions_ptr="*i64", q_ptr=bf, k_ptr=bf, cache_ptr=bf, q_norm_ptr=bf,
                         k_norm_ptr=bf, eps="fp32", v_ptr=bf, kv_ptr=kv,
                         slot_mapping_ptr="*i64")  # fmt: skip
            cx = dict(HALF=64, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64, HAS_NORM=has_norm,
                      WRITE_KV=write_kv, BLOCK_SIZE=16, FP8_MAX=fp8_max)  # fmt: skip
            _compile(rotary._rotary_kernel, types, cx)
    _compile(activation._silu_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf), dict(BLOCK=1024))
    # --quantization fp8 at decode sizes: every tile of both kernels (tensor cores: 16 and 32 rows)
    types = dict(x_ptr=bf, w_ptr=fp8, scale_ptr="*fp32", bias_ptr=bf, y_ptr=bf, part_ptr="*fp32")
    # The GEMV (kernels/gemv.py): FP8 at fp8_gemm's tiles; --fused-decode's tiles with the
    # norm + residual prologue on bf16 weights, and the SiLU-mul one on FP8 weights; with and
    # without programmatic dependent launch's wait.
    gemv_types = dict(x_ptr=bf, res_ptr=bf, res_out_ptr=bf, gamma_ptr=bf, scale_ptr="*fp32",
                      bias_ptr=bf, y_ptr=bf, eps="fp32")  # fmt: skip
    gemv_cases = [(fp8, gemv.NONE, cfg) for cfg in fp8_gemm.GEMV_CANDIDATES]
    gemv_cases += [(w, p, cfg) for cfg in gemv.CANDIDATES
                   for w, p in ((bf, gemv.RMS_NORM), (fp8, gemv.SILU_MUL))]  # fmt: skip
    for w, prologue, cfg in gemv_cases:
        cx = dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == gemv.RMS_NORM,
                  HAS_SCALE=w == fp8, HAS_BIAS=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  REDUCE_EACH=cfg.reduce_each, PDL=prologue == gemv.RMS_NORM)  # fmt: skip
        _compile(gemv._gemv_kernel, dict(gemv_types, w_ptr=w), cx, cfg.num_warps, cfg.num_stages)
    for cfg in fp8_gemm.CANDIDATES:
        for block_m in (16, fp8_gemm.MAX_M):
            cx = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      SPLIT_K=cfg.split_k, DOT_PRECISION="tf32")  # fmt: skip
            shared = _compile(fp8_gemm._fp8_gemm_kernel, types, cx, cfg.num_warps, cfg.num_stages)
            assert shared <= H200_SHARED_BYTES, f"fp8 gemm {cfg} needs {shared} B of shared memory"
    for split_k in sorted({cfg.split_k for cfg in fp8_gemm.CANDIDATES} - {1}):
        cx = dict(HAS_BIAS=True, SPLIT_K=split_k, BLOCK=fp8_gemm.REDUCE_BLOCK)
        _compile(fp8_gemm._fp8_gemm_reduce_kernel, types, cx)
    # --quantization fp8 at prefill sizes: the activations' per-row quantization
    for x in (bf, "*fp32"):
        types = dict(x_ptr=x, q_ptr=fp8, scale_ptr="*fp32", fp8_max="fp32", min_scale="fp32")
        _compile(fp8_quant._fp8_quant_kernel, types, dict(BLOCK=2048))


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_compile_sm90"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    compile_all()
