"""Llama (2, 3.x, SmolLM2): the plain dense decoder."""

from engine.models.base import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
