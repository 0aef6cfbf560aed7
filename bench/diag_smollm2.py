"""Diagnose GPU divergence on SmolLM2 (bf16): eager vs graphs vs torch path, and each kernel at
SmolLM2's shapes (9 q / 3 kv heads, head_dim 64, hidden 576, intermediate 1536)."""

import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LLM, SamplingParams
from engine.attention import TorchPagedAttention
from kernels import reference as ref
from kernels.activation import silu_and_mul
from kernels.paged_decode_attention import paged_decode_attention
from kernels.rms_norm import rms_norm
from tests.kernels.helpers import make_paged_kv, norm_rel_err, packed_qkv

M = os.environ.get("DIAG_MODEL") or tempfile.mkdtemp()
if not os.environ.get("DIAG_MODEL"):  # SmolLM2's shapes, random weights, 6 layers
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(M)
bf = torch.bfloat16
print("-- kernels at SmolLM2 shapes, bf16")
lens = [40, 57, 3, 100, 33]
_, kvl, tables = make_paged_kv(lens, 3, 64, 16, bf, "cuda")
sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
q, k, v = packed_qkv(5, 9, 3, 64, bf, "cuda")
for bound in (None, 512):
    out = paged_decode_attention(q, kvl, tables, sl, 0.125, max_seq_len=bound or 100)
    expect = ref.decode_attention(q.float(), kvl.float(), tables, sl, 0.125)
    print("decode bound", bound, norm_rel_err(out, expect))
x = torch.randn(7, 576, device="cuda", dtype=bf)
w = torch.randn(576, device="cuda", dtype=bf)
print("rms_norm", norm_rel_err(rms_norm(x, w, 1e-5), ref.rms_norm(x.float(), w.float(), 1e-5)))
g = torch.randn(7, 3072, device="cuda", dtype=bf)
print("silu", norm_rel_err(silu_and_mul(g), ref.silu_and_mul(g.float())))
path = M
hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=bf).cuda().eval()
for variant in ("graphs", "eager", "torch-path"):
    llm = LLM(
        M,
        max_model_len=512,
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        enforce_eager=variant != "graphs",
    )
    if variant == "torch-path":
        llm.engine.runner.model.use_fused_kernels = False
        llm.engine.runner.attn_backend = TorchPagedAttention()
    prompts = [list(range(100, 130)), list(range(500, 557))]
    for batch in (prompts, prompts[:1]):
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for p, o in zip(batch, outs):
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                r = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            print(variant, len(batch), o.outputs[0].token_ids, r, o.outputs[0].token_ids == r)
    del llm
