"""CUDA graphs for decode-only batches.

One graph per batch size of a ladder (1, 2, 4, 8, then steps of 16), captured largest first
into one shared memory pool. A decode batch of n sequences runs the graph of the smallest
captured size >= n: the real rows are copied into static input buffers and the padding rows
point at the null block (slot -1: no KV write; seq_len 1 over block 0), so they never touch a
real request's KV.

Without graphs a decode step of a 36-layer model is ~500 small kernel launches from Python:
~70 ms/token in HF transformers on an H200 (FACTS.md), 20x the memory-bandwidth floor.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_cache,
        backend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
    ):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        dev = kv_cache.device
        self.max_bs = max_num_seqs
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev
        )
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_start_loc_cpu=[],  # graph-safe backends never read host copies
            seq_lens_cpu=[],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        """Logits of every row: the LM head is part of the graph."""
        hidden = self.model(
            self.input_ids[:bs], self.positions[:bs], self.kv_cache, self._meta(bs), self.backend
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        for bs in sorted(sizes, reverse=True):
            self._forward(bs)  # warm up: Triton compiles, cuBLAS picks algorithms
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info(
            "Captured %d CUDA graphs (batch sizes %s..%s) in %.1f s",
            len(sizes),
            min(sizes),
            max(sizes),
            time.perf_counter() - start,
        )

    def graph_size(self, n: int) -> int | None:
        return min((s for s in self.graphs if s >= n), default=None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Inputs are device tensors of the n real rows; returns fp32 logits [n, vocab]."""
        n = input_ids.shape[0]
        bs = self.graph_size(n)
        assert bs is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables)
        if bs > n:  # padding rows: no write, one token of the null block
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(0)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
