"""`TritonPagedAttention`: engine/attention.py's `AttentionBackend` contract on Triton kernels.

Per layer: the KV-write kernel stores the new tokens' K/V at `slot_mapping`, then the sequences
with one new token take the paged decode kernel and the others the prefill kernel. In a mixed
batch the decodes are the leading sequences (the scheduler orders them so): the prefill kernel
could serve them too, but it gives each (sequence, q head) a BLOCK_M-row tile with one live row,
so 128 decodes at 512 tokens cost it ~100x the decode kernel's FLOPs (on the H200 a step of 128
decodes plus a 512-token chunk took 40.5 ms of GPU time against a 13.2 ms roofline).

CUDA graphs: the decode path syncs nothing and allocates only the split-K workspace, which this
backend owns and reuses across layers and steps. Give a `static_max_seq_len` (the model's max
length) so the split count depends on the batch size alone, and call `reserve` with the
largest captured batch before capturing so no buffer grows inside a graph.
"""

from __future__ import annotations

import itertools

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from kernels.kv_cache_write import kv_cache_write
from kernels.paged_decode_attention import (
    DecodeConfig,
    DecodeRope,
    SplitWorkspace,
    choose_num_splits,
    paged_decode_attention,
)
from kernels.prefill_attention import prefill_attention
from kernels.utils import num_sms

# True: decode steps rotate q and store the new K/V inside the attention kernel (`attend_rope`),
# one launch fewer per layer; False: kernels/rotary.py's kernel first. Off until it has run on
# a GPU: the CPU checks (interpreter, sm_90 compile) pass, no device could be had to test and
# time it (`gpu_engine --variants bf16,rope-attention`; bench/README.md, 2026-12-08).
ROPE_IN_ATTENTION = False


class TritonPagedAttention(AttentionBackend):
    def __init__(self, static_max_seq_len: int | None = None):
        self.static_max_seq_len = static_max_seq_len
        self._stats = torch.empty(0)  # flat fp32 [2 * rows]: row max, row sum
        self._acc = torch.empty(0)  # flat fp32 [rows * head_dim]

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
    ) -> torch.Tensor:
        if not kv_written:
            kv_cache_write(k, v, kv_layer, meta.slot_mapping)
        if meta.max_query_len == 1:
            return self._decode_step(q, kv_layer, meta, scale, out)
        d = meta.num_decodes
        if d == 0:
            return prefill_attention(
                q, kv_layer, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                max_query_len=meta.max_query_len, out=out,
            )  # fmt: skip
        # Mixed (eager; captured only piecewise, around it): rows 0..d-1 are the decodes.
        if out is None:
            out = torch.empty_like(q)
        tables, lens = meta.block_tables, meta.seq_lens
        self._decode(q[:d], kv_layer, tables[:d], lens[:d], scale, meta.decode_max_seq_len, out[:d])
        prefill_attention(
            q[d:], kv_layer, tables[d:], meta.prefill_query_start_loc, lens[d:], scale,
            max_query_len=meta.max_query_len, out=out[d:],
        )  # fmt: skip
        return out

    @property
    def rope_in_attention(self) -> bool:
        """Whether decode steps should offer `attend_rope` their RoPE work."""
        return ROPE_IN_ATTENTION

    def attend_rope(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rope: DecodeRope,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A decode step's attention with `rope`'s work done in the kernel (q un-rotated, K/V
        not stored yet); None where it does not apply (then nothing has run)."""
        if not ROPE_IN_ATTENTION or meta.max_query_len != 1 or not rope.supports(q.shape[2]):
            return None
        return self._decode_step(q, kv_layer, meta, scale, out, rope)

    def _decode_step(self, q, kv_layer, meta, scale, out=None, rope=None):
        """A decode step: every sequence's one query row over its whole context."""
        assert q.shape[0] == meta.seq_lens.shape[0], "decode: one query row per sequence"
        max_seq_len = self.static_max_seq_len or meta.max_seq_len
        tables, lens = meta.block_tables, meta.seq_lens
        return self._decode(q, kv_layer, tables, lens, scale, max_seq_len, out, rope)

    def _decode(self, q, kv_layer, block_tables, seq_lens, scale, max_seq_len, out=None, rope=None):
        num_splits = self._num_splits(q.shape[0], kv_layer.shape[3], max_seq_len, q.device)
        workspace = None
        if num_splits > 1:
            workspace = self._workspace(q.shape[0], q.shape[1], num_splits, q.shape[2], q)
        return paged_decode_attention(
            q, kv_layer, block_tables, seq_lens, scale,
            out=out, max_seq_len=max_seq_len, workspace=workspace, rope=rope,
        )  # fmt: skip

    def warm_up(
        self,
        kv_layer: torch.Tensor,
        num_q_heads: int,
        dtype: torch.dtype,
        num_tokens: int,
        qk_norm: bool = False,
    ) -> None:
        """Compile every kernel variant `forward` and `attend_rope` can launch: the decode
        kernel single-pass and split (with its merge), each also with the RoPE work (its slots
        -1: no store), and the prefill kernel. The kernels do not specialize on what
        changes between steps (kernels/paged_decode_attention.py's VARYING), so these are all
        the variants a server meets, and none compiles while requests wait (on a cold Triton
        cache each takes up to ~1.5 s). The prefill runs at `num_tokens` rows so that, if it is the
        first prefill, its autotuning times the sizes steps have. Reads block 0 (the null
        block) only and writes only scratch."""
        _, _, block_size, _, head_dim = kv_layer.shape
        dev = kv_layer.device
        q = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=dtype, device=dev)
        width = -(-num_tokens // block_size)
        tables = torch.zeros(1, width, dtype=torch.int32, device=dev)
        lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
        prefill_attention(q, kv_layer, tables, qsl, lens, 1.0, max_query_len=num_tokens)
        tables = torch.zeros(2, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(2, dtype=torch.int32, device=dev)
        ropes: list[DecodeRope | None] = [None]
        if ROPE_IN_ATTENTION and DecodeRope.supports(head_dim):
            kv = q[:2, : kv_layer.shape[3]]
            ropes.append(DecodeRope(
                kv, kv, torch.full((2,), -1, device=dev),
                torch.zeros(2, dtype=torch.int64, device=dev),
                torch.zeros(1, head_dim, dtype=dtype, device=dev),
                *(torch.ones(head_dim, dtype=dtype, device=dev),) * (2 if qk_norm else 0),
            ))  # fmt: skip
        for splits, rope in itertools.product((1, 2), ropes):
            workspace = self._workspace(2, num_q_heads, splits, head_dim, q) if splits > 1 else None
            paged_decode_attention(
                q[:2], kv_layer, tables, lens, 1.0, max_seq_len=block_size,
                workspace=workspace, config=DecodeConfig(num_splits=splits), rope=rope,
            )  # fmt: skip

    def reserve(
        self,
        max_num_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        """Size the split-K workspace for every batch size up to `max_num_seqs` (call before
        CUDA-graph capture)."""
        rows = max(
            s * self._num_splits(s, num_kv_heads, max_seq_len, device)
            for s in range(1, max_num_seqs + 1)
        )
        self._grow(rows * num_q_heads, head_dim, device)

    @staticmethod
    def _num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device) -> int:
        return choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(device))

    def _grow(self, rows: int, head_dim: int, device: torch.device) -> None:
        if self._stats.device != device or self._stats.numel() < 2 * rows:
            self._stats = torch.empty(2 * rows, dtype=torch.float32, device=device)
        if self._acc.device != device or self._acc.numel() < rows * head_dim:
            self._acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)

    def _workspace(self, num_seqs, num_q_heads, num_splits, head_dim, like) -> SplitWorkspace:
        rows = num_seqs * num_q_heads * num_splits
        self._grow(rows, head_dim, like.device)
        shape = (num_seqs, num_q_heads, num_splits)
        return SplitWorkspace(
            row_max=self._stats[:rows].view(shape),
            row_sum=self._stats[rows : 2 * rows].view(shape),
            acc=self._acc[: rows * head_dim].view(*shape, head_dim),
        )
