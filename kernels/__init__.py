"""Tandem's Triton kernels: one op per module, each with a torch reference in `reference`.

    paged_decode_attention  decode attention over the paged KV cache (GQA, split-K)
    prefill_attention       varlen causal attention of new tokens over a paged prefix
    kv_cache_write          store new K/V at slot_mapping (negative slot = skip)
    rms_norm                RMSNorm and fused residual-add + RMSNorm (HF numerics)
    rotary                  in-place neox RoPE on q/k, optionally after Qwen3 q/k RMSNorm
    activation              SiLU-and-mul of the packed gate_up projection
    reference               plain torch versions of all of the above (the tests' oracle)
    utils                   interpreter detection (and its numpy>=2.4 fix), device facts
    fp8_gemm, fp8_quant     FP8 weights: decode-size GEMMs, per-row activation quantization

Kernels run on CUDA, or on CPU in Triton's interpreter when TRITON_INTERPRET=1 is set before
these modules are imported (tests only: each launch costs ~0.1-2 s). Nothing here imports `engine`:
the attention backend built on these kernels is `engine/attention_triton.py`.
"""

# Hugging Face's `kernels` distribution has this package's module name. Where it is installed
# too, transformers imports this package in its place; its names then fail here with what to do.
_HUB_KERNELS_NAMES = frozenset(
    {
        "CUDAProperties",
        "Device",
        "KernelizeFallback",
        "LayerRepository",
        "LocalLayerRepository",
        "Mode",
        "ROCMProperties",
        "get_kernel",
        "kernelize",
        "register_kernel_mapping",
        "replace_kernel_forward_from_hub",
        "use_kernel_forward_from_hub",
        "use_kernel_mapping",
    }
)


def __getattr__(name: str):
    if name in _HUB_KERNELS_NAMES:
        raise ImportError(
            f"{name!r} belongs to Hugging Face's `kernels` package, but `kernels` here is "
            f"Tandem's Triton kernels ({__file__}). Both are installed in this environment; "
            "install Tandem in an environment of its own (scripts/setup.sh makes .venv) or "
            "`pip uninstall kernels` there, with transformers < 5.25 (later versions require it)."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
