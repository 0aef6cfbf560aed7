"""Start-up shared by `tandem prefill` and `tandem decode`: flags, engine, transfer agent, gRPC
server (internal-token auth, health), Redis registration, Prometheus metrics, the READY line.

Each role supplies only its servicer: `run_service(args, role, make_servicer, add_servicer)`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.internal_auth import server_interceptors
from engine.metrics import start_metrics_server
from engine.registry import add_registry_args
from engine.serving import KVPublishing, add_engine_args, engine_config_from_args, serve_health
from engine.tokenizer import get_eos_token_ids, load_tokenizer
from kv_transfer import Agent

logger = logging.getLogger(__name__)


@dataclass
class ServiceContext:
    """What a role's servicer is built from."""

    args: argparse.Namespace
    engine: AsyncEngine
    agent: Agent
    instance_id: str
    eos_ids: set[int]
    kv: KVPublishing

    @property
    def core(self) -> EngineCore:
        return self.engine.core


def service_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(f"tandem {role}", description=f"Run a {role} service.")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--instance-id", default=None)
    add_registry_args(parser)
    parser.add_argument("--kv-backend", default="ucx", choices=["ucx", "inproc"])
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics on this port (0: any free one); off if unset",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1")
    return parser


def _make_agent(name: str, backend: str, core: EngineCore) -> Agent:
    """Runs on the engine thread, which owns the agent from then on."""
    agent = Agent(name, backend)
    agent.register_memory([core.runner.kv_cache])
    return agent


async def run_service(
    args: argparse.Namespace,
    role: str,
    make_servicer: Callable[[ServiceContext], Any],
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
) -> None:
    config = engine_config_from_args(args)
    engine = AsyncEngine(EngineCore(config))
    instance_id = args.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
    agent = await engine.call(_make_agent, instance_id, args.kv_backend, engine.core)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    eos = get_eos_token_ids(tokenizer, config.model.generation_config)
    kv = KVPublishing(engine, role, instance_id, args.model)
    ctx = ServiceContext(args, engine, agent, instance_id, eos, kv)
    servicer = make_servicer(ctx)
    server = grpc.aio.server(interceptors=server_interceptors())
    add_servicer(servicer, server)
    health_task = await serve_health(server, service_name, engine)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    if args.redis_url:
        address = args.advertise_address or f"{args.host}:{port}"
        await kv.start_redis(args.redis_url, address, args.heartbeat_s)
    if args.metrics_port is not None:
        metrics_port = start_metrics_server(
            engine, servicer, role, instance_id, args.metrics_host, args.metrics_port
        )
        logger.info("Metrics on http://%s:%d/metrics", args.metrics_host, metrics_port)
    logger.info(
        "%s %s serving on %s:%d (kv backend %s)",
        role.capitalize(),
        instance_id,
        args.host,
        port,
        args.kv_backend,
    )
    print(f"READY {role} {args.host}:{port}", flush=True)
    try:
        await server.wait_for_termination()
    finally:
        health_task.cancel()
        kv.stop()
        engine.shutdown()


def service_main(parser: argparse.ArgumentParser, serve, argv: list[str] | None) -> None:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The engine thread and the gRPC event loop share the GIL; hand it over every 0.5 ms, not
    # every 5 ms, so a reply or a KV notification never waits behind a busy engine loop.
    sys.setswitchinterval(0.0005)
    asyncio.run(serve(args))
