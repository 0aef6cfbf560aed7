"""Model runner: owns the weights and the KV cache; turns a scheduled batch into tokens.

Hand-offs: the scheduler fills `SchedulerOutput` (which requests, how many new tokens); this
runner builds the forward batch (input ids, positions, slot mapping, `AttentionMetadata`),
runs the model, and samples one token for every request whose KV now covers all its tokens.
The attention backend is the seam where the Triton kernels plug in; `_forward` is the seam for
CUDA-graph replay.

Async scheduling launches a greedy decode step in two parts: the forward (`launch_decode`)
and the sampling (the graphs' own argmax; under a grammar, `launch_sampling` after the host
has advanced the matchers with the previous step's tokens). Either way the host reads the
tokens later, with `LaunchedStep.tokens()`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphs, capture_sizes
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.models import get_model_class
from engine.piecewise_graph import PiecewiseGraphs, capture_token_sizes
from engine.request import Request
from engine.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    is_argmax_only,
    is_async_samplable,
    is_plain_greedy,
)
from engine.sampling_params import SAMPLING_EPS
from engine.scheduler import SchedulerOutput
from engine.spec_decode import num_accepted, sampling_batch
from engine.weights import iter_safetensors_weights

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 2 * GiB  # vLLM uses 4 GiB; UCX registration pins it all


@dataclass
class ModelRunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted ones and the target's own
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # one per token
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A greedy step launched on the GPU whose tokens the host has not read yet: a decode
    step, or with `async_mixed_steps` one with prompt chunks."""

    rows: list[tuple[Request, int]]  # (request, index of its placeholder in output_token_ids)
    row_of: dict[str, int]  # request id -> row
    # Forward launched, sampling not yet (a grammar row's mask needs its matcher to have
    # taken the previous step's token first): the logits, until `launch_sampling`.
    logits: torch.Tensor | None = None
    tokens_host: torch.Tensor | None = None  # pinned; filled by an async copy
    event: torch.cuda.Event | None = None  # recorded after that copy
    cpu_tokens: list[int] | None = None  # known at once when the step ran eagerly
    deferred_free: list[Request] = field(default_factory=list)  # free once this step is done
    chunk_ids: set[str] = field(default_factory=set)  # rows that sample nothing (a chunk)

    def holds(self, request_id: str) -> bool:
        """The request has a row in this step (its KV may still be being written)."""
        return request_id in self.row_of or request_id in self.chunk_ids

    @property
    def is_sampled(self) -> bool:
        """Its sampling is launched (or done): `tokens()` may be called."""
        return self.logits is None

    def tokens(self) -> list[int]:
        """Waits for the step; its greedy tokens in row order."""
        assert self.is_sampled, "launch_sampling first"
        if self.cpu_tokens is None:
            self.event.synchronize()
            self.cpu_tokens = self.tokens_host[: len(self.rows)].tolist()
        return self.cpu_tokens


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.init_model()
        self.attn_backend: AttentionBackend = self._make_backend()
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # prefill and mixed steps
        self.grammar_bitmask = None  # structured outputs: made for the first constrained row
        self.num_async_grammar_steps = 0  # launched steps masked after their forward

    def _make_backend(self) -> AttentionBackend:
        if self.device.type != "cuda":
            return TorchPagedAttention()
        from engine.attention_triton import TritonPagedAttention

        return TritonPagedAttention(static_max_seq_len=self.config.model.max_model_len)

    # ---- startup -------------------------------------------------------------------------
    def init_model(self) -> None:
        mc = self.config.model
        start = time.perf_counter()
        torch.manual_seed(mc.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # build parameters directly in the target dtype
        try:
            with torch.device(self.device):
                model = get_model_class(mc.hf_config)(mc.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        model.rotary.inv_freq = model.rotary.inv_freq.float()
        if mc.load_format == "dummy":
            model.init_dummy_weights(mc.seed)
        else:
            model.load_weights(iter_safetensors_weights(mc.path))
        if mc.quantization == "fp8":
            from engine.quantization import quantize_linears_fp8

            num = quantize_linears_fp8(model)
            logger.info("FP8 weights: %d linear layers quantized (e4m3, per channel)", num)
        self.model = model.eval()
        tensors = [*model.parameters(), *model.buffers()]
        self.weights_bytes = sum(t.numel() * t.element_size() for t in tensors)
        logger.info(
            "Model weights took %.4f GiB (%s, %s%s) in %.1f s",
            self.weights_bytes / GiB,
            mc.path,
            self.dtype,
            ", fp8 linear layers" if mc.quantization else "",
            time.perf_counter() - start,
        )

    def determine_num_blocks(self) -> int:
        """KV blocks from the memory budget, sized as vLLM does; fails if one max-length
        request cannot fit."""
        mc, cc, sc = self.config.model, self.config.cache, self.config.scheduler
        bytes_per_block = self.config.kv_bytes_per_token() * self.block_size
        blocks_per_seq = cdiv(mc.max_model_len, self.block_size)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
            available = num_blocks * bytes_per_block
        else:
            if cc.kv_cache_memory_bytes is not None:
                available = cc.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                available = self.profile_available_kv_bytes()
            else:
                available = DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = available // bytes_per_block
            if cc.kv_cache_memory_bytes is None and self.device.type == "cpu":
                # CPU default budget only (a dev machine's RAM, pinned for UCX): no more than
                # every sequence slot at full length could use. On a GPU the cache takes its
                # whole budget, as vLLM's does: blocks beyond max_num_seqs x max_model_len hold
                # queued remote prefills and cached prefixes.
                num_blocks = min(num_blocks, sc.max_num_seqs * blocks_per_seq + 1)
        usable = num_blocks - 1  # block 0 is the null block
        if usable < blocks_per_seq:
            needed = blocks_per_seq * bytes_per_block
            est_max_len = max(usable, 0) * self.block_size
            raise ValueError(
                f"To serve at least one request with the model's max seq len "
                f"({mc.max_model_len}), ({needed / GiB:.2f} GiB KV cache is needed, which is "
                f"larger than the available KV cache memory ({available / GiB:.2f} GiB). Based "
                f"on the available memory, the estimated maximum model length is {est_max_len}. "
                "Try increasing `gpu_memory_utilization` (or `kv_cache_memory_bytes` on CPU) "
                "or decreasing `max_model_len` when initializing the engine."
            )
        num_tokens = usable * self.block_size
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d, %s)",
            num_tokens,
            usable,
            self.block_size,
            str(cc.kv_dtype(mc.dtype)).removeprefix("torch."),
        )
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx",
            mc.max_model_len,
            num_tokens / mc.max_model_len,
        )
        return num_blocks

    @torch.inference_mode()
    def profile_available_kv_bytes(self) -> int:
        """vLLM's rule: KV gets `gpu_memory_utilization` x total memory, minus what the
        weights and the peak activations of a full-budget forward pass take."""
        mc, sc = self.config.model, self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, mc.max_model_len)
        num_blocks = cdiv(num_tokens, self.block_size) + 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.init_kv_cache(num_blocks)
        scratch_kv = self.kv_cache.nbytes
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device) + self.block_size,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(1, num_blocks, dtype=torch.int32, device=self.device)[None],
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
            block_size=self.block_size,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self._forward(ids, torch.arange(num_tokens, device=self.device), meta)
        spec = self.config.speculative
        num_logits_rows = sc.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self.model.compute_logits(hidden[-min(num_tokens, num_logits_rows) :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_kv
        del self.kv_cache, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * self.config.cache.gpu_memory_utilization) - peak - non_torch
        logger.info(
            "Memory profiling: peak %.2f GiB (weights + activations), other %.2f GiB, "
            "KV budget %.2f GiB",
            peak / GiB,
            non_torch / GiB,
            available / GiB,
        )
        return available

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model
        shape = (num_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)
        dtype = self.config.cache.kv_dtype(self.dtype)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    def warm_up_kernels(self) -> None:
        """Compile the attention kernels' variants now, not at a request's first mixed step
        (engine/attention_triton.py's `warm_up`). After the memory profile, whose full-budget
        prefill is what the prefill kernel's autotuning should time."""
        mc, sc = self.config.model, self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, mc.max_model_len)
        heads = mc.hf_config.num_attention_heads
        qk_norm = getattr(self.model, "qk_norm", False)
        self.attn_backend.warm_up(self.kv_cache[:, 0], heads, self.dtype, num_tokens, qk_norm)

    def init_cuda_graphs(self) -> None:
        mc, sc = self.config.model, self.config.scheduler
        if self.device.type != "cuda" or mc.enforce_eager:
            return
        hf = mc.hf_config
        from engine.models.layers import tune_small_m

        padded = {k: v for k, v in tune_small_m(self.model).items() if v["pad"]}
        if padded:
            logger.info("Small-batch GEMMs padded to 8 rows where cuBLAS is faster: %s", padded)
        if mc.quantization == "fp8":
            from engine.quantization import tune_fp8_small_m

            logger.info("FP8 weight-only decode GEMM tiles: %s", tune_fp8_small_m(self.model))
        if mc.fused_decode:
            from engine.models.layers import tune_gemv

            self.gemv_report = tune_gemv(self.model)
            logger.info(
                "Batch-1 decode GEMVs (kernels/gemv.py) vs what runs without them: %s",
                self.gemv_report,
            )
        max_bs = min(sc.max_num_seqs, 512)
        self.attn_backend.reserve(
            max_bs,
            hf.num_attention_heads,
            mc.num_kv_heads,
            mc.head_dim,
            mc.max_model_len,
            self.device,
        )
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.attn_backend,
            max_bs,
            cdiv(mc.max_model_len, self.block_size),
            self.block_size,
            mc.max_model_len,
        )
        self.graphs.capture(capture_sizes(max_bs))
        # The pieces are the fused (Triton) forward's ops: not for a model forced onto torch's.
        if mc.cudagraph_mode == "FULL_AND_PIECEWISE" and self.model.use_fused_kernels is not False:
            sizes = capture_token_sizes(sc.max_num_batched_tokens)
            self.piecewise = PiecewiseGraphs(self.model, self.kv_cache, self.attn_backend, sizes)
            self.piecewise.capture()

    # ---- one step ------------------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput, kv: KVCacheManager):
        """Host lists of a batch: ids, positions and slots (ints for one-token rows, arrays
        for chunks), query start offsets, seq lens, block tables."""
        bs = self.block_size
        input_ids, qsl, seq_lens, tables = [], [0], [], []
        pos_parts, slot_parts = [], []
        for s in sched.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            block_ids = kv.get_block_ids(r.request_id)
            assert len(block_ids) * bs >= end, "runner got too few blocks"
            input_ids.extend(r.token_ids(start, end - len(s.draft_token_ids)))
            input_ids.extend(s.draft_token_ids)
            if s.num_new_tokens == 1:  # decode rows: no arrays for one token
                pos_parts.append(start)
                slot_parts.append(block_ids[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end, dtype=np.int64)
                pos_parts.append(pos)
                slot_parts.append(np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(block_ids)  # may run past cdiv(end, bs): readers slice
        return input_ids, pos_parts, slot_parts, qsl, seq_lens, tables

    @property
    def async_scheduling(self) -> bool:
        """Off under speculative decoding: drafts follow from the tokens of the step before."""
        flag = self.config.scheduler.async_scheduling
        if self.config.speculative is not None:
            return False
        return self.graphs is not None if flag is None else flag

    @property
    def async_mixed_steps(self) -> bool:
        return self.async_scheduling and self.config.scheduler.async_mixed_steps

    def _launchable(self, r: Request) -> bool:
        """A row a launched step can sample on the device: an argmax (under a grammar, of
        the masked logits), or with `async_sampling` any `Sampler.draw` row."""
        if self.config.scheduler.async_sampling:
            return is_async_samplable(r.sampling_params, r.num_output_tokens)
        return is_argmax_only(r.sampling_params, r.num_output_tokens)

    def can_launch_async(self, sched: SchedulerOutput) -> bool:
        """A batch `launch_decode` can take: one new token per row, sampling that is an argmax
        of the logits (the graphs' argmax, or under a grammar the argmax of the masked logits;
        no logit bias, penalties or logprobs), and a captured graph large enough. Or one with
        prompt chunks that `launch_mixed` can take: every row plain greedy, no prompt logprobs,
        no drafts."""
        if not self.async_scheduling:
            return False
        if any(s.num_new_tokens != 1 for s in sched.scheduled):
            num_sampled = sum(s.reaches_end for s in sched.scheduled)
            if self.graphs is not None and num_sampled > self.graphs.last_tokens.numel():
                return False
            return self.async_mixed_steps and all(
                self._launchable(s.request)
                and s.request.sampling_params.structured_outputs is None
                and s.request.sampling_params.prompt_logprobs is None
                and not s.draft_token_ids
                for s in sched.scheduled
            )
        if self.graphs is not None and self.graphs.graph_size(len(sched.scheduled)) is None:
            return False
        return all(self._launchable(s.request) for s in sched.scheduled)

    @torch.inference_mode()
    def launch_decode(
        self, sched: SchedulerOutput, kv: KVCacheManager, prev: LaunchedStep | None
    ) -> LaunchedStep:
        """Start a greedy decode step without reading its tokens. Rows of requests that were
        in `prev` (still unread) take their input token from prev's output on the device.
        A batch with a grammar row stops after the forward (`step.is_sampled` is False): its
        masks wait for the matchers to take prev's tokens, then `launch_sampling`."""
        ids, pos, slots, qsl, seq_lens, tables = self._prepare(sched, kv)
        reqs = [s.request for s in sched.scheduled]
        src = [prev.row_of.get(r.request_id, -1) if prev else -1 for r in reqs]
        step = LaunchedStep(
            rows=[(r, r.num_output_tokens) for r in reqs],
            row_of={r.request_id: i for i, r in enumerate(reqs)},
        )
        is_plain = all(is_plain_greedy(r.sampling_params, r.num_output_tokens) for r in reqs)
        if self.graphs is not None:
            ids = [0 if j >= 0 else t for t, j in zip(ids, src)]
            if is_plain:  # the graph's argmax is the sampler
                step.tokens_host, step.event = self.graphs.launch(
                    ids, pos, slots, seq_lens, tables, src_rows=src
                )
            else:
                step.logits = self.graphs.run(ids, pos, slots, seq_lens, tables, src_rows=src)
            return step
        # No graphs (CPU, enforce_eager): run now; the pipeline logic above stays the same.
        known = prev.tokens() if prev is not None else []
        ids = [known[j] if j >= 0 else t for t, j in zip(ids, src)]
        hidden = self._run_eager(ids, pos, slots, qsl, seq_lens, tables, 1)
        logits = self.model.compute_logits(hidden)
        if is_plain:
            step.cpu_tokens = logits.argmax(dim=-1).tolist()
        else:
            step.logits = logits
        return step

    @torch.inference_mode()
    def launch_mixed(
        self, sched: SchedulerOutput, kv: KVCacheManager, prev: LaunchedStep | None
    ) -> LaunchedStep:
        """Start a step with prompt chunks (and decodes) without reading its tokens, as
        `launch_decode` does for decode-only steps: a decode row of a request in `prev` takes
        its input id from prev's greedy token on the device (`last_tokens`); the rows that
        reach their end are argmaxed into `last_tokens`, where the next launched step finds
        them, and copied to the host behind an event."""
        ids, pos, slots, qsl, seq_lens, tables = self._prepare(sched, kv)
        ends = [i for i, s in enumerate(sched.scheduled) if s.reaches_end]
        reqs = [s.request for s in sched.scheduled]
        sampled = [reqs[i] for i in ends]
        step = LaunchedStep(
            rows=[(r, r.num_output_tokens) for r in sampled],
            row_of={r.request_id: k for k, r in enumerate(sampled)},
            chunk_ids={r.request_id for r in reqs} - {r.request_id for r in sampled},
        )
        # (token index in the batch, prev's row) of each input the host does not know yet
        src = [
            (qsl[i], prev.row_of[r.request_id])
            for i, (s, r) in enumerate(zip(sched.scheduled, reqs))
            if prev is not None and s.num_new_tokens == 1 and r.request_id in prev.row_of
        ]
        max_q = max(s.num_new_tokens for s in sched.scheduled)
        last = [qsl[i + 1] - 1 for i in ends]
        if self.graphs is None:  # CPU, enforce_eager: run now, as `launch_decode` does
            known = prev.tokens() if src else []
            for t, j in src:
                ids[t] = known[j]
            hidden = self._run_eager(ids, pos, slots, qsl, seq_lens, tables, max_q)
            logits = self.model.compute_logits(hidden[last])
            step.cpu_tokens = self._device_tokens(logits, sampled).tolist()
            return step
        hidden, extra = self._run_eager(
            ids, pos, slots, qsl, seq_lens, tables, max_q, src=src, extra=last
        )
        logits = self.model.compute_logits(hidden[extra])
        n = len(ends)
        self.graphs.last_tokens[:n].copy_(self._device_tokens(logits, sampled))
        step.tokens_host, step.event = self.graphs.read_tokens_of_eager_step(n)
        return step

    def _device_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """A launched step's tokens, still on the device (`Sampler.draw`)."""
        params, generators = [r.sampling_params for r in reqs], [r.generator for r in reqs]
        return self.sampler.draw(logits, params, generators)

    @torch.inference_mode()
    def launch_sampling(self, step: LaunchedStep) -> None:
        """Sample a step `launch_decode` left at its logits: mask the rows whose grammar
        constrains their next token (the matchers as they are now: they must have taken the
        previous step's tokens), then argmax, or `Sampler.draw` when a row samples at random
        (`async_sampling`). Rows of finished requests (wasted rows) are not masked. With graphs
        the tokens go to `last_tokens`, where the next replay reads its input ids; the host
        reads them with `step.tokens()`."""
        assert not step.is_sampled, "sampled twice"
        logits, step.logits = step.logits, None
        reqs = [r for r, _ in step.rows]
        is_masked = self._apply_grammars(reqs, logits)
        self.num_async_grammar_steps += is_masked
        is_random = any(r.sampling_params.temperature >= SAMPLING_EPS for r in reqs)
        if self.graphs is None:
            step.cpu_tokens = self._device_tokens(logits, reqs).tolist()
            return
        n = len(reqs)
        if is_random:
            self.graphs.last_tokens[:n].copy_(self._device_tokens(logits, reqs))
        elif is_masked:  # else the graph's own argmax stands
            torch.argmax(logits, dim=-1, out=self.graphs.last_tokens[:n])
        step.tokens_host, step.event = self.graphs.read_tokens(n)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        input_ids, pos_parts, slot_parts, qsl, seq_lens, tables = self._prepare(sched, kv)
        n_seq = len(seq_lens)
        max_query_len = max(s.num_new_tokens for s in sched.scheduled)
        if max_query_len == 1 and self.graphs and self.graphs.graph_size(n_seq):
            # Decode batch: one copy into the graph's static inputs, one replay.
            logits = self.graphs.run(input_ids, pos_parts, slot_parts, seq_lens, tables)
            out = ModelRunnerOutput()
            self._sample(sched, None, qsl, out, logits)
            return out
        hidden = self._run_eager(
            input_ids, pos_parts, slot_parts, qsl, seq_lens, tables, max_query_len
        )
        out = ModelRunnerOutput()
        self._prompt_logprobs(sched, hidden, qsl, out)
        self._sample(sched, hidden, qsl, out)
        return out

    def _run_eager(
        self,
        input_ids,
        pos_parts,
        slot_parts,
        qsl,
        seq_lens,
        tables,
        max_query_len,
        src: list[tuple[int, int]] | None = None,
        extra: list[int] | None = None,
    ):
        """Hidden states of every new token: one H2D copy of the batch, one forward.
        `src` (a launched step, graphs on): (i, j) pairs, the input id at token i is the
        previous step's greedy token of its row j (`last_tokens[j]`), gathered on the device.
        `extra`: ints that ride the same copy; then returns (hidden, them on the device)."""
        bs = self.block_size
        n_tok, n_seq = len(input_ids), len(seq_lens)
        # Piecewise graphs: ids, positions and slots padded to the captured size p (w rows).
        p = self.piecewise.bucket(n_tok) if self.piecewise is not None else None
        w = p or n_tok
        positions = np.hstack(pos_parts)
        slots = np.hstack(slot_parts)
        width = max(cdiv(n, bs) for n in seq_lens)
        # One host buffer, one copy: [ids | positions | slots | seq_lens | qsl | tables |
        # src token indices | src rows | extra].
        o = 3 * w + 2 * n_seq + 1
        e = o + n_seq * width
        num_src, num_extra = len(src or ()), len(extra or ())
        host = np.zeros(e + 2 * num_src + num_extra, dtype=np.int64)
        if num_src:
            host[e : e + 2 * num_src] = np.asarray(src, dtype=np.int64).T.ravel()
        if num_extra:
            host[e + 2 * num_src :] = extra
        host[:n_tok] = input_ids
        host[w : w + n_tok] = positions
        host[2 * w : 2 * w + n_tok] = slots
        host[2 * w + n_tok : 3 * w] = -1  # padding rows store no K/V
        host[3 * w : 3 * w + n_seq] = seq_lens
        host[3 * w + n_seq : o] = qsl
        table_view = host[o:e].reshape(n_seq, width)
        for i, t in enumerate(tables):
            table_view[i, : cdiv(seq_lens[i], bs)] = t[: cdiv(seq_lens[i], bs)]
        host_t = torch.from_numpy(host)
        dev = (
            host_t
            if self.device.type == "cpu"
            else host_t.pin_memory().to(self.device, non_blocking=True)
        )
        ids_t, pos_t, slots_t = dev[:n_tok], dev[w : w + n_tok], dev[2 * w : 2 * w + n_tok]
        lens_t = dev[3 * w : 3 * w + n_seq].to(torch.int32)
        qsl_t = dev[3 * w + n_seq : o].to(torch.int32)
        tables_t = dev[o:e].view(n_seq, width).to(torch.int32)
        if num_src:  # the ids the host does not know yet, from the last step's tokens
            at, rows = dev[e : e + num_src].clone(), dev[e + num_src : e + 2 * num_src]
            dev[at] = self.graphs.last_tokens[rows]
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )
        if p is not None:
            hidden = self.piecewise.run(dev[: 3 * p], n_tok, meta)
        else:
            hidden = self._forward(ids_t, pos_t, meta)
        if extra is None:
            return hidden
        return hidden, dev[e + 2 * num_src :]

    def _forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_cache, meta, self.attn_backend)

    def _sample(self, sched, hidden, qsl, out: ModelRunnerOutput, logits=None) -> None:
        """`logits`: already computed for every row (decode graphs), else from `hidden`."""
        rows = [i for i, s in enumerate(sched.scheduled) if s.reaches_end]
        if not rows:
            return
        reqs = [sched.scheduled[i].request for i in rows]
        drafts = [sched.scheduled[i].draft_token_ids for i in rows]
        if any(drafts):
            assert logits is None, "drafts are verified on the eager path"
            self._verify(reqs, drafts, [qsl[i + 1] for i in rows], hidden, out)
            return
        if logits is not None:
            logits = logits if len(rows) == logits.shape[0] else logits[rows]
        else:
            logits = self.model.compute_logits(hidden[[qsl[i + 1] - 1 for i in rows]])
        self._apply_grammars(reqs, logits)
        batch = SamplingBatch(
            params=[r.sampling_params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            eos_token_ids=[
                set() if r.sampling_params.ignore_eos else r.eos_token_ids for r in reqs
            ],
        )
        result = self.sampler(logits, batch)
        for r, token, lp in zip(reqs, result.token_ids, result.logprobs):
            out.sampled[r.request_id] = [token]
            if lp is not None:
                out.logprobs[r.request_id] = [lp]

    def _verify(self, reqs, drafts, row_ends, hidden, out: ModelRunnerOutput) -> None:
        """Speculative decoding (engine/spec_decode.py): sample the target's token at each of
        a request's 1 + k last positions, keep the drafts that match and the target's token
        after them; rewind a seeded generator past the draws of the rejected positions."""
        index = [p for d, end in zip(drafts, row_ends) for p in range(end - 1 - len(d), end)]
        logits = self.model.compute_logits(hidden[index])
        # Grammar rows never have drafts (spec_decode.can_speculate): one row each here.
        self._apply_grammars([r for r, d in zip(reqs, drafts) for _ in range(1 + len(d))], logits)
        result = self.sampler(logits, sampling_batch(reqs, drafts))
        row = 0
        for r, d in zip(reqs, drafts):
            targets = result.token_ids[row : row + 1 + len(d)]
            n = num_accepted(d, targets) + 1  # tokens emitted
            out.sampled[r.request_id] = targets[:n]
            if r.sampling_params.logprobs is not None:
                out.logprobs[r.request_id] = result.logprobs[row : row + n]
            state_after = result.generator_states[row + n] if n <= len(d) else None
            if state_after is not None:  # the draws of rows n.. were for rejected positions
                r.generator.set_state(state_after)
            row += 1 + len(d)

    def _apply_grammars(self, reqs: list[Request], logits: torch.Tensor) -> bool:
        """Structured outputs: mask the constrained rows in place (not those of finished
        requests: wasted rows of a launched step); False if there were none. The host fills
        the bitmask while the device still runs this step's forward (launched, not awaited)."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.structured is not None and r.structured.is_constrained and not r.is_finished
        ]
        if not rows:
            return False
        if self.grammar_bitmask is None:
            from engine.grammar_bitmask import GrammarBitmask

            max_rows = self.config.scheduler.max_num_seqs
            self.grammar_bitmask = GrammarBitmask(max_rows, logits.shape[-1], self.device)
        self.grammar_bitmask.apply(logits, rows, [reqs[i].structured for i in rows])
        return True

    def _prompt_logprobs(self, sched, hidden, qsl, out: ModelRunnerOutput) -> None:
        for i, s in enumerate(sched.scheduled):
            r = s.request
            k = r.sampling_params.prompt_logprobs
            start = r.num_computed_tokens
            if k is None or start >= r.num_prompt_tokens:
                continue
            # Position p predicts prompt token p + 1; the last prompt position predicts output.
            end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if end <= start:
                out.prompt_logprobs[r.request_id] = []
                continue
            logits = self.model.compute_logits(hidden[qsl[i] : qsl[i] + end - start])
            next_ids = r.prompt_token_ids[start + 1 : end + 1]
            out.prompt_logprobs[r.request_id] = compute_prompt_logprobs(logits, next_ids, k)
