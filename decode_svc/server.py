"""The decode service (`tandem decode`).

Lifecycle of one `Generate` stream:
1. Validate (INVALID_ARGUMENT) and admit or refuse fast (RESOURCE_EXHAUSTED: queue limits or
   no free blocks — the gateway then tries another D).
2. Remote prefill (the request names prefill candidates): reserve blocks for the prompt,
   reusing D's own prefix hits, and call `P.Prefill` with the descriptors of the blocks that
   still need KV. P writes them one-sided and replies with the first token once the KV landed;
   its notification carries the per-transfer token. On P failure before WRITTEN the blocks are
   quarantined (see `receiver.py`) and the prompt goes to the next candidate, then local.
3. Local prefill (no candidates, or all failed): the engine prefills the prompt itself.
4. Decode in the continuous batch, streaming `TokenChunk`s (the first carries the prompt
   logprobs when asked, computed here or by P), then a `Final` with usage. A client that goes
   away aborts the request and frees its blocks.

The gateway sends its requests over one `GenerateMux` stream per decode; each runs as the
`Generate` above, in a task of its own (protos/decode_mux.py, which this servicer inherits).

`--kv-role kv_both` (vLLM's name for an instance that both produces and consumes KV): the same
server also answers `tandem.v1.Prefill` with the same engine, so other decodes may prefill here
and this one prefills locally or elsewhere, as the gateway's cost model decides per request. A
pool of such instances can act colocated or disaggregated request by request.
"""

from __future__ import annotations

import argparse
import logging
import time

import grpc

from decode_svc.receiver import KVReceiver
from decode_svc.remote_prefill import RemotePrefill
from engine import internal_auth
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import EngineCore
from engine.metrics import INTER_TOKEN_LATENCY, TIME_TO_FIRST_TOKEN, observe_phases
from engine.request import Request
from engine.scheduler import SchedulerFullError
from engine.service_main import ServiceContext, run_service, service_main, service_parser
from engine.serving import (
    Draining,
    KVPublishing,
    check_prompt,
    load_response,
    logprobs_to_proto,
    sampling_params_from_proto,
)
from kv_transfer import Agent
from prefill_svc.server import SERVICE_NAME as PREFILL_SERVICE_NAME
from prefill_svc.server import PrefillServicer, add_transfer_timeout_arg
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from protos.mux_frames import FramesServer

logger = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Decode"


class DecodeServicer(decode_mux.DecodeServicer, Draining):
    def __init__(
        self,
        engine: AsyncEngine,
        agent: Agent,
        instance_id: str,
        eos_ids: set[int],
        args: argparse.Namespace,
        kv: KVPublishing,
        prefill: PrefillServicer | None = None,
    ):
        self.prefill = prefill  # kv_both: the Prefill service on the same engine
        self.engine = engine
        engine.observe_itl = INTER_TOKEN_LATENCY.observe  # per engine step, see OutputStream
        self.kv = kv
        self.core: EngineCore = engine.core
        self.agent = agent
        self.instance_id = instance_id
        self.eos_ids = frozenset(eos_ids)
        self.receiver = KVReceiver(agent)
        engine.hooks.append(self.receiver.poll)
        self.counters = {
            "num_requests_total": 0,
            "num_local_prefills": 0,
            "num_remote_prefills": 0,
            "kv_transfer_bytes": 0,
        }
        self.remote = RemotePrefill(
            engine,
            agent,
            self.receiver,
            args.prefill_timeout_s,
            args.kv_lease_s,
            self.counters,
            # Registered in Redis: prefill targets come from Redis too, so each must verify.
            require_registration=bool(args.redis_url),
            max_tenant_kv_fraction=args.max_tenant_kv_fraction,
        )

    # ---- Generate ------------------------------------------------------------------------
    async def Generate(self, request, context):
        # In the handler's own body, not a wrapping generator: one hop less per token chunk.
        async with self.admit(context, "decode"):
            try:
                req = self._parse(request)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.counters["num_requests_total"] += 1
            timings = common_pb2.Timings()
            start = time.monotonic()
            stream = None
            num_out = 0
            try:
                if request.prefill:
                    stream = await self.remote.run(req, request, timings)
                if stream is None:
                    timings.local_prefill = True
                    self.counters["num_local_prefills"] += 1
                    stream = self.engine.generate(req)
                async for out in stream:
                    if num_out == 0:
                        now = time.monotonic()
                        timings.prefill_s = now - start
                        TIME_TO_FIRST_TOKEN.observe(now - start)
                        if timings.local_prefill:  # else P sampled it: D's phases race it
                            observe_phases(req, now)
                    num_out += len(out.new_token_ids)
                    # Filled in place: a TokenChunk passed to GenerateResponse() is copied.
                    response = decode_pb2.GenerateResponse()
                    chunk = response.tokens
                    chunk.SetInParent()  # a chunk without tokens (a bare finish) is still one
                    chunk.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs:
                        chunk.logprobs.extend(map(logprobs_to_proto, out.new_logprobs))
                    if out.prompt_logprobs is not None:  # the first output, when requested
                        assert out.prompt_logprobs[0] is None, "nothing predicts prompt token 0"
                        chunk.prompt_logprobs.extend(
                            map(logprobs_to_proto, out.prompt_logprobs[1:])
                        )
                    yield response
                    if out.finish_reason is not None:
                        yield self._final(req, out, num_out, timings)
                        return
            except SchedulerFullError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except EngineDeadError as e:
                if num_out == 0:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                yield decode_pb2.GenerateResponse(
                    error=common_pb2.Error(code=common_pb2.Error.DECODE_FAILED, message=str(e))
                )

    def _final(self, req: Request, out, num_out: int, timings) -> decode_pb2.GenerateResponse:
        final = decode_pb2.Final(
            finish_reason=out.finish_reason,
            usage=common_pb2.Usage(
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=num_out,
                cached_tokens=max(req.num_cached_tokens, 0),
            ),
            timings=timings,
        )
        if isinstance(out.stop_reason, int):
            final.stop_token_id = out.stop_reason
        return decode_pb2.GenerateResponse(final=final)

    def _parse(self, request) -> Request:
        mc = self.core.config.model
        if not request.request_id:
            raise ValueError("request_id is required")
        ids = check_prompt(request.prompt_token_ids, mc.max_model_len, mc.vocab_size)
        if not request.HasField("params"):
            raise ValueError("params are required")
        params = sampling_params_from_proto(request.params)
        for p in request.prefill:
            if not p.address:
                raise ValueError("prefill target without an address")
        return Request(
            request.request_id,
            ids,
            params,
            self.eos_ids,
            cache_salt=request.cache_salt or None,
            priority=request.priority,
        )

    # ---- other RPCs ----------------------------------------------------------------------
    async def Abort(self, request, context):
        found = await self.engine.call(self.core.abort_request, request.request_id)
        return common_pb2.AbortResponse(found=found)

    def metric_counters(self) -> dict[str, float]:
        rejected = {
            "num_rejected_kv_messages": self.agent.num_rejected_messages,
            "num_rejected_mux_messages": self.num_rejected_mux_messages,  # protos/decode_mux.py
            "num_rejected_frame_connections": self.num_rejected_frame_connections,  # mux_frames
        }
        served = {}
        if self.prefill is not None:  # kv_both: what it prefilled for other decodes
            served = {
                "kv_transfer_bytes_sent": self.prefill.sender.total_bytes,
                "prefill_requests": self.prefill.num_requests,
            }
        return {**self.counters, **self.remote.stats, **rejected, **served}

    def start_draining(self) -> None:
        self.close_mux_streams()  # sets `is_draining`, which `admit` reads too
        if self.prefill is not None:
            self.prefill.start_draining()

    async def until_idle(self) -> None:
        await super().until_idle()
        if self.prefill is not None:
            await self.prefill.until_idle()

    async def GetLoad(self, request, context):
        return load_response(
            self.core,
            self.instance_id,
            self.agent.backend_name,
            **self.counters,
            **self.kv.load_fields(),
        )

    async def WatchKVEvents(self, request, context):
        async for batch in self.kv.stream():
            yield batch


def _servicer(ctx: ServiceContext) -> DecodeServicer:
    a = ctx.args
    prefill = None
    if a.kv_role == "kv_both":
        args = (ctx.instance_id, ctx.eos_ids, a.kv_lease_s, a.transfer_timeout_s, ctx.kv)
        prefill = PrefillServicer(ctx.engine, ctx.agent, *args)
    return DecodeServicer(ctx.engine, ctx.agent, ctx.instance_id, ctx.eos_ids, a, ctx.kv, prefill)


def _add_servicers(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    if servicer.prefill is not None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(servicer.prefill, server)


def build_parser():
    parser = service_parser("decode")
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=60.0,
        help="upper bound on waiting for one remote prefill; the actual bound is derived from "
        "its predicted time (see decode_svc/remote_prefill.py)",
    )
    parser.add_argument(
        "--max-tenant-kv-fraction",
        type=float,
        default=0.5,
        help="share of the KV cache one tenant (cache salt) may hold in remote prefills at "
        "once; past it its requests are refused (the gateway tries another decode)",
    )
    parser.add_argument(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="warn when a failed remote prefill's blocks are still quarantined after this long "
        "(they are released only once the prefill acknowledges or is known dead); with "
        "--kv-role kv_both, also: no KV write for another decode is issued after this long",
    )
    parser.add_argument(
        "--kv-role",
        default="kv_consumer",
        choices=["kv_consumer", "kv_both"],
        help="kv_both: also serve prefills for other decodes (tandem.v1.Prefill) on this engine",
    )
    add_transfer_timeout_arg(parser)  # kv_both: its writes into other decodes
    parser.add_argument(
        "--mux-port",
        type=int,
        default=0,
        help="port of the framed GenerateMux transport (protos/mux_frames.py), which gateways "
        "prefer to gRPC for requests (less CPU per request on both sides; same token and mTLS); "
        "advertised on the gRPC stream; 0 picks a free port, -1 turns it off",
    )
    return parser


async def serve(args) -> None:
    role = "both" if args.kv_role == "kv_both" else "decode"
    names = (SERVICE_NAME, PREFILL_SERVICE_NAME) if role == "both" else (SERVICE_NAME,)

    async def start_frames(servicer: DecodeServicer):
        if args.mux_port < 0:
            return None
        frames = FramesServer(servicer, *internal_auth.frames_auth())
        port = await frames.start(args.host, args.mux_port)
        logger.info("Framed GenerateMux on %s:%d", args.host, port)
        return frames.close

    await run_service(args, role, _servicer, _add_servicers, names, start_frames)


def main(argv: list[str] | None = None) -> None:
    service_main(build_parser(), serve, argv)
