"""`tandem serve`: gateway + N prefill + M decode services as separate processes on loopback.

Each service is started with port 0 and prints `READY <role> host:port` once it serves; the
launcher reads that line, so no port is ever guessed. Children get SIGTERM if the launcher
dies (PR_SET_PDEATHSIG), and the launcher stops them all on Ctrl-C / SIGTERM: no orphans.

A child that exits is restarted on the port it had (`tandem/supervisor.py` says how often and
when the launcher gives up, exiting 1).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from engine.internal_auth import ENV_TOKEN
from engine.lifeline import StopFlag, child_env
from engine.ports import bind_error
from engine.registry import REDIS_URL_ENV, resolve_redis_url
from gateway.reasoning import REASONING_PARSERS
from gateway.tool_parsers import TOOL_PARSERS
from tandem.supervisor import GiveUpError, Supervisor

logger = logging.getLogger(__name__)


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    address: str | None = None  # from the READY line
    argv: list[str] = field(default_factory=list)
    # Set on the READY line, or when the output ends (the child exited without it).
    ready: threading.Event = field(default_factory=threading.Event)
    # Its last lines of output: what a child that died before READY said, for the error.
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))


class Cluster:
    """Start, watch and stop the processes of one `tandem serve`."""

    def __init__(self, log_prefix: bool = True):
        self.children: list[Child] = []
        self.log_prefix = log_prefix

    def spawn(self, role: str, argv: list[str], replaces: Child | None = None) -> Child:
        """Start a child without waiting for it (`child.ready`); in `replaces`'s place."""
        cmd = [sys.executable, "-m", "tandem.cli", role, *argv]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=child_env(),
        )
        child = Child(role, proc, argv=list(argv))
        if replaces is None:
            self.children.append(child)
        else:  # same place: `stop` ends the gateway first
            self.children[self.children.index(replaces)] = child

        def pump() -> None:  # forward the child's log, catch its READY line
            for line in proc.stdout:
                child.tail.append(line)
                if line.startswith("READY "):
                    child.address = line.split()[2]
                    child.ready.set()
                if self.log_prefix:
                    sys.stderr.write(f"[{role} {proc.pid}] {line}")
            child.ready.set()

        threading.Thread(target=pump, daemon=True).start()
        return child

    def start(
        self,
        role: str,
        argv: list[str],
        timeout_s: float = 600.0,
        stopping: StopFlag | None = None,
    ) -> Child:
        """Start a child and wait for its READY line (or `stopping`)."""
        child = self.spawn(role, argv)
        deadline = time.monotonic() + timeout_s
        while not child.ready.wait(0.2):
            if stopping is not None and stopping.is_set():
                raise InterruptedError(f"stopped while {role} was starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role} did not become ready within {timeout_s} s")
        if child.address is None:
            said = "".join(child.tail)
            where = "see its log above" if self.log_prefix else f"its last output:\n{said}"
            raise RuntimeError(
                f"{role} exited with code {child.proc.wait()} before becoming ready; {where}"
            )
        return child

    def check(self) -> Child | None:
        """The first child that exited, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, timeout_s: float = 10.0) -> None:
        for c in reversed(self.children):  # gateway first, then services
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def _on_port(argv: list[str], address: str) -> list[str]:
    """`argv` to restart a service on the port it had (`--port` given last wins)."""
    return [*argv, "--port", address.rsplit(":", 1)[1]]


# `tandem serve`'s own flags (not passed on to the services): default and help.
SERVE_ONLY: dict[str, tuple[object, str]] = {
    "--host": ("127.0.0.1", "gateway bind address"),
    "--port": (8000, "gateway HTTP port (0: any free port)"),
    "--num-prefill": (1, "prefill services (0: the decodes prefill locally)"),
    "--num-decode": (1, "decode services (at least 1)"),
    "--served-model-name": (None, "name clients put in `model` (None: MODEL as given)"),
    "--redis-url": (
        None,
        f"quotas, registry and block index in Redis; no password here (use ${REDIS_URL_ENV})",
    ),
    "--num-gpus": (
        None,
        "GPUs to spread the services over, one after another in start order (prefills first); "
        "None: every visible GPU",
    ),
    "--decode-kv-role": (
        "kv_consumer",
        "kv_both: every decode also serves prefills for the others, and the gateway's cost "
        "model picks per request where to prefill (locally, or on another instance)",
    ),
    "--metrics-port": (
        None,
        "Prometheus /metrics on loopback: the gateway on this port, the services on the next "
        "ones in start order (0: free ports); the URLs are printed at start-up; off if unset",
    ),
}
SERVE_TYPES = {"--metrics-port": int, "--num-gpus": int}


# The gateway's own flags: `tandem serve` passes them to its gateway only (vLLM's names).
GATEWAY_SWITCHES: dict[str, str] = {
    "--enable-auto-tool-choice": 'allow tool_choice "auto" (needs --tool-call-parser)',
    "--enable-tokenizer-endpoints": "serve POST /tokenize and /detokenize",
    "--trust-request-chat-template": "let requests pass their own chat_template",
    "--exclude-tools-when-tool-choice-none": 'leave tools out of the prompt for tool_choice "none"',
}
GATEWAY_VALUES: dict[str, tuple[tuple[str, ...] | None, str]] = {  # (choices or any, help)
    "--tool-call-parser": (tuple(TOOL_PARSERS), "how tool calls are read from the model's text"),
    "--reasoning-parser": (tuple(REASONING_PARSERS), "split <think> into reasoning_content"),
    "--prefill-policy": (
        ("auto", "remote"),
        "auto: the cost model prefills on a decode when a remote prefill does not pay; remote: "
        "always on a prefill instance while one is up (default auto)",
    ),
    "--route-log": (None, "append one JSON line per request: route, predicted and measured TTFT"),
    "--api-server-count": (
        None,
        "gateway processes behind the one port (vLLM's name; default 1); more than 1 needs "
        "--redis-url (the processes share quotas, the registry and the block index there)",
    ),
    "--shed-busy-fraction": (
        None,
        "the gateway's load shedding: fewer requests admitted at once (503 + Retry-After) "
        "while its event loop is busy more than this share of the time (default 0.9; 0: off)",
    ),
    "--max-inflight-requests": (
        None,
        "the gateway's fixed cap on requests in flight per process, streams included "
        "(default: none)",
    ),
}


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway flags of a parsed `tandem serve` command line, as the gateway takes them."""
    out = []
    for flag in GATEWAY_VALUES:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, value]
    return out + [f for f in GATEWAY_SWITCHES if getattr(args, f[2:].replace("-", "_"))]


def build_parser() -> argparse.ArgumentParser:
    from engine.serving import HelpFormatter, add_engine_args

    parser = argparse.ArgumentParser(
        "tandem serve", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    add_engine_args(parser)  # validated here, passed on to every service as given
    for flag, (default, help_text) in SERVE_ONLY.items():
        kind = SERVE_TYPES.get(flag) or (type(default) if default is not None else str)
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    for flag, (choices, help_text) in GATEWAY_VALUES.items():
        parser.add_argument(flag, choices=choices, default=None, help=f"gateway: {help_text}")
    for flag, help_text in GATEWAY_SWITCHES.items():
        parser.add_argument(flag, action="store_true", help=f"gateway: {help_text}")
    parser.add_argument(
        "--kv-backend",
        default="ucx",
        choices=["ucx", "inproc"],
        help="KV transfer backend of the services (inproc: tests only)",
    )
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    engine_args = _without(argv, {**SERVE_ONLY, **GATEWAY_VALUES}, switches=GATEWAY_SWITCHES)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.num_decode < 1 or args.num_prefill < 0:
        parser.error("need --num-decode >= 1 and --num-prefill >= 0")
    if args.decode_kv_role not in ("kv_consumer", "kv_both"):
        parser.error(f"--decode-kv-role {args.decode_kv_role}: choose kv_consumer or kv_both")
    try:
        redis_url = resolve_redis_url(args.redis_url)
    except ValueError as e:
        parser.error(str(e))
    count = args.api_server_count
    if count is not None and not (count.isdigit() and int(count) >= 1):
        parser.error(f"--api-server-count {count}: a whole number of gateway processes, >= 1")
    if count is not None and int(count) > 1 and not redis_url:
        parser.error(
            f"--api-server-count {count} needs --redis-url (or ${REDIS_URL_ENV}): the gateway "
            "processes share API-key quotas, the instance registry and the block index there"
        )
    # Before any model loads: a taken port or a bad model is one line now, not a traceback from
    # every service in a minute.
    error = bind_error(args.host, args.port) or engine_config_error(args)
    roles = ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
    metrics_ports = _metrics_ports(args.metrics_port, 1 + len(roles))
    for metrics_port in metrics_ports if args.metrics_port else ():
        error = error or bind_error(METRICS_HOST, metrics_port)
    if error is not None:
        print(f"tandem serve: {error}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Internal gRPC traffic is authenticated with a per-launch secret, passed by environment.
    os.environ.setdefault(ENV_TOKEN, secrets.token_hex(32))
    cluster = Cluster()
    supervisor = Supervisor(cluster)
    stopping = StopFlag()  # not an Event: see engine/lifeline.py
    stopping.set_on_signals()
    try:
        svc = [*engine_args, *([] if args.model in engine_args else [args.model])]
        # With Redis the services register themselves and the gateway discovers them there.
        # The URL (it may hold a password) reaches the children by environment, never argv.
        if redis_url:
            os.environ[REDIS_URL_ENV] = redis_url
        placement = gpu_placement(args, argv, len(roles), args.num_gpus)
        metrics = [_metrics_flags(p) for p in metrics_ports]
        both = ["--kv-role", "kv_both"] if args.decode_kv_role == "kv_both" else []
        role_flags = [both if role == "decode" else [] for role in roles]
        started = [
            cluster.start(role, svc + flags + share + m, stopping=stopping)
            for role, flags, share, m in zip(roles, role_flags, placement, metrics[1:])
        ]
        for i, (child, m) in enumerate(zip(started, metrics[1:])):
            # A replacement starts while all the others run: on its GPU, it gets the share of
            # the last service started there (the whole rest).
            gpu = _gpu_of(placement[i])
            last = max(k for k, share in enumerate(placement) if _gpu_of(share) == gpu)
            restart = svc + role_flags[i] + placement[last] + m
            supervisor.watch(child, _on_port(restart, child.address))
        prefills, decodes = started[: args.num_prefill], started[args.num_prefill :]
        if both:
            prefills = prefills + decodes
        instances = (
            []
            if redis_url
            else [
                "--decode",
                ",".join(c.address for c in decodes),
                *(["--prefill", ",".join(c.address for c in prefills)] if prefills else []),
            ]
        )
        gw_args = [
            "--model",
            args.model,
            "--host",
            args.host,
            "--port",
            str(args.port),
            *instances,
            *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
            *_passthrough(engine_args, ("--max-model-len",)),
            *gateway_flags(args),
            *metrics[0],
        ]
        gateway = cluster.start("gateway", gw_args, stopping=stopping)
        supervisor.watch(gateway, _on_port(gw_args, gateway.address))
        port = gateway.address.rsplit(":", 1)[1]  # the real one when --port is 0
        print(
            f"Tandem is serving {args.model} at http://{args.host}:{port}/v1 "
            f"({args.num_prefill} prefill, {args.num_decode} decode)",
            flush=True,
        )
        if args.metrics_port is not None:
            names = ["gateway", *(f"{r} {roles[:i].count(r)}" for i, r in enumerate(roles))]
            urls = [f"{n} http://{METRICS_HOST}:{p}/metrics" for n, p in zip(names, metrics_ports)]
            print("Metrics: " + ", ".join(urls), flush=True)
        while not stopping.wait(0.5):
            supervisor.tick()
        return 0
    except GiveUpError as e:
        logger.error("%s; stopping everything", e)
        return 1
    except (RuntimeError, TimeoutError) as e:  # a service that died or hung while starting
        print(f"tandem serve: {e}", file=sys.stderr)
        return 1
    except InterruptedError as e:  # Ctrl-C / SIGTERM during start-up
        logger.info("%s", e)
        return 0
    finally:
        cluster.stop()


def engine_config_error(args: argparse.Namespace) -> str | None:
    """What every service would fail on at start-up (a model path that does not exist, a
    `--max-model-len` above the model's, a bad dtype), checked once here: the services build
    the same configuration from the same flags. None when it builds."""
    from engine.serving import engine_config_from_args

    try:
        engine_config_from_args(args)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        return str(e)
    return None


METRICS_HOST = "127.0.0.1"  # metrics stay off the public address


def _metrics_ports(first: int | None, n: int) -> list[int]:
    """Prometheus ports of the gateway and the n - 1 services: consecutive from `first`, or
    free ones for 0 (fixed here, so a restarted child keeps its port); none if unset."""
    if first is None:
        return [0] * n
    if first:
        return list(range(first, first + n))
    ports, held = [], []
    for _ in range(n):  # hold each until all are chosen, so none is picked twice
        s = socket.socket()
        s.bind((METRICS_HOST, 0))
        held.append(s)
        ports.append(s.getsockname()[1])
    for s in held:
        s.close()
    return ports


def _metrics_flags(port: int) -> list[str]:
    return ["--metrics-port", str(port)] if port else []


def gpu_placement(
    args: argparse.Namespace, argv: list[str], n: int, num_gpus: int | None = None
) -> list[list[str]]:
    """Extra flags per service (in start order) placing n services on the GPUs.

    With several GPUs (`--num-gpus`, default every visible one) service i runs on GPU
    i mod num_gpus (`--device cuda:K`): prefills are started first, so 1 prefill + 1 decode on
    two GPUs get one each, and two decodes (colocated replicas) likewise.

    Services sharing a GPU split its memory: they start one after another and each sizes its
    KV cache from `gpu_memory_utilization` x total minus everything already in use on the GPU
    (its own weights and activations and the services started before it). Giving the j-th
    service on a GPU the cumulative share (j + 1) / m of the requested utilization therefore
    leaves each of its m services about 1 / m of it. Nothing changes on CPU; the memory split is
    skipped when the user sized the KV cache explicitly.
    """
    on_gpu = args.device == "cuda" or (args.device == "auto" and _cuda_available())
    if not on_gpu or args.device.startswith("cuda:"):
        return [[] for _ in range(n)]
    num_gpus = max(1, min(num_gpus or _cuda_device_count(), n))
    gpus = [i % num_gpus for i in range(n)]
    flags = [["--device", f"cuda:{g}"] if num_gpus > 1 else [] for g in gpus]
    explicit = ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--num-gpu-blocks-override")
    if any(a.split("=")[0] in explicit for a in argv):
        return flags
    util = args.gpu_memory_utilization
    for i, g in enumerate(gpus):
        m, j = gpus.count(g), gpus[:i].count(g)
        if m > 1:
            flags[i] += ["--gpu-memory-utilization", f"{util * (j + 1) / m:.4f}"]
    return flags


def _gpu_of(flags: list[str]) -> str:
    return flags[flags.index("--device") + 1] if "--device" in flags else ""


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _without(argv: list[str], flags, switches=()) -> list[str]:
    """`argv` minus the given flags and their values (`--flag v` or `--flag=v`), and minus
    the given `switches` (flags without a value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in switches:
            continue
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def _passthrough(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        for f in flags:
            if a == f and i + 1 < len(argv):
                out += [f, argv[i + 1]]
            elif a.startswith(f + "="):
                out.append(a)
    return out
