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
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.config import FP8_E4M3_MAX


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

    @cached_property
    def num_decodes(self) -> int:
        """Leading sequences with one new token each: the scheduler puts decodes first, so in
        a mixed batch a backend can give them its decode kernel and the rest its prefill one."""
        qsl, n = self.query_start_loc_cpu, 0
        while n < self.num_seqs and qsl[n + 1] - qsl[n] == 1:
            n += 1
        return n

    @cached_property
    def decode_max_seq_len(self) -> int:
        """The longest context among the leading decodes (host; 0 when there are none)."""
        return max(self.seq_lens_cpu[: self.num_decodes], default=0)

    @cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """query_start_loc of the sequences after the leading decodes, from 0 (device)."""
        return self.query_start_loc[self.num_decodes :] - self.num_decodes


class AttentionBackend(ABC):
    """Contract: `forward` stores the new tokens' K/V at `slot_mapping` in the layer's cache,
    then returns causal attention of each sequence's queries over its whole context (cached
    prefix + new tokens) read through its block table. q: [T, Hq, D]; k, v: [T, Hkv, D];
    returns [T, Hq, D]. Backends must not depend on tokens of other sequences in the batch.
    `kv_written=True`: the caller already stored K/V (the CUDA path fuses the store into RoPE).
    `out` [T, Hq, D], contiguous: where to write the result (a CUDA graph's static buffer)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def warm_up(
        self,
        kv_layer: torch.Tensor,
        num_q_heads: int,
        dtype: torch.dtype,
        num_tokens: int,
        qk_norm: bool = False,
    ) -> None:
        """Build whatever `forward` would otherwise build on first use (kernel variants), so
        no request waits for it. `kv_layer`: one layer of the real cache (read, not written);
        `dtype`: the queries'; `num_tokens`: a step's token budget; `qk_norm`: the model
        normalizes q and k per head (Qwen3). Nothing to do for a backend without JIT
        kernels."""
        return None  # torch's kernels are built ahead of time


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """kv_layer: [num_blocks, 2, block_size, H, D] (strided view)."""
    block_size = kv_layer.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_layer[block_ids, 0, offsets] = to_cache_dtype(k, kv_layer.dtype)
    kv_layer[block_ids, 1, offsets] = to_cache_dtype(v, kv_layer.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: an FP8 cache (scale 1.0) saturates at its largest finite value,
    as vLLM's conversion does, instead of overflowing to NaN."""
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)


class TorchPagedAttention(AttentionBackend):
    """Reference backend: torch ops, one sequence at a time. CPU default and test oracle."""

    def forward(self, q, k, v, kv_layer, meta, scale, kv_written=False, out=None):
        if not kv_written:
            write_kv(kv_layer, k, v, meta.slot_mapping)
        if meta.max_query_len == 1 and meta.num_seqs > 1:
            o = _batched_decode(q, kv_layer, meta, scale)
            return o if out is None else out.copy_(o)
        if out is None:
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


def _batched_decode(q, kv_layer, meta, scale):
    """One token per sequence: one SDPA call for the batch over contexts padded to the longest,
    padding masked out (a masked key adds an exact 0 to the softmax sum and the output)."""
    num_seqs, bs = meta.num_seqs, meta.block_size
    max_len = meta.max_seq_len
    num_blocks = -(-max_len // bs)
    kv = kv_layer[meta.block_tables[:, :num_blocks].long()]  # [S, nb, 2, bs, H, D]
    shape = (num_seqs, num_blocks * bs, kv.shape[-2], kv.shape[-1])
    keys = kv[:, :, 0].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
    values = kv[:, :, 1].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
    lens = torch.tensor(meta.seq_lens_cpu, device=q.device)
    mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return o[:, :, 0, :]


def _causal_attention(q, keys, values, scale, num_q_heads):
    """q: [n, Hq, D] are the last n positions of a context of len(keys).

    The two common shapes take SDPA's mask-free paths, which are faster and are what
    transformers itself runs: a whole prompt (`is_causal`) and one decode token (sees all)."""
    n, ctx = q.shape[0], keys.shape[0]
    keys = keys.to(q.dtype).transpose(0, 1)
    values = values.to(q.dtype).transpose(0, 1)
    mask, is_causal = None, False
    if n == ctx:
        is_causal = n > 1
    elif n > 1:  # a chunk after a cached prefix: query i sees positions <= ctx - n + i
        q_pos = torch.arange(ctx - n, ctx).unsqueeze(1)
        mask = (torch.arange(ctx).unsqueeze(0) <= q_pos).to(q.device)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys,
        values,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=num_q_heads != keys.shape[0],
    )
    return o.transpose(0, 1)
