"""Torch references of every kernel: plain, readable, slow. The tests' oracle.

Numerics follow `engine/models/layers.py` (transformers' order of operations and roundings),
so a kernel that matches these in fp32 and bf16 matches the engine's torch path. Attention is
restated from `engine/attention.py` with an explicit softmax; pass fp32 inputs for an fp32
oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values [seq_len, Hkv, D] read through its block table row."""
    block_size, num_kv_heads, head_dim = kv_layer.shape[2:]
    num_blocks = -(-seq_len // block_size)
    kv = kv_layer[block_table[:num_blocks].long()]  # [nb, 2, bs, Hkv, D]
    keys = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (the last q_len of seq_len positions)
    over its paged context; q [T, Hq, D] -> [T, Hq, D]. Covers decode (q_len 1) and prefill."""
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        if end == start:
            continue
        keys, values = gather_kv(kv_layer, block_tables[s], seq_len)
        group = q.shape[1] // keys.shape[1]
        keys = keys.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        values = values.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q[start:end].transpose(0, 1) @ keys.transpose(1, 2) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def decode_attention(q, kv_layer, block_tables, seq_lens, scale) -> torch.Tensor:
    """One query per sequence: `paged_attention` with query_start_loc = 0, 1, ..., S."""
    qsl = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention(q, kv_layer, block_tables, qsl, seq_lens, scale)


def kv_cache_write(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, Hkv, D] at slot_mapping (block_id * block_size + offset); slot < 0 skips."""
    block_size = kv_layer.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_layer[slots // block_size, 0, slots % block_size] = k[keep].to(kv_layer.dtype)
    kv_layer[slots // block_size, 1, slots % block_size] = v[keep].to(kv_layer.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, cast back to x's dtype, then `weight *`."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the add in x's dtype as the decoder layer does."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_pos: int, dtype: torch.dtype, attention_scaling: float = 1.0
) -> torch.Tensor:
    """[max_pos, D]: cos of the D/2 frequencies, then their sin, rounded to `dtype` exactly as
    `RotaryEmbedding.cos_sin` rounds them (so table lookups equal its values bit for bit)."""
    positions = torch.arange(max_pos, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    cos = (freqs.cos() * attention_scaling).to(dtype)
    sin = (freqs.sin() * attention_scaling).to(dtype)
    return torch.cat((cos, sin), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE (rotate_half) of q [T, Hq, D] and k [T, Hkv, D] at `positions`; with norm
    weights, Qwen3's per-head RMSNorm first. Returns new tensors."""
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, gate the first half (the packed gate_up_proj)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
