"""A dense decoder-only causal LM over the paged KV cache; families subclass it.

`forward` takes flattened tokens of every scheduled sequence and returns hidden states;
`compute_logits` maps only the rows the sampler needs through the LM head.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.layers import DecoderLayer, RMSNorm, RotaryEmbedding

logger = logging.getLogger(__name__)

# HF checkpoint name fragment -> (our packed parameter, shard index)
_PACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class DecoderForCausalLM(nn.Module):
    qk_norm: bool = False  # Qwen3 normalizes q and k per head before RoPE
    # None: the Triton path on CUDA, torch elsewhere; False: torch everywhere; True: Triton
    # everywhere (CPU tests run it under TRITON_INTERPRET=1).
    use_fused_kernels: bool | None = None

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim, self.qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, head_dim)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        fused = self.use_fused_kernels
        if fused or (fused is None and x.is_cuda):
            return self._forward_fused(x, positions, kv_cache, meta, backend)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i], meta, backend)
        return self.norm(x)

    def _forward_fused(self, x, positions, kv_cache, meta, backend) -> torch.Tensor:
        """CUDA path: Triton RMSNorm(+residual), fused q/k-norm + RoPE, SiLU-and-mul."""
        from kernels.rms_norm import fused_add_rms_norm

        cache = self._cos_sin_cache(x.dtype, x.device)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward_fused(
                x, residual, positions, cache, kv_cache[:, i], meta, backend
            )
        x, _ = fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def _cos_sin_cache(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[max_pos, head_dim]: cos then sin per position, built once (outside graphs)."""
        cache = getattr(self, "_cos_sin", None)
        if cache is None or cache.dtype != dtype or cache.device != device:
            from kernels.reference import build_cos_sin_cache

            max_pos = getattr(self.config, "max_position_embeddings", None) or 4096
            cache = build_cos_sin_cache(
                self.rotary.inv_freq.to(device), max_pos, dtype, self.rotary.attention_scaling
            )
            self._cos_sin = cache
        return cache

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return (hidden @ weight.t()).float()

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly packed) parameters; every one must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            shard = None
            for frag, (packed, idx) in _PACKED.items():
                if frag in name:
                    name, shard = name.replace(frag, packed), idx
                    break
            if name not in params:
                raise ValueError(f"Checkpoint tensor {hf_name!r} has no matching model parameter.")
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    _check_shape(hf_name, param, tensor)
                    param.copy_(tensor)
                else:
                    sizes = self._packed_sizes(name)
                    start = sum(sizes[:shard])
                    dst = param.narrow(0, start, sizes[shard])
                    _check_shape(hf_name, dst, tensor)
                    dst.copy_(tensor)
            loaded.add(f"{name}#{shard}")
        expected = self._expected_loads(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing tensors for: {missing[:8]}...")

    def _packed_sizes(self, name: str) -> list[int]:
        attn = self.layers[0].self_attn
        if ".qkv_proj." in name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.layers[0].mlp.intermediate_size
        return [inter, inter]

    @staticmethod
    def _expected_loads(params: dict[str, nn.Parameter]) -> set[str]:
        expected = set()
        for name in params:
            if ".qkv_proj." in name:
                expected |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#{i}" for i in range(2)}
            else:
                expected.add(f"{name}#None")
        return expected

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for benchmarks (`load_format="dummy"`): small values, unit norms.
        Drawn on the parameters' device (an 8B model in seconds on a GPU, not minutes on the
        CPU); the same seed gives the same weights on the same kind of device."""
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                    continue
                if param.device not in gens:
                    gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                # fp32 draws in row slices: no full fp32 copy of a 1 GiB embedding at once.
                for rows in param.split(max(1, (1 << 26) // max(param[0].numel(), 1))):
                    draw = torch.empty(rows.shape, dtype=torch.float32, device=param.device)
                    rows.copy_(draw.uniform_(-0.02, 0.02, generator=gens[param.device]))


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}. Does config.json match the weights?"
        )
