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
    """Static inputs live in one int64 device buffer per graph size, laid out
    [input ids | positions | slots | seq_lens | src rows | block tables (bs x max_blocks)];
    a step fills the matching pinned host buffer and copies it with one H2D copy, then replays
    (the int32 views the kernels read are converted inside the graph).

    Every graph also writes the greedy token of each row into `last_tokens`, and a row whose
    src is j >= 0 takes its input id from last_tokens[j] instead of the host: async scheduling
    launches step N+1 with the tokens of step N that the host has not read yet. A batch under
    a grammar overwrites last_tokens[:n] with its masked argmax (the model runner's
    `launch_sampling`) before the next replay, which then reads those."""

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
        self.max_blocks = max_blocks_per_seq
        dev = kv_cache.device
        self.max_bs = max_num_seqs
        size = max_num_seqs * (5 + max_blocks_per_seq)
        self.static = torch.zeros(size, dtype=torch.int64, device=dev)
        # Two host buffers, used in turn: a step never writes the one the last copy may read.
        self.host = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self._turn = 0
        self.last_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=dev)
        self.tokens_host = [
            torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
        ]
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _size(self, bs: int) -> int:
        return bs * (5 + self.max_blocks)

    def _inputs(self, bs: int):
        """Views of the static buffer for graph size bs: ids, positions, slots, seq_lens,
        src rows, block tables (int64)."""
        s = self.static
        tables = s[5 * bs : self._size(bs)].view(bs, self.max_blocks)
        views = [s[i * bs : (i + 1) * bs] for i in range(5)]
        return (*views, tables)

    def _forward(self, bs: int) -> torch.Tensor:
        """Logits of every row: the input-id gather, the int32 casts, the LM head and the
        greedy tokens are part of the graph."""
        host_ids, positions, slots, lens, src, tables = self._inputs(bs)
        ids = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], host_ids)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=lens.to(torch.int32),
            block_tables=tables.to(torch.int32),
            query_start_loc_cpu=[],  # graph-safe backends never read host copies
            seq_lens_cpu=[],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        hidden = self.model(ids, positions, self.kv_cache, meta, self.backend)
        logits = self.model.compute_logits(hidden)
        self.last_tokens[:bs].copy_(logits.argmax(dim=-1))
        return logits

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        for bs in sorted(sizes, reverse=True):
            self._fill_padding(bs, 0)
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

    def _fill_padding(self, bs: int, n: int) -> None:
        """Rows n..bs of the static inputs: no KV write (slot -1), one token of the null block
        (seq_len 1, block 0), so padding never touches a real request's KV."""
        ids, positions, slots, lens, src, tables = self._inputs(bs)
        ids[n:].zero_()
        positions[n:].zero_()
        slots[n:].fill_(-1)
        lens[n:].fill_(1)
        src[n:].fill_(-1)
        tables[n:].zero_()

    def graph_size(self, n: int) -> int | None:
        return min((s for s in self.graphs if s >= n), default=None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        src_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Host lists of the n real rows (a block table may run past its sequence's blocks;
        src_rows[i] >= 0: row i's input id is the last step's greedy token of that row);
        returns fp32 logits [n, vocab] (a view of the graph's output)."""
        n = len(input_ids)
        bs = self.graph_size(n)
        assert bs is not None
        h = self.host_np[self._turn]
        self._turn ^= 1
        h[:n] = input_ids
        h[n:bs] = 0
        h[bs : bs + n] = positions
        h[bs + n : 2 * bs] = 0
        h[2 * bs : 2 * bs + n] = slot_mapping
        h[2 * bs + n : 3 * bs] = -1
        h[3 * bs : 3 * bs + n] = seq_lens
        h[3 * bs + n : 4 * bs] = 1
        h[4 * bs : 5 * bs] = -1
        if src_rows is not None:
            h[4 * bs : 4 * bs + n] = src_rows
        tables = h[5 * bs : self._size(bs)].reshape(bs, self.max_blocks)
        bsz = self.block_size
        for i, t in enumerate(block_tables):
            k = -(-seq_lens[i] // bsz)
            tables[i, :k] = t[:k]
        # Entries past a row's blocks are never read; padding rows read entry 0 only.
        tables[n:bs, 0] = 0
        size = self._size(bs)
        self.static[:size].copy_(self.host[self._turn ^ 1][:size], non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def launch(self, *inputs, src_rows: list[int]) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`run` without waiting: returns a pinned host tensor that an async copy fills with
        the n greedy tokens, and the event after which it holds them."""
        self.run(*inputs, src_rows=src_rows)
        return self.read_tokens(len(src_rows))

    def read_tokens_of_eager_step(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """`read_tokens` for a step that replayed no graph (a mixed step launched ahead, its
        tokens written to `last_tokens`): the buffers alternate as after a `run`, so the copy
        never lands in the one the step before may still be read from."""
        self._turn ^= 1
        return self.read_tokens(n)

    def read_tokens(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue the copy of `last_tokens[:n]` (the last replay's greedy tokens, or what the
        caller wrote there since: a grammar's masked argmax) to the host; called once per
        `run`, before the next one."""
        host = self.tokens_host[self._turn]  # alternates with the input buffers
        host[:n].copy_(self.last_tokens[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
