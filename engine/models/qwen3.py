"""Qwen3 dense: Llama plus an RMSNorm over each head of q and k before RoPE."""

from engine.models.base import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
