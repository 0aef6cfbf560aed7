"""What the prefill and decode services share: engine arguments, proto conversion, health,
KV events and registration (`KVPublishing`).

Health is two things (gRPC health protocol): liveness is the empty service name (the process
answers); readiness is the service's own name and also requires the engine loop to be alive
and to have iterated within `READY_STALL_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.config import (
    CUDAGRAPH_MODES,
    EngineConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from engine.engine_core import EngineCore
from engine.kv_events import EventBatch, KVEventSource, LoadSnapshot
from engine.params_proto import (  # noqa: F401  (re-exported for the services)
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from engine.quantization import QUANTIZATION_METHODS
from engine.registry import InstanceRecord, RedisPublisher, new_epoch
from protos import common_pb2

logger = logging.getLogger(__name__)

READY_STALL_S = 30.0
MAX_PROMPT_TOKENS_HARD_CAP = 1 << 20  # reject absurd token lists before touching them
# A served engine's prompt tokens in a step that also decodes, and the backlog rule with it:
# measured on an H100 (Qwen3-8B, 512 in / 128 out, bench/README.md, 2026-12-07) at 64 streams
# ITL p99 2.3x its p50 (uncapped 8,192-token steps: 12x and more), at 256 streams 0.96 of the
# offline engine's output rate (the backlog steps scaled by the free slots; 0.92 unscaled). The
# offline `LLM` keeps whole-budget steps (EngineConfig's 0): nobody waits for its tokens.
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING = 512
DEFAULT_PREFILL_BACKLOG_STEPS = 32


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every flag's default: appended unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "(default" in help_text:
            return help_text
        return super()._get_help_string(action) or ""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, with the same names and meanings."""
    parser.add_argument(
        "model",
        nargs="?",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="local Hugging Face folder or hub id",
    )
    parser.add_argument("--dtype", default="auto", help="weight and activation dtype")
    parser.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda if present)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length, prompt + output (None: the model config's)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV cache",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (on CPU; None: sized automatically)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (FP8 e4m3, scale "
        "1.0, as vLLM without calibrated scales: twice the tokens in the same memory); "
        "prefills and decodes that exchange KV must use the same",
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="number of KV-cache blocks, overriding profiling",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (None: max(8192, --max-num-seqs))",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="most prompt tokens of one request per step (vLLM's name; 0: no cap): spreads a "
        "long prompt over steps so the decodes batched with it keep their pace",
    )
    parser.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
        help="most prompt tokens (all requests together) in a step that also decodes: bounds "
        "the inter-token latency at a decode step plus this many prefill tokens (default "
        f"{DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING}, sized for online serving; 0: the whole "
        "--max-num-batched-tokens, as the offline engine)",
    )
    parser.add_argument(
        "--prefill-backlog-steps",
        type=int,
        default=None,
        help="with --max-prefill-tokens-while-decoding: raise that cap to 1/N of the prompt "
        "tokens that could start now (running requests' and those of the waiting ones the free "
        "--max-num-seqs slots admit; up to --max-num-batched-tokens), so that a backlog clears "
        "in about N steps, N scaled by the free fraction of the slots (at least 1) "
        f"(default {DEFAULT_PREFILL_BACKLOG_STEPS} with a cap, 0 without); 0 "
        "keeps the cap fixed (throughput then stays at the rate it admits prompts)",
    )
    parser.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="queued requests past which new ones are refused (None: no limit)",
    )
    parser.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        help="queued tokens past which new requests are refused (None: no limit)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs: arrival order; priority: by the requests' `priority` (lower first, then "
        "arrival), preempting the least important. Under fcfs a non-zero priority is a 400.",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn off prefix caching (default: on)",
    )
    parser.add_argument(
        "--load-format", default="auto", help="auto, or dummy (random weights, for benchmarks)"
    )
    parser.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="fp8: the decoder's linear layers in FP8 e4m3 (per-channel weight and per-token "
        "activation scales), quantized from the 16-bit checkpoint at load (default: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (default: graphs on CUDA)"
    )
    parser.add_argument(
        "--compilation-config.cudagraph_mode",
        dest="cudagraph_mode",
        choices=CUDAGRAPH_MODES,
        default="FULL_AND_PIECEWISE",
        help="CUDA graphs, as vLLM's compilation config spells them: whole-model graphs for "
        "decode-only steps, plus piecewise graphs (all but attention) for steps with prompt "
        "tokens (FULL_AND_PIECEWISE, default), or decode graphs only (FULL_DECODE_ONLY)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap scheduling with the GPU in steady greedy decode (default: with graphs)",
    )
    parser.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fewer kernels per small-batch decode step: batch-1 projections on GEMV kernels "
        "with the RMSNorm / SiLU-mul folded in where a start-up timing finds them faster than "
        "cuBLAS (default: on; --no-fused-decode keeps cuBLAS and the separate kernels)",
    )
    parser.add_argument(
        "--async-mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with async scheduling, also launch steps with prompt chunks ahead (greedy rows "
        "without prompt logprobs), admitting requests while a step runs (default: on)",
    )
    parser.add_argument(
        "--async-sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with async scheduling, also launch steps whose rows sample at random "
        "(temperature, top-p/top-k/min-p, seeds; no penalties, logit bias or logprobs) ahead; "
        "seeded rows draw the synchronous engine's tokens (default: on)",
    )
    parser.add_argument(
        "--structured-outputs-config.backend",
        dest="structured_outputs_backend",
        type=_structured_outputs_backend,
        default="auto",
        help="structured outputs (JSON schema, regex, choice, grammar): auto (= xgrammar) or "
        "xgrammar; vLLM's guidance, outlines and lm-format-enforcer are not available",
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help="speculative decoding, as vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' (n-gram prompt lookup is the one method; turns async '
        "scheduling off; default: off)",
    )


def _structured_outputs_backend(value: str) -> str:
    """argparse check: a vLLM-only backend fails at parse time, with the config's message."""
    try:
        StructuredOutputsConfig(backend=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _speculative_config(value: str) -> SpeculativeConfig:
    """argparse check: bad JSON or a bad field fails at parse time, naming the field."""
    try:
        return SpeculativeConfig.from_dict(json.loads(value))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"--speculative-config is not valid JSON ({e}); pass an object such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\''
        ) from None
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prefill_backlog_steps(args: argparse.Namespace) -> int:
    """--prefill-backlog-steps, its default following the cap's: with no cap there is nothing
    to raise (an explicit N without a cap is EngineConfig's error, which says so)."""
    if args.prefill_backlog_steps is not None:
        return args.prefill_backlog_steps
    return DEFAULT_PREFILL_BACKLOG_STEPS if args.max_prefill_tokens_while_decoding else 0


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_args(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        prefill_backlog_steps=prefill_backlog_steps(args),
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        load_format=args.load_format,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        fused_decode=args.fused_decode,
        cudagraph_mode=getattr(args, "cudagraph_mode", "FULL_AND_PIECEWISE"),
        async_scheduling=args.async_scheduling,
        async_mixed_steps=args.async_mixed_steps,
        async_sampling=args.async_sampling,
        structured_outputs_config=StructuredOutputsConfig(
            backend=getattr(args, "structured_outputs_backend", "auto")
        ),
        quantization=getattr(args, "quantization", None),
        speculative_config=getattr(args, "speculative_config", None),
    )


# ---- protos <-> engine ---------------------------------------------------------------------
def check_prompt(token_ids, max_model_len: int, vocab_size: int) -> list[int]:
    """Validate a token list from the wire; raises ValueError with the limit."""
    if len(token_ids) > MAX_PROMPT_TOKENS_HARD_CAP:
        raise ValueError(f"prompt of {len(token_ids)} tokens exceeds the hard cap")
    ids = list(token_ids)
    if not ids:
        raise ValueError("The decoder prompt cannot be empty.")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
            f"of {max_model_len}."
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"Token id {bad} is out of vocabulary (vocab_size={vocab_size}).")
    return ids


def load_response(core: EngineCore, instance_id: str, kv_backend: str, **extra):
    stats = core.stats()
    return common_pb2.LoadResponse(
        instance_id=instance_id,
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_free_blocks=stats.num_free_blocks,
        kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        kv_backend=kv_backend,
        block_size=core.config.cache.block_size,
        max_model_len=core.config.model.max_model_len,
        num_idle_free_blocks=core.kv.pool.num_usable_blocks,
        **extra,
    )


# ---- KV events and registration ------------------------------------------------------------
_EVENT_KINDS = {
    "stored": common_pb2.KVEvent.STORED,
    "removed": common_pb2.KVEvent.REMOVED,
    "cleared": common_pb2.KVEvent.CLEARED,
}


class KVPublishing:
    """One service's KV events and load: the engine hook, the `WatchKVEvents` streams (the
    gateway's embedded index) and, with `--redis-url`, the Redis heartbeat and publisher."""

    def __init__(self, engine: AsyncEngine, role: str, instance_id: str, model: str):
        core = engine.core
        self.role, self.instance_id, self.model = role, instance_id, model
        self.epoch = new_epoch()
        self.block_size = core.config.cache.block_size
        self.kv_bytes_per_block = core.config.kv_bytes_per_token() * self.block_size
        self.max_num_batched_tokens = core.config.scheduler.max_num_batched_tokens
        self.source = KVEventSource(core, measure_prefill="busy" if role == "prefill" else "mixed")
        engine.hooks.append(self.source.poll)
        self.publisher: RedisPublisher | None = None
        self._streams: set[asyncio.Queue] = set()  # open WatchKVEvents streams
        self._is_closing = False

    def load_fields(self) -> dict:
        """`LoadResponse` fields only this object knows (for `GetLoad`)."""
        load = self.source.latest_load
        return dict(
            epoch=self.epoch,
            kv_bytes_per_block=self.kv_bytes_per_block,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_pending_prefill_tokens=load.num_pending_prefill_tokens if load else 0,
            prefill_tokens_per_s=load.prefill_tokens_per_s if load else 0.0,
        )

    async def start_redis(self, url: str, address: str, heartbeat_s: float) -> None:
        """Register and publish; READY waits for the first registration (when Redis is up) so
        that a gateway sees a service as soon as its launcher does."""
        record = InstanceRecord(
            self.instance_id,
            self.role,
            address,
            self.model,
            self.block_size,
            self.epoch,
            self.kv_bytes_per_block,
            self.max_num_batched_tokens,
        )
        self.publisher = RedisPublisher(url, self.source, record, heartbeat_s)
        self.publisher.start()
        if not await asyncio.to_thread(self.publisher.wait_registered, 3.0):
            logger.warning("not registered in Redis at %s yet; serving anyway", url)

    def stop(self) -> None:
        """Leave the Redis pool at once (not after the TTL)."""
        if self.publisher is not None:
            self.publisher.stop()
            self.publisher = None

    def close_streams(self) -> None:
        """End every `WatchKVEvents` stream (a draining server waits for open RPCs)."""
        self._is_closing = True
        for q in self._streams:
            q.put_nowait(None)

    async def stream(self) -> AsyncIterator[common_pb2.KVEventBatch]:
        """`WatchKVEvents`: a reset first, then diffs, until the client goes away or the
        service drains."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[EventBatch | None] = asyncio.Queue()
        if self._is_closing:
            return

        def deliver(batch: EventBatch) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(q.put_nowait, batch)
            except RuntimeError:  # the event loop closed (shutdown)
                pass

        sub = self.source.subscribe(deliver)
        self._streams.add(q)
        try:
            while (batch := await q.get()) is not None:
                yield self._to_proto(batch)
        finally:
            self._streams.discard(q)
            self.source.unsubscribe(sub)

    def _to_proto(self, batch: EventBatch) -> common_pb2.KVEventBatch:
        return common_pb2.KVEventBatch(
            instance_id=self.instance_id,
            epoch=self.epoch,
            reset=batch.reset,
            events=[
                common_pb2.KVEvent(kind=_EVENT_KINDS[e.kind], block_hashes=e.block_hashes)
                for e in batch.events
            ],
            load=self.load_to_proto(batch.load),
        )

    def load_to_proto(self, load: LoadSnapshot) -> common_pb2.LoadResponse:
        return common_pb2.LoadResponse(
            instance_id=self.instance_id,
            epoch=self.epoch,
            block_size=self.block_size,
            kv_bytes_per_block=self.kv_bytes_per_block,
            max_num_batched_tokens=self.max_num_batched_tokens,
            **asdict(load),
        )


# ---- drain ---------------------------------------------------------------------------------
class Draining:
    """A servicer's side of a drain (engine/service_main.py `_drain`). After `start_draining`
    its handlers refuse new work with UNAVAILABLE (`admit`: the gateway or decode tries another
    instance) while the server still listens, and `until_idle` waits for the work admitted
    before. Only then does the server stop: a call that reaches a stopping server is reset
    (the client sees CANCELLED, which nothing retries), so the listening window must be ours."""

    is_draining = False
    _num_in_flight = 0
    _idle: asyncio.Event | None = None

    def start_draining(self) -> None:
        self.is_draining = True

    @contextlib.asynccontextmanager
    async def admit(self, context, role: str):
        """Around one handler: refuses it while draining, else counts it as in flight."""
        if self.is_draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the {role} is draining; send it to another instance"
            )
        self._num_in_flight += 1
        try:
            yield
        finally:
            self._num_in_flight -= 1
            if self._num_in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def until_idle(self) -> None:
        """Returns once no handler admitted before the drain is running."""
        while self._num_in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()


# ---- health --------------------------------------------------------------------------------
class Health:
    """gRPC health of one service (`serve_health`): liveness is the empty name, readiness the
    service's own. `task` keeps readiness in step with the engine loop; `drain` turns
    readiness off for good while liveness stays on (the process is finishing its work)."""

    def __init__(
        self, servicer: health.aio.HealthServicer, service_names: tuple[str, ...], task=None
    ):
        self.servicer, self.service_names = servicer, service_names
        self.task: asyncio.Task = task
        self.is_draining = False

    async def set_all(self, status) -> None:
        for name in self.service_names:
            await self.servicer.set(name, status)

    async def drain(self) -> None:
        self.is_draining = True
        await self.set_all(health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve_health(
    server: grpc.aio.Server, service_names: str | tuple[str, ...], engine: AsyncEngine
) -> Health:
    """Register gRPC health for the services this server runs (a kv_both decode runs two); a
    task keeps their readiness in step with the engine loop.

    When the loop dies, the task puts every service, the overall "" included, in NOT_SERVING for
    good (the process is about to exit non-zero) and ends."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    await servicer.set("", serving)
    loop = asyncio.get_running_loop()
    died = asyncio.Event()
    engine.on_death.append(lambda exc: _set_threadsafe(loop, died))
    names = (service_names,) if isinstance(service_names, str) else service_names
    state = Health(servicer, names)

    async def watch() -> None:
        while engine.is_alive:
            ok = time.monotonic() - engine.last_step_time < READY_STALL_S
            if not state.is_draining:
                await state.set_all(serving if ok else not_serving)
            with contextlib.suppress(TimeoutError):  # a death wakes us at once
                await asyncio.wait_for(died.wait(), 0.5)
        logger.error("engine loop is not running: health NOT_SERVING (%r)", engine.error)
        await state.set_all(not_serving)
        await servicer.enter_graceful_shutdown()  # "" too; later `set`s are ignored

    state.task = asyncio.create_task(watch())
    return state


def _set_threadsafe(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    try:
        loop.call_soon_threadsafe(event.set)
    except RuntimeError:  # the event loop already closed: nobody watches health any more
        logger.debug("event loop closed; health watcher not woken")
