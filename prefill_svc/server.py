"""The prefill service (`tandem prefill`).

Lifecycle of one `Prefill` call:
1. Validate (INVALID_ARGUMENT on bad input; the service keeps serving).
2. Connect to the decode agent named in the target (cached by metadata), then add the prompt
   to the engine as a `hold_blocks` request with max_tokens=1: it is chunked and batched with
   other prompts, and hits this instance's own prefix cache.
3. After every engine step the `KVSender` writes newly computed blocks into D's blocks.
4. The first token is sampled; once the last block is written and flushed and the
   notification sent, reply with the token (and the prompt logprobs, when asked). P's blocks
   stay in its prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import EngineCore
from engine.kv_cache_manager import cdiv
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
from prefill_svc.sender import KVSend, KVSender, SendState
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Prefill"
# Aborted transfers are remembered this long (a Prefill call for one still in the network
# arrives within a deadline), and at most this many (oldest dropped first).
_TOMBSTONE_S = 600.0
_MAX_TOMBSTONES = 100_000


class PrefillServicer(prefill_pb2_grpc.PrefillServicer, Draining):
    def __init__(
        self,
        engine: AsyncEngine,
        agent: Agent,
        instance_id: str,
        eos_ids: set[int],
        lease_s: float,
        transfer_timeout_s: float,
        kv: KVPublishing,
    ):
        self.engine = engine
        self.kv = kv
        self.core: EngineCore = engine.core
        self.agent = agent
        self.instance_id = instance_id
        self.eos_ids = frozenset(eos_ids)
        self.lease_s = lease_s
        self.sender = KVSender(self.core, agent, transfer_timeout_s)
        engine.hooks.append(self.sender.poll)
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata it was added with
        self._aborted: dict[str, float] = {}  # transfer id -> tombstone expiry (monotonic)
        self.num_requests = 0

    async def Prefill(self, request, context):
        async with self.admit(context, "prefill"):
            return await self._prefill(request, context)

    async def _prefill(self, request, context):
        received = time.monotonic()
        if request.transfer_id in self._aborted:  # the decode gave up on it before it got here
            await context.abort(grpc.StatusCode.ABORTED, "transfer was aborted by the decode")
        try:
            req, send = self._parse(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.num_requests += 1
        loop = asyncio.get_running_loop()
        send.done, send.loop = loop.create_future(), loop

        def add(r: Request) -> None:
            self._connect(request.target.agent_name, request.target.agent_metadata)
            self.core.add_request(r)
            self.sender.start(send)

        first = None
        compute_s = 0.0
        try:
            async for out in self.engine.generate(req, add=add):
                first = out
                compute_s = time.monotonic() - received
        except SchedulerFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # validation inside the engine
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:  # the process is exiting; the decode tries elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            if first is None or first.finish_reason == "abort":
                self.engine.submit(lambda: self.sender.fail(req.request_id, "cancelled"))
        state, error = await send.done
        if state is not SendState.WRITTEN:
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {error}")
        return prefill_pb2.PrefillResponse(
            first_token_id=first.new_token_ids[0],
            first_logprobs=logprobs_to_proto(first.new_logprobs[0]) if first.new_logprobs else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            kv_transfer_bytes=send.num_bytes,
            kv_transfer_s=time.monotonic() - send.start_time,
            num_descriptors=send.num_descs,
            compute_s=compute_s,
            server_s=time.monotonic() - received,
            # Prompt token 0 has none (nothing predicts it): the list starts at token 1.
            prompt_logprobs=map(logprobs_to_proto, (first.prompt_logprobs or [None])[1:]),
        )

    def _parse(self, request) -> tuple[Request, KVSend]:
        mc = self.core.config.model
        if not request.request_id or not request.transfer_id:
            raise ValueError("request_id and transfer_id are required")
        ids = check_prompt(request.prompt_token_ids, mc.max_model_len, mc.vocab_size)
        if not request.HasField("params"):
            raise ValueError("params are required")
        params = sampling_params_from_proto(request.params)
        # P samples only the first token; min_tokens matters only as "mask EOS now or not".
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        t = request.target
        if not t.agent_name or not t.agent_metadata:
            raise ValueError("target.agent_name and target.agent_metadata are required")
        num_blocks = cdiv(len(ids), self.core.config.cache.block_size)
        if not 0 <= t.first_block < num_blocks:
            raise ValueError(f"target.first_block {t.first_block} out of range [0, {num_blocks})")
        if len(t.block_ids) != num_blocks - t.first_block:
            raise ValueError(
                f"target has {len(t.block_ids)} block ids; the prompt needs "
                f"{num_blocks - t.first_block} after first_block={t.first_block}"
            )
        if any(b <= 0 for b in t.block_ids):
            raise ValueError("target.block_ids must be positive (block 0 is the null block)")
        if t.block_bytes != self.sender.block_bytes:
            raise ValueError(
                f"the decode's KV blocks are {t.block_bytes} bytes, this prefill's "
                f"{self.sender.block_bytes}: prefill and decode must serve the same model with "
                "the same --block-size and --kv-cache-dtype"
            )
        req = Request(
            f"{request.request_id}/{request.transfer_id}",
            ids,
            params,
            self.eos_ids,
            cache_salt=request.cache_salt or None,
            hold_blocks=True,
        )
        send = KVSend(
            request=req,
            transfer_id=request.transfer_id,
            token=t.transfer_token,
            remote=t.agent_name,
            dst_block_ids=list(t.block_ids),
            first_block=t.first_block,
            deadline=time.monotonic() + self.lease_s,
            done=None,
            loop=None,
        )
        return req, send

    def _connect(self, name: str, metadata: bytes) -> None:
        """Engine thread. Descriptors are range-checked against the peer's metadata there."""
        if self._remotes.get(name) != metadata:
            self.agent.add_remote_agent(metadata)
            self._remotes[name] = metadata

    async def Abort(self, request, context):
        """Abort a request's prefills; with a `transfer_id`, also fence that transfer: refuse
        any later `Prefill` for it, and reply only once no WRITE of it is in flight (the decode
        releases the target blocks on this reply)."""
        if request.transfer_id:
            self._aborted[request.transfer_id] = time.monotonic() + _TOMBSTONE_S
            self._expire_tombstones()
        prefix = f"{request.request_id}/{request.transfer_id}" if request.transfer_id else None
        prefix = prefix or request.request_id

        def abort_all() -> tuple[bool, list[asyncio.Future]]:
            found = False
            for rid in [r for r in self.core.scheduler.requests if r.startswith(prefix)]:
                found |= self.core.abort_request(rid)
            self.sender.fail_matching(prefix, "aborted by the decode")
            return found, self.sender.done_futures(prefix)

        found, pending = await self.engine.call(abort_all)
        if pending:
            await asyncio.wait(pending)  # settled: written, or failed with nothing in flight
        return common_pb2.AbortResponse(found=found or bool(pending))

    def _expire_tombstones(self) -> None:
        now = time.monotonic()
        while self._aborted:
            tid, expiry = next(iter(self._aborted.items()))
            if expiry > now and len(self._aborted) <= _MAX_TOMBSTONES:
                break
            del self._aborted[tid]

    def metric_counters(self) -> dict[str, float]:
        return {"kv_transfer_bytes": self.sender.total_bytes, "prefill_requests": self.num_requests}

    async def GetLoad(self, request, context):
        return load_response(
            self.core,
            self.instance_id,
            self.agent.backend_name,
            kv_transfer_bytes=self.sender.total_bytes,
            num_requests_total=self.num_requests,
            **self.kv.load_fields(),
        )

    async def WatchKVEvents(self, request, context):
        async for batch in self.kv.stream():
            yield batch


def _servicer(ctx: ServiceContext) -> PrefillServicer:
    a = ctx.args
    return PrefillServicer(
        ctx.engine,
        ctx.agent,
        ctx.instance_id,
        ctx.eos_ids,
        a.kv_lease_s,
        a.transfer_timeout_s,
        ctx.kv,
    )


def build_parser():
    parser = service_parser("prefill")
    parser.add_argument(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="no KV write is issued after this long since the request arrived",
    )
    add_transfer_timeout_arg(parser)
    return parser


def add_transfer_timeout_arg(parser) -> None:
    """Also a kv_both decode's (decode_svc/server.py): it sends KV as a prefill does."""
    parser.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=30.0,
        help="how long a request's KV writes may stay in flight before they are abandoned",
    )


async def serve(args) -> None:
    await run_service(
        args, "prefill", _servicer, prefill_pb2_grpc.add_PrefillServicer_to_server, SERVICE_NAME
    )


def main(argv: list[str] | None = None) -> None:
    service_main(build_parser(), serve, argv)
