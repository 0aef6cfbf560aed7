"""Engine configuration: frozen dataclasses, validated on construction.

`EngineConfig.from_args` is the one place where user-facing arguments (the vLLM-shaped
keywords of `LLM(...)` and the CLI) become typed config. Everything downstream reads these
objects and never re-parses arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from engine.hf_config import load_generation_config, load_hf_config
from engine.quantization import check_quantization
from engine.weights.hub import resolve_model_path

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _resolve_dtype(
    dtype: str | torch.dtype, hf_config: PretrainedConfig, device: str
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}. Choose one of: auto, {', '.join(_DTYPES)}.")
        return _DTYPES[dtype]
    if device == "cpu":
        # CPUs here have no bf16 instructions (bf16 matmul is ~6x slower than fp32).
        return torch.float32
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype, torch.float32)
    if cfg_dtype in (None, torch.float32):
        return torch.float32 if cfg_dtype is not None else torch.bfloat16
    return cfg_dtype


CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    path: Path
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    # vLLM's compilation_config.cudagraph_mode, the two modes this engine has: whole-model
    # graphs for decode-only steps, plus piecewise ones (all but attention) for the others.
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    # Fewer kernels per small-batch decode step (issue: batch 1 is launch-bound): batch-1 graphs
    # run the projections on kernels/gemv.py's GEMVs (norm / SiLU-mul folded in, no split-K
    # reduce) wherever a start-up timing finds them faster than cuBLAS. On by default since the
    # 2026-12-05 measurements (bench/README.md): batch-1 TPOT fell on both cards and models.
    fused_decode: bool = True
    # The HF generation_config.json contents, or {} when `generation_config="vllm"`.
    generation_config: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    seed: int = 0
    quantization: str | None = None  # "fp8": FP8 weights quantized at load (engine/quantization.py)

    def __post_init__(self) -> None:
        assert self.load_format in ("auto", "safetensors", "dummy"), self.load_format
        assert self.max_model_len > 0
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode {self.cudagraph_mode!r} is not supported; use one of "
                f"{list(CUDAGRAPH_MODES)} (or enforce_eager=True for no CUDA graphs)."
            )

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        """K and V of one token over all layers, stored as `kv_dtype` (default: the model's)."""
        elem = torch.tensor([], dtype=kv_dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.9
    # CPU (or an explicit cap on GPU): bytes of KV cache to allocate.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # vLLM's --kv-cache-dtype: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3")
    # in FP8 e4m3 with a scale of 1.0 (vLLM's default without calibrated scales), saturating
    # at +-448: half the bytes per token, so twice the tokens in the same memory.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            hint = (
                " FP8 e5m2 is not supported: use fp8 (e4m3)."
                if self.cache_dtype == "fp8_e5m2"
                else ""
            )
            raise ValueError(
                f"Unknown kv_cache_dtype {self.cache_dtype!r}; use one of "
                f"{', '.join(KV_CACHE_DTYPES)}.{hint}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.prefix_caching_hash_algo not in ("sha256",):
            raise ValueError(
                f"Unknown prefix_caching_hash_algo {self.prefix_caching_hash_algo!r}; use 'sha256'."
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 2, got {self.num_gpu_blocks_override}."
            )

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores."""
        return model_dtype if self.cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # vLLM's long_prefill_token_threshold: at most this many of one request's prompt tokens per
    # step (0: no cap). Online serving sets it so that a long prompt is spread over several
    # steps and the decodes batched with it never wait behind one huge chunk.
    long_prefill_token_threshold: int = 0
    # Most prompt tokens (all requests together) in a step that also carries decodes (0: the
    # whole budget). The threshold above bounds one request's chunk; this bounds the step, so a
    # decode's inter-token latency is at most a decode step plus this many prefill tokens (the
    # Sarathi-Serve budget). A step with no decodes keeps max_num_batched_tokens.
    max_prefill_tokens_while_decoding: int = 0
    # With the cap above: raise it to 1/N of the prompt tokens that could start now (running
    # requests' and those of the waiting ones the free max_num_seqs slots admit; up to the
    # whole budget), so that a backlog clears in about N steps (0: a fixed cap). Under light
    # load the cap holds (inter-token latency); once prompts queue faster than the cap admits
    # them, the budget follows the queue and throughput does not stay flat at the cap's rate.
    prefill_backlog_steps: int = 0
    # Launch decode step N+1 before reading step N's tokens (steady greedy decode under CUDA
    # graphs): the host's scheduling and output work overlaps the GPU. None: on with graphs.
    async_scheduling: bool | None = None
    # With async scheduling: launch steps with prompt chunks ahead too (greedy rows, no prompt
    # logprobs), admitting new requests while a step runs. On: on the H200 it cut the GPU's idle
    # time between steps by half at c=256 through `tandem serve` (bench/README.md, 2026-12-03).
    async_mixed_steps: bool = True
    # With async scheduling: launch steps whose rows sample at random (temperature, top-p/k,
    # min-p, seeds; no penalties, logit bias or logprobs) ahead too. On: on the H200 it raised
    # sampled traffic's throughput by 18% at c=256 through `tandem serve` (bench/README.md,
    # 2026-12-04); seeded rows draw the synchronous engine's tokens.
    async_sampling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill disabled: long prompts "
                "could never be scheduled. Raise max_num_batched_tokens or enable chunked prefill."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"Unknown scheduling policy {self.policy!r}; use 'fcfs' or 'priority'."
            )
        if self.prefill_backlog_steps < 0:
            raise ValueError(
                f"prefill_backlog_steps must be 0 (a fixed cap) or positive, got "
                f"{self.prefill_backlog_steps}."
            )
        if self.prefill_backlog_steps and not self.max_prefill_tokens_while_decoding:
            raise ValueError(
                "prefill_backlog_steps raises max_prefill_tokens_while_decoding with the queue: "
                "set max_prefill_tokens_while_decoding too (e.g. 512), or drop it."
            )
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_while_decoding"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be 0 (no cap) or positive, got {value}.")
            if value and not self.enable_chunked_prefill:
                raise ValueError(
                    f"{name} splits prompts over steps: it needs chunked prefill. Enable "
                    f"chunked prefill or set {name} to 0."
                )


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")
# vLLM's other backends: named so that a vLLM command line fails with a clear message.
_VLLM_ONLY_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config.backend`; "auto" is xgrammar (the only one here)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend in _VLLM_ONLY_BACKENDS:
            raise ValueError(
                f"Structured outputs backend {self.backend!r} is not available in Tandem, which "
                "implements structured outputs with xgrammar only: use 'auto' or 'xgrammar'."
            )
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(
                f"Unknown structured outputs backend {self.backend!r}; choose one of: "
                f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}."
            )


SPECULATIVE_METHODS = ("ngram",)
# vLLM's other methods: named so that a vLLM command line fails with a clear message.
_VLLM_ONLY_SPEC_METHODS = (
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "draft_model",
    "mtp",
    "deepseek_mtp",
    "suffix",
    "ngram_gpu",
)
MAX_SPECULATIVE_TOKENS = 128  # vLLM's rejection sampler's MAX_SPEC_LEN


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for its n-gram (prompt lookup) method: propose up to
    `num_speculative_tokens` tokens that followed the earliest earlier occurrence of the
    longest suffix of [prompt_lookup_min, prompt_lookup_max] tokens; verify them in one
    forward pass. Defaults as vLLM: both lookup sizes 5, or each the other when one is given."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        method = "ngram" if self.method == "[ngram]" else self.method  # vLLM's alias
        object.__setattr__(self, "method", method)
        if method in _VLLM_ONLY_SPEC_METHODS:
            raise ValueError(
                f"Speculative method {method!r} is not available in Tandem, which implements "
                "the 'ngram' method only: set speculative_config's method to 'ngram'."
            )
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"Unknown speculative method {method!r} in speculative_config; use 'ngram'."
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 0 < k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config's num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}: set it to the number of draft "
                "tokens to verify per step (e.g. 4)."
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(
                    f"speculative_config's {name} must be an integer > 0, got {value!r}."
                )
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(
                f"speculative_config's prompt_lookup_min={lo} must be <= "
                f"prompt_lookup_max={hi}: lower prompt_lookup_min or raise prompt_lookup_max."
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's JSON object; an unknown key fails, naming the keys Tandem knows."""
        if not isinstance(values, dict):
            raise ValueError(
                f"speculative_config must be a JSON object, got {type(values).__name__}: e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}.'
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; Tandem's n-gram speculation "
                f"takes: {', '.join(sorted(known))}."
            )
        if "method" not in values:
            raise ValueError(
                "speculative_config needs a 'method' (Tandem implements 'ngram'), e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}.'
            )
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token, in the dtype the cache stores."""
        return self.model.kv_bytes_per_token(self.cache.kv_dtype(self.model.dtype))

    def __post_init__(self) -> None:
        if self.speculative is not None and self.scheduler.async_scheduling:
            raise ValueError(
                "Speculative decoding does not run with async scheduling (a step's drafts "
                "follow from the previous step's tokens, which async scheduling has not read "
                "yet): drop --async-scheduling or the speculative config."
            )

    @classmethod
    def from_args(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        revision: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        scheduling_policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_prefill_tokens_while_decoding: int = 0,
        prefill_backlog_steps: int = 0,
        async_scheduling: bool | None = None,
        async_mixed_steps: bool = True,
        async_sampling: bool = True,
        load_format: str = "auto",
        enforce_eager: bool = False,
        cudagraph_mode: str = "FULL_AND_PIECEWISE",
        fused_decode: bool = True,
        generation_config: str = "auto",
        device: str = "auto",
        seed: int = 0,
        structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | None = None,
        quantization: str | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
    ) -> EngineConfig:
        structured_outputs = structured_outputs_config  # validated before the model loads
        if not isinstance(structured_outputs, StructuredOutputsConfig):
            structured_outputs = StructuredOutputsConfig(**(structured_outputs or {}))
        speculative = speculative_config
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            speculative = SpeculativeConfig.from_dict(speculative)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        path = resolve_model_path(model, revision=revision)
        hf_config = load_hf_config(path)
        derived_max_len = getattr(hf_config, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = derived_max_len
        elif max_model_len > derived_max_len:
            raise ValueError(
                f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived_max_len} in the model's "
                "config.json). Lower max_model_len."
            )
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
        if generation_config not in ("auto", "vllm"):
            raise ValueError("generation_config must be 'auto' or 'vllm'.")
        gen_cfg = load_generation_config(path) if generation_config == "auto" else {}
        if max_num_batched_tokens is None:
            max_num_batched_tokens = (
                max(8192, max_num_seqs) if enable_chunked_prefill else max(max_model_len, 8192)
            )
        resolved_dtype = _resolve_dtype(dtype, hf_config, device)
        check_quantization(quantization, resolved_dtype)
        model_config = ModelConfig(
            model=model,
            path=path,
            hf_config=hf_config,
            dtype=resolved_dtype,
            max_model_len=max_model_len,
            load_format=load_format,
            enforce_eager=enforce_eager,
            cudagraph_mode=cudagraph_mode,
            fused_decode=fused_decode,
            generation_config=gen_cfg,
            tokenizer=tokenizer,
            seed=seed,
            quantization=quantization,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_gpu_blocks_override=num_gpu_blocks_override,
            cache_dtype=kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            max_num_queued_reqs=max_num_queued_reqs,
            max_num_queued_tokens=max_num_queued_tokens,
            policy=scheduling_policy,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
            prefill_backlog_steps=prefill_backlog_steps,
            async_scheduling=async_scheduling,
            async_mixed_steps=async_mixed_steps,
            async_sampling=async_sampling,
        )
        return cls(
            model_config, cache_config, scheduler_config, device, structured_outputs, speculative
        )
