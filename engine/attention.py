"""Attention over the paged KV cache: the metadata the runner builds and the backends that use it.

KV cache layout (one tensor for the whole model):
    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
Block-major, so one block's K and V for every layer are contiguous: a run of consecutive block
ids is a single memory range, which the KV transfer ships as one descriptor. A layer's view
`kv_cache[:, layer]` has a block stride of num_layers * 2 * block_size * heads * head_dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Filled by the model runner for one forward pass; shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0 (null block)
    # Host copies: the torch backend loops over sequences in Python.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Contract: `forward` stores the new tokens' K/V at `slot_mapping` in the layer's cache,
    then returns causal attention of each sequence's queries over its whole context (cached
    prefix + new tokens) read through its block table. q: [T, Hq, D]; k, v: [T, Hkv, D];
    returns [T, Hq, D]. Backends must not depend on tokens of other sequences in the batch."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """kv_layer: [num_blocks, 2, block_size, H, D] (strided view)."""
    block_size = kv_layer.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_layer[block_ids, 0, offsets] = k.to(kv_layer.dtype)
    kv_layer[block_ids, 1, offsets] = v.to(kv_layer.dtype)


class TorchPagedAttention(AttentionBackend):
    """Reference backend: torch ops, one sequence at a time. CPU default and test oracle."""

    def forward(self, q, k, v, kv_layer, meta, scale):
        write_kv(kv_layer, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        num_q_heads, num_kv_heads = q.shape[1], kv_layer.shape[3]
        bs = meta.block_size
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            num_blocks = -(-seq_len // bs)
            blocks = meta.block_tables[i, :num_blocks].long()
            kv = kv_layer[blocks]  # [nb, 2, bs, H, D]
            keys = kv[:, 0].reshape(num_blocks * bs, num_kv_heads, -1)[:seq_len]
            values = kv[:, 1].reshape(num_blocks * bs, num_kv_heads, -1)[:seq_len]
            out[start:end] = _causal_attention(q[start:end], keys, values, scale, num_q_heads)
        return out


def _causal_attention(q, keys, values, scale, num_q_heads):
    """q: [n, Hq, D] are the last n positions of a context of len(keys)."""
    n, ctx = q.shape[0], keys.shape[0]
    rep = num_q_heads // keys.shape[1]
    keys = keys.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
    values = values.to(q.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
    q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
    mask = torch.arange(ctx).unsqueeze(0) <= q_pos  # [n, ctx]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask.to(q.device), scale=scale
    )
    return o.transpose(0, 1)
