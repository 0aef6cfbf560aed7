"""Start-up shared by `tandem prefill` and `tandem decode`: flags, engine, transfer agent, gRPC
server (internal-token auth, health), Redis registration, Prometheus metrics, the READY line.

Each role supplies only its servicer: `run_service(args, role, make_servicer, add_servicer)`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from engine import internal_auth
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_core import EngineCore
from engine.metrics import start_metrics_server
from engine.registry import add_registry_args, resolve_redis_url
from engine.serving import (
    Draining,
    Health,
    HelpFormatter,
    KVPublishing,
    add_engine_args,
    engine_config_from_args,
    serve_health,
)
from engine.stack_sampler import StackSampler
from engine.step_trace import StepTrace
from engine.tokenizer import get_eos_token_ids, load_tokenizer
from kv_transfer import Agent

logger = logging.getLogger(__name__)
DEATH_GRACE_S = 2.0  # after the engine loop died: for streams to send their error
EXIT_ENGINE_DEAD = 3  # the engine loop died (the supervisor restarts the process)
ENV_KV_INTERFACE = "TANDEM_KV_INTERFACE"
_MAX_GPUS = 64


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
    parser = argparse.ArgumentParser(
        f"tandem {role}", description=f"Run a {role} service.", formatter_class=HelpFormatter
    )
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free port")
    parser.add_argument(
        "--instance-id", default=None, help="name in the registry (None: ROLE-<random hex>)"
    )
    add_registry_args(parser)
    parser.add_argument(
        "--kv-backend",
        default="ucx",
        choices=["ucx", "inproc"],
        help="KV transfer backend (inproc: one process, tests only)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics on this port (0: any free one); off if unset",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="Prometheus bind address")
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM: seconds to finish held work (streams, prefills, transfers) before "
        "cancelling it; size terminationGracePeriodSeconds above it",
    )
    parser.add_argument(
        "--kv-interface",
        default=os.environ.get(ENV_KV_INTERFACE) or None,
        metavar="IFACE",
        help="network interface(s) UCX uses and listens on for KV transfers, e.g. eth1 or "
        f"mlx5_0:1 (default: ${ENV_KV_INTERFACE}; else lo when --host is loopback, else all)",
    )
    internal_auth.add_internal_auth_args(parser)
    return parser


def kv_net_devices(host: str, kv_interface: str | None) -> str | None:
    """UCX_NET_DEVICES of this service's transfer agent (None: every device). Shared memory
    is no network device: one-host transfers keep cma/posix/sysv whatever this says."""
    if kv_interface:
        known = [name for _, name in socket.if_nameindex()]
        # `dev:port` names are RDMA devices, not interfaces; UCX itself checks those.
        for name in kv_interface.split(","):
            if ":" not in name and name not in known:
                raise ValueError(
                    f"--kv-interface {kv_interface}: this host has no network interface "
                    f"{name!r} (it has {', '.join(known)}); name the data-plane interface"
                )
        return kv_interface
    if _is_loopback(host):
        return "lo"
    logger.warning(
        "UCX listens for KV transfers on every network interface (--host %s is not loopback); "
        "pass --kv-interface IFACE (or set %s) to keep KV traffic on the data-plane network",
        host,
        ENV_KV_INTERFACE,
    )
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return False


def _make_agent(name: str, backend: str, net_devices: str | None, core: EngineCore) -> Agent:
    """Runs on the engine thread, which owns the agent from then on."""
    agent = Agent(name, backend, net_devices=net_devices)
    agent.register_memory([core.runner.kv_cache])
    return agent


async def run_service(
    args: argparse.Namespace,
    role: str,
    make_servicer: Callable[[ServiceContext], Any],
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    service_name: str | tuple[str, ...],
    start_listeners: Callable[[Any], Awaitable[Callable[[], None] | None]] | None = None,
) -> None:
    """Serve `role` until a drain, the engine's death or the server's end. `start_listeners`
    (the decode's framed transport) starts what else the servicer listens on, before the gRPC
    server starts; it returns what closes them as the service stops."""
    config = engine_config_from_args(args)
    core = EngineCore(config)
    # Diagnosis, off by default: every engine step's timing, written as the service stops.
    trace_dir = os.environ.get("TANDEM_STEP_TRACE_DIR")
    trace = StepTrace(core).install() if trace_dir else None
    sample_dir = os.environ.get("TANDEM_STACK_SAMPLE_DIR")
    sampler = StackSampler().start() if sample_dir else None
    engine = AsyncEngine(core)
    instance_id = args.instance_id or f"{role}-{uuid.uuid4().hex[:8]}"
    agent = await engine.call(
        _make_agent, instance_id, args.kv_backend, args.kv_net_devices, engine.core
    )
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.path)
    eos = get_eos_token_ids(tokenizer, config.model.generation_config)
    kv = KVPublishing(engine, role, instance_id, args.model)
    ctx = ServiceContext(args, engine, agent, instance_id, eos, kv)
    servicer = make_servicer(ctx)
    server = grpc.aio.server(interceptors=internal_auth.server_interceptors())
    add_servicer(servicer, server)
    health = await serve_health(server, service_name, engine)
    drain = _drain_on_signals()
    port = internal_auth.add_port(server, f"{args.host}:{args.port}")
    close_listeners = await start_listeners(servicer) if start_listeners else None
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
    # Everything made so far (the model, torch, grpc, protobuf) lives as long as the process:
    # out of the cyclic GC's reach, so that the collections the streams' garbage triggers stop
    # scanning it (a fifth of the engine thread's GIL time under 256 streams on CPU).
    gc.collect()
    gc.freeze()
    print(f"READY {role} {args.host}:{port}", flush=True)
    try:
        outcome = await _serve_until(server, engine, drain)
        if trace is not None:  # now: a stop's grace period may end in SIGKILL before the drain's
            trace.write(Path(trace_dir) / f"{instance_id}.json")
        if sampler is not None:
            sampler.write(Path(sample_dir) / f"{instance_id}-stacks.json")
        if outcome == "died":
            await _die(server, engine, health.task, kv)
        elif outcome == "drain":
            await _drain(server, servicer, health, kv, args.drain_timeout_s)
    finally:
        health.task.cancel()
        if close_listeners is not None:
            close_listeners()
        kv.stop()
        engine.shutdown()
        if trace is not None:  # again, whole
            trace.write(Path(trace_dir) / f"{instance_id}.json")
            logger.info("Step trace written to %s/%s.json", trace_dir, instance_id)
        if sampler is not None:
            sampler.stop()
            sampler.write(Path(sample_dir) / f"{instance_id}-stacks.json")
            logger.info("Stack samples written to %s/%s-stacks.json", sample_dir, instance_id)


# A signal to a whole process group (Ctrl-C in a terminal, systemd's stop) reaches a service
# together with the SIGTERM `tandem serve` forwards to it: one stop, not "again".
SAME_STOP_S = 2.0


def _drain_on_signals() -> asyncio.Event:
    """SIGTERM / SIGINT start a drain; another one more than `SAME_STOP_S` later kills the
    process (the default action); one sooner is the same stop, arriving twice."""
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    first: list[float] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if not first:
            first.append(time.monotonic())
            logger.info("%s: draining; send it again to stop at once", name)
            drain.set()
            return
        if time.monotonic() - first[0] < SAME_STOP_S:
            logger.info("%s: already draining (it came with the first signal)", name)
            return
        logger.warning("%s again: stopping at once, without draining", name)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # the default action: the process ends here

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return drain


async def _serve_until(server: grpc.aio.Server, engine: AsyncEngine, drain: asyncio.Event) -> str:
    """Serve until the server terminates ("terminated"), the engine loop dies ("died") or a
    signal asks for a drain ("drain")."""
    loop = asyncio.get_running_loop()
    died = asyncio.Event()
    engine.on_death.append(lambda exc: loop.call_soon_threadsafe(died.set))
    if engine.error is not None:  # died before the callback was in place
        died.set()
    # Not cancelled: that would cancel the server's own shutdown future, and `server.stop`
    # would then raise CancelledError. It ends with the server.
    terminated = asyncio.ensure_future(server.wait_for_termination())
    waits = [asyncio.ensure_future(died.wait()), asyncio.ensure_future(drain.wait())]
    try:
        await asyncio.wait([terminated, *waits], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if died.is_set():
        return "died"
    return "drain" if drain.is_set() else "terminated"


async def _drain(
    server: grpc.aio.Server, servicer: Draining, health: Health, kv: KVPublishing, grace_s: float
) -> None:
    """Scale-in / rolling restart: refuse new work (UNAVAILABLE: the gateway and decodes try
    another instance; a decode's GenerateMux streams refuse new requests the same way and end
    once theirs have), turn unready (readiness probes and routers stop sending), leave the
    Redis pool, and let the work in flight finish (D: its streams; P: its prefills and their KV
    writes) for up to `grace_s` while the server still listens, so that late callers get that
    clean UNAVAILABLE (`Draining`); then stop the server and return, so that the process
    exits 0."""
    started = time.monotonic()
    servicer.start_draining()
    await health.drain()
    await asyncio.to_thread(kv.stop)
    kv.close_streams()
    try:
        await asyncio.wait_for(servicer.until_idle(), grace_s)
    except TimeoutError:
        logger.warning("drain: work still in flight after %.1f s; stopping anyway", grace_s)
    await server.stop(max(0.0, grace_s - (time.monotonic() - started)))
    logger.info("drained in %.1f s; exiting", time.monotonic() - started)


async def _die(
    server: grpc.aio.Server, engine: AsyncEngine, health_task: asyncio.Task, kv: KVPublishing
) -> None:
    """The engine loop died: every open stream already got `EngineDeadError`. Be unhealthy
    everywhere (gRPC health, Redis), give those streams `DEATH_GRACE_S` to send their error,
    then raise `EngineDeadError` so that the process exits non-zero and gets restarted."""
    try:
        await asyncio.wait_for(health_task, DEATH_GRACE_S)  # it ends once NOT_SERVING is set
    except TimeoutError:
        logger.error("health did not turn NOT_SERVING within %.1f s", DEATH_GRACE_S)
    await asyncio.to_thread(kv.stop)  # no more heartbeats; leave the Redis pool now
    await server.stop(DEATH_GRACE_S)
    raise EngineDeadError(f"engine loop died: {engine.error!r}") from engine.error


def pin_gpu(device: str) -> str:
    """`--device cuda:N` → this process's first CUDA device is GPU N, and "cuda" is returned.

    Why reorder CUDA_VISIBLE_DEVICES instead of hiding the other GPUs: UCX's cuda_ipc transport
    opens a peer's KV memory through its device, which must stay visible (a prefill on GPU 0
    writing into a decode on GPU 1). Runs before anything initializes CUDA in this process.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index:
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Unset: every GPU, listed without counting them (counting would initialize CUDA); CUDA
    # stops at the first index that does not exist, so the surplus is ignored.
    order = visible.split(",") if visible else [str(i) for i in range(_MAX_GPUS)]
    if not index.isdigit() or int(index) >= len(order):
        raise ValueError(f"--device {device}: no such GPU (CUDA_VISIBLE_DEVICES={visible})")
    first = order[int(index)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join([first, *(d for d in order if d != first)])
    return "cuda"


def service_main(parser: argparse.ArgumentParser, serve, argv: list[str] | None) -> None:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Before any model loads: a misconfigured service stops here with one line saying why.
    try:
        internal_auth.check_startup(args.insecure_internal)
        args.redis_url = resolve_redis_url(args.redis_url)
        args.kv_net_devices = kv_net_devices(args.host, args.kv_interface)
        args.device = pin_gpu(args.device)
    except ValueError as e:
        raise SystemExit(f"{parser.prog}: {e}") from None
    # The engine thread and the gRPC event loop share the GIL; hand it over every 0.5 ms, not
    # every 5 ms, so a reply or a KV notification never waits behind a busy engine loop.
    sys.setswitchinterval(0.0005)
    try:
        asyncio.run(serve(args))
    except EngineDeadError as e:  # the loop's traceback is logged already
        logger.critical("exiting with code %d: %s", EXIT_ENGINE_DEAD, e)
        sys.exit(EXIT_ENGINE_DEAD)
