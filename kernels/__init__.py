"""Tandem's Triton kernels: one op per module, each with a torch reference in `reference`.

    paged_decode_attention  decode attention over the paged KV cache (GQA, split-K)
    prefill_attention       varlen causal attention of new tokens over a paged prefix
    kv_cache_write          store new K/V at slot_mapping (negative slot = skip)
    rms_norm                RMSNorm and fused residual-add + RMSNorm (HF numerics)
    rotary                  in-place neox RoPE on q/k, optionally after Qwen3 q/k RMSNorm
    activation              SiLU-and-mul of the packed gate_up projection
    reference               plain torch versions of all of the above (the tests' oracle)
    utils                   interpreter detection (and its numpy>=2.4 fix), device facts

Kernels run on CUDA, or on CPU in Triton's interpreter when TRITON_INTERPRET=1 is set before
these modules are imported (tests only: each launch costs ~0.1-2 s). Nothing here imports `engine`:
the attention backend built on these kernels is `engine/attention_triton.py`.
"""
