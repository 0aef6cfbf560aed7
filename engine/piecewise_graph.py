"""Piecewise CUDA graphs for prefill and mixed steps: everything but attention is captured.

Why: a decode-only step replays one whole-model graph (engine/cuda_graph.py), but a step with a
prompt chunk in it ran eagerly, ~10 launches per layer from Python. On the H200 at the
Qwen3-8B shape a step of 128 decodes plus a 512-token chunk took 28.1 ms of wall time for
18.9 ms of GPU work: the GPU waited for the host's 144 GEMM and 217 Triton launches
(bench/results/mixed_step-2026-12-02/host_profile.json). Such steps set the inter-token gap of
every decode in them.

How (vLLM's piecewise mode, without torch.compile): for each token count T of a ladder, the
forward is cut at its attention calls into num_layers + 1 pieces, each captured as a graph:

    piece 0      embed -> RMSNorm -> qkv_proj -> q/k-norm + RoPE + K/V store    (layer 0)
    piece i      o_proj -> add + RMSNorm -> MLP -> add + RMSNorm                 (layer i - 1)
                 -> qkv_proj -> q/k-norm + RoPE + K/V store                      (layer i)
    piece L      o_proj -> add + RMSNorm -> MLP -> add + final RMSNorm           (layer L - 1)

Between pieces the attention backend runs eagerly on the step's real rows, since its kernels'
grids follow the batch's sequences. The pieces call the layers' own halves of the fused path
(`DecoderLayer.input_norm_fused`, `Attention.qkv_rope`, `DecoderLayer.mlp_fused`), the code
`DecoderForCausalLM._forward_fused` runs, in the same order. Pieces read and write static
buffers sized for the largest T (token ids, positions, slots, residual, qkv, attention output,
final hidden states). A step of n tokens
runs the smallest T >= n; rows n..T are token 0 at position 0 with slot -1, which the RoPE
kernel does not store. Every captured op is row-wise (GEMMs, norms, per-token FP8 scales), so
padding rows never change real ones. Steps larger than the ladder run eagerly: there the GPU's
work hides the host's.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_TOKENS = 2048  # past this a step's GPU time hides its launches (8B: ~60 ms)


def capture_token_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: fine steps where decodes dominate a step, coarser above
    (padding costs at most 1/4 of a step below 64 tokens, 1/8 above)."""
    ladder = [8, 16, 24, 32, 48, 64, *range(96, 257, 32), *range(320, 1025, 64)]
    ladder += range(1280, MAX_CAPTURE_TOKENS + 1, 256)
    sizes = [s for s in ladder if s < max_tokens]
    if max_tokens <= MAX_CAPTURE_TOKENS:
        sizes.append(max_tokens)
    return sizes


class PiecewiseGraphs:
    """`use_graphs=False` runs the same pieces without capture: the CPU check of the padding
    and the static buffers (under TRITON_INTERPRET=1)."""

    def __init__(self, model, kv_cache, backend, sizes: list[int], use_graphs: bool = True):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = sorted(sizes)
        self.use_graphs = use_graphs
        attn = model.layers[0].self_attn
        self.num_layers = len(model.layers)
        m, dev = self.sizes[-1], kv_cache.device
        dtype = model.embed_tokens.weight.dtype
        hidden = model.config.hidden_size
        self.inputs = torch.zeros(3 * m, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(m, hidden, dtype=dtype, device=dev)
        self.qkv = torch.zeros(m, attn.q_size + 2 * attn.kv_size, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(m, attn.q_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(m, hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.capture_s, self.capture_bytes = 0.0, 0  # what capturing took: time, GPU memory

    def bucket(self, num_tokens: int) -> int | None:
        """The token count a step of `num_tokens` runs at; None: larger than every piece."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def _views(self, t: int):
        """ids, positions and slots of bucket t: [ids | positions | slots] of one buffer, the
        layout `run` copies in."""
        return self.inputs[:t], self.inputs[t : 2 * t], self.inputs[2 * t : 3 * t]

    def _piece(self, t: int, i: int) -> None:
        from kernels.rms_norm import fused_add_rms_norm

        model, layers = self.model, self.model.layers
        ids, positions, slots = self._views(t)
        residual = self.residual[:t]
        if i == 0:
            residual.copy_(model.embed_tokens(ids))
            x, _ = layers[0].input_norm_fused(residual, None)
        else:
            prev = layers[i - 1]
            x, _ = prev.mlp_fused(prev.self_attn.o_proj(self.attn_out[:t]), residual)
            if i == self.num_layers:
                norm = model.norm
                x, _ = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
                self.hidden[:t].copy_(x)
                return
            x, _ = layers[i].input_norm_fused(x, residual)
        cache = model._cos_sin_cache(x.dtype, x.device)
        layers[i].self_attn.qkv_rope(
            x, positions, cache, self.kv_cache[:, i], slots, out=self.qkv[:t]
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Per size, largest first: run every piece once (Triton compiles, cuBLAS picks its
        algorithms), then capture each into one shared memory pool."""
        if not self.use_graphs:
            return
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        for t in reversed(self.sizes):
            ids, positions, slots = self._views(t)
            ids.zero_()
            positions.zero_()
            slots.fill_(-1)  # no K/V store while capturing
            for i in range(self.num_layers + 1):
                self._piece(t, i)
            torch.cuda.synchronize()
            pieces = []
            for i in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._piece(t, i)
                if self.pool is None:
                    self.pool = graph.pool()
                pieces.append(graph)
            self.graphs[t] = pieces
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved() - reserved
        logger.info(
            "Captured piecewise CUDA graphs for prefill and mixed steps: %d token sizes "
            "(%d..%d) x %d pieces in %.1f s, %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.num_layers + 1,
            self.capture_s,
            self.capture_bytes / (1 << 30),
        )

    def run(self, inputs: torch.Tensor, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """inputs: [ids | positions | slots] of `bucket(num_tokens)` rows each, padded past
        num_tokens (token 0, position 0, slot -1), on the device. Returns the final hidden
        states of the real rows: a view of a static buffer, valid until the next `run`."""
        t = len(inputs) // 3
        n = num_tokens
        assert t in self.sizes and len(inputs) == 3 * t and n <= t
        self.inputs[: 3 * t].copy_(inputs, non_blocking=True)
        layers = self.model.layers
        for i in range(self.num_layers + 1):
            if self.use_graphs:
                self.graphs[t][i].replay()
            else:
                self._piece(t, i)
            if i == self.num_layers:
                break
            attn = layers[i].self_attn
            q, k, v = attn.split_qkv(self.qkv[:n])
            out = self.attn_out[:n].view(n, attn.num_heads, attn.head_dim)
            self.backend.forward(
                q, k, v, self.kv_cache[:, i], meta, attn.scale, kv_written=True, out=out
            )
        return self.hidden[:n]
