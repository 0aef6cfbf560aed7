"""`tandem gateway` / `python -m gateway`: parse flags, build the app, run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from engine import internal_auth
from engine.lifeline import die_with_parent
from engine.ports import bind_error
from engine.registry import resolve_redis_url
from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.chat_output import load_parsers
from gateway.config import GatewaySettings
from gateway.reasoning import REASONING_PARSERS
from gateway.tool_parsers import TOOL_PARSERS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    # No abbreviations: `--api-keys KEY` must not be taken for `--api-keys-file`.
    p = argparse.ArgumentParser(prog="tandem gateway", description=__doc__, allow_abbrev=False)
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--model", help="model folder or hub id (tokenizer and configs are read)")
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients may use (vLLM: nargs+)")
    p.add_argument("--max-model-len", type=int, help="default: the model's context length")
    p.add_argument("--decode", help="decode instances, host:port,...")
    p.add_argument("--prefill", help="prefill instances, host:port,... (none: local prefill)")
    p.add_argument(
        "--redis-url",
        help="quotas, registry, index; no password here (default: $TANDEM_REDIS_URL, or the file "
        "named by $TANDEM_REDIS_URL_FILE)",
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default off; 0: any)")
    p.add_argument("--metrics-host", help="Prometheus bind address (default 127.0.0.1)")
    # Keys themselves are never flags (argv is visible to every user): TANDEM_API_KEYS.
    p.add_argument("--api-keys-file", help="key file (default: $TANDEM_API_KEYS_FILE)")
    p.add_argument("--router", choices=["kv", "round_robin"], help="routing policy (default kv)")
    p.add_argument(
        "--prefill-policy",
        choices=["auto", "remote"],
        help="auto: the cost model prefills locally on D when a remote prefill does not pay; "
        "remote: always on a prefill instance while one is healthy (default auto)",
    )
    p.add_argument(
        "--route-log",
        help="append one JSON line per request: route, reason, predicted and measured TTFT",
    )
    p.add_argument(
        "--enable-tokenizer-endpoints",
        action="store_true",
        default=None,
        help="serve vLLM's POST /tokenize and /detokenize (default off)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        default=None,
        help="let requests pass their own chat_template (vLLM's flag; default: refused)",
    )
    add_tool_and_reasoning_args(p)
    add_capacity_args(p)
    p.add_argument("--log-level", default="info")
    internal_auth.add_internal_auth_args(p)  # the token and TLS files: environment only
    return p.parse_args(argv)


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    """Worker processes and load shedding (gateway/workers.py, gateway/shedding.py)."""
    p.add_argument(
        "--workers",
        "--api-server-count",  # vLLM's name
        dest="workers",
        type=int,
        default=1,
        help="gateway processes behind the one port (vLLM: --api-server-count; default 1). "
        "More than 1 needs --redis-url: the workers share quotas, registry and index there",
    )
    p.add_argument(
        "--shed-busy-fraction",
        type=float,
        help="load shedding: a process admits fewer requests at once (the rest get 503 + "
        "Retry-After) while its event loop is busy, running or waiting for a CPU, more than "
        "this share of the time (default 0.9; 0: off)",
    )
    p.add_argument(
        "--max-inflight-requests",
        type=int,
        help="load shedding: at most this many requests in flight per process, streams "
        "included; more get 503 + Retry-After (default 0: no fixed cap)",
    )
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by --workers


def add_tool_and_reasoning_args(p: argparse.ArgumentParser) -> None:
    """vLLM's tool calling and reasoning flags (`tandem serve` passes them on)."""
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='allow tool_choice "auto": the model decides to call tools, read from its text '
        "by --tool-call-parser (default off)",
    )
    p.add_argument(
        "--tool-call-parser",
        help=f"how tool calls are read from the model's text: {', '.join(TOOL_PARSERS)} "
        "(default: none)",
    )
    p.add_argument(
        "--reasoning-parser",
        help="split <think> reasoning into reasoning_content: "
        f"{', '.join(REASONING_PARSERS)} (default: none)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        default=None,
        help='leave tools out of the prompt when tool_choice is "none" (default: rendered)',
    )


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Flags given on the command line win; the rest come from TANDEM_GATEWAY_* or defaults."""
    names = (
        *("host", "port", "model", "served_model_name", "max_model_len", "decode", "prefill"),
        *("redis_url", "metrics_port", "metrics_host", "api_keys_file"),
        *("router", "enable_tokenizer_endpoints", "trust_request_chat_template"),
        *("prefill_policy", "route_log"),
        *("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"),
        "exclude_tools_when_tool_choice_none",
        *("shed_busy_fraction", "max_inflight_requests"),
    )
    explicit = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if "served_model_name" in explicit:  # `--served-model-name a b` or `a,b`
        explicit["served_model_name"] = ",".join(explicit["served_model_name"])
    return GatewaySettings(**explicit)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    is_worker = args.worker_index is not None
    who = f"[worker {args.worker_index}] " if is_worker else ""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s",
    )
    if args.workers < 1:
        raise SystemExit(f"tandem gateway: --workers {args.workers}: at least 1")
    try:  # before the tokenizer loads: a gateway that must not start stops at once
        internal_auth.check_startup(args.insecure_internal)
    except internal_auth.InternalAuthError as e:
        raise SystemExit(f"tandem gateway: {e}") from None
    try:  # --redis-url without a password; else TANDEM_REDIS_URL or TANDEM_REDIS_URL_FILE
        args.redis_url = resolve_redis_url(args.redis_url)
    except ValueError as e:
        raise SystemExit(f"tandem gateway: {e}") from None
    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        raise SystemExit(f"tandem gateway: invalid settings:\n{e}") from None
    if args.workers > 1 and not settings.redis_url:
        raise SystemExit(
            f"tandem gateway: --workers {args.workers} needs --redis-url (or $TANDEM_REDIS_URL, "
            "$TANDEM_REDIS_URL_FILE): the workers must share API-key quotas, the instance "
            "registry and the block index, which only Redis can hold for several processes"
        )
    # A taken port: one line, before loading (a worker's port is its parent's, already bound).
    error = None if is_worker else bind_error(settings.host, settings.port)
    if error is not None:
        raise SystemExit(f"tandem gateway: {error}")
    try:  # keys before the tokenizer loads: a misconfigured gateway stops at once
        KeyStore.from_settings(settings)
    except ValueError as e:  # key file errors name lines, never keys
        raise SystemExit(f"tandem gateway: {e}") from None
    if args.workers > 1 and not is_worker:  # the parent: no app, N workers
        from gateway.workers import run_parent

        raise SystemExit(run_parent(sys.argv[1:] if argv is None else argv, settings, args.workers))
    try:
        app = create_app(settings)
    except ValueError as e:  # key file errors name lines, never keys
        raise SystemExit(f"tandem gateway: {e}") from None
    try:  # a parser whose tokens this tokenizer lacks would fail every request
        load_parsers(
            settings.tool_call_parser, settings.reasoning_parser, app.state.gateway.model.tokenizer
        )
    except ValueError as e:
        raise SystemExit(f"tandem gateway: {e}") from None
    # Everything loaded so far (transformers, the tokenizer, ...) lives as long as the process:
    # move it out of the cyclic GC's reach, so full collections stop scanning ~10^6 objects
    # (pauses that showed up as p99 latency).
    gc.collect()
    gc.freeze()
    # uvicorn's access log would duplicate ours (and log query strings).
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, access_log=False, log_level=args.log_level
    )
    if not is_worker:
        _run(_serve(uvicorn.Server(config)))
        return
    from gateway.workers import READY_PREFIX, reuseport_socket

    sock = reuseport_socket(settings.host, settings.port)  # uvicorn listens on it

    def ready_line(address: str) -> str:
        metrics = app.state.gateway.edge.metrics_address
        return f"{READY_PREFIX}{address} {f'{metrics[0]}:{metrics[1]}' if metrics else '-'}"

    _run(_serve(uvicorn.Server(config), [sock], ready_line))


def _run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop when it is installed (a cheaper loop: less CPU per request), else asyncio's.

    The loop shares the GIL with the preprocessing threads (templates, tokenization, large
    bodies): a thread that wants it waits up to the switch interval for the holder to let go,
    and the loop wants it back at every wake-up. 1 ms instead of Python's 5 ms bounds what a
    flood of heavy requests adds to /health (the engines use 0.5 ms for the same reason)."""
    sys.setswitchinterval(0.001)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def _serve(
    server: uvicorn.Server,
    sockets: list[socket.socket] | None = None,
    ready_line: Callable[[str], str] | None = None,
) -> None:
    """Run uvicorn; print `READY gateway host:port` once it listens (`tandem serve` waits
    for that line, so the port may be 0). A worker prints its own line to its parent."""
    task = asyncio.create_task(server.serve(sockets))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        address = f"{host}:{port}"
        print(ready_line(address) if ready_line else f"READY gateway {address}", flush=True)
    await task


if __name__ == "__main__":
    die_with_parent()  # a worker of `--workers N` (engine/lifeline.py): end with its parent
    main()
