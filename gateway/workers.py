"""`tandem gateway --workers N` (vLLM: `--api-server-count`): N gateway processes, one port.

One gateway process is one event loop on one core; past that core's capacity it sheds load
(gateway/shedding.py). More workers use more cores of a node. The parent loads nothing: it
checks the flags, reserves the port and supervises N worker processes, each a complete gateway
(`python -m gateway ... --worker-index I`), which share everything stateful through Redis (API
keys' quotas, the instance registry, the block index); hence N > 1 requires `--redis-url`.

Lifecycle:
  1. The parent binds the port with SO_REUSEPORT and never listens on it: the port is resolved
     once (`--port 0`) and stays reserved while workers come and go.
  2. Each worker binds its own SO_REUSEPORT socket to that port and listens; the kernel spreads
     new connections over the listening workers by a hash of the connection (even by count,
     unlike one shared accept queue, where whichever worker wakes first takes every pending
     connection at once).
  3. Each worker prints `READY gateway-worker ADDRESS METRICS` on its stdout, a pipe the parent
     reads; once all N have, the parent prints `READY gateway host:port`, once (`tandem serve`
     and tests wait for that line). Other stdout lines are passed on; stderr (logs) is shared.
  4. A worker that exits is restarted after a backoff (1 s, doubling to 30 s, back to 1 s after
     60 s up); a worker that fails before READY, at first start or `MAX_START_FAILURES` times in
     a row later, stops the gateway with exit code 1. SIGTERM or SIGINT to the parent stops
     every worker (each drains its open streams, as a single gateway does) and exits 0 once all
     have. Workers get SIGTERM if the parent dies (PR_SET_PDEATHSIG): no orphans.
Metrics: workers serve theirs on loopback ports of their own; the parent serves the one
`--metrics-port`, every worker's series with a `worker` label (gateway/worker_metrics.py).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.lifeline import StopFlag, child_env
from gateway.config import GatewaySettings
from gateway.worker_metrics import MetricsServer

logger = logging.getLogger(__name__)

READY_PREFIX = "READY gateway-worker "
MAX_START_FAILURES = 3
INITIAL_BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 30.0, 60.0


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (and SO_REUSEADDR, as uvicorn binds).
    Every socket of the group needs the option and the same user: another program cannot join."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def worker_argv(argv: Sequence[str], port: int, index: int, has_metrics: bool) -> list[str]:
    """The parent's argv for worker `index`: without --workers, on the resolved port, with its
    metrics (if any) on a free loopback port; given last, so these win over the user's."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--workers", "--api-server-count"):
            skip = True
        elif not a.startswith(("--workers=", "--api-server-count=")):
            out.append(a)
    out += ["--port", str(port), "--worker-index", str(index)]
    if has_metrics:
        out += ["--metrics-port", "0", "--metrics-host", "127.0.0.1"]
    return out


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    metrics_address: str | None = None  # host:port, from its READY line
    started_at: float = field(default_factory=time.monotonic)


class WorkerPool:
    """Start, watch and stop the workers of one gateway; `run` is the parent's main loop."""

    def __init__(self, argv: Sequence[str], settings: GatewaySettings, num_workers: int):
        assert num_workers >= 2
        self.argv, self.settings, self.num_workers = list(argv), settings, num_workers
        self.workers: list[Worker | None] = [None] * num_workers
        self.stopping = StopFlag()  # set by signal handlers: not an Event (engine/lifeline.py)
        self._port_socket = reuseport_socket(settings.host, settings.port)  # never listens
        self.host, self.port = self._port_socket.getsockname()[:2]
        self._backoff_s = [INITIAL_BACKOFF_S] * num_workers
        self._start_failures = [0] * num_workers
        self._restart_at: list[float | None] = [None] * num_workers
        self.metrics: MetricsServer | None = None

    def spawn(self, index: int) -> Worker:
        has_metrics = self.settings.metrics_port is not None
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            *worker_argv(self.argv, self.port, index, has_metrics),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=child_env())
        worker = self.workers[index] = Worker(index, proc)
        threading.Thread(target=self._pump, args=(worker,), daemon=True).start()
        return worker

    def _pump(self, worker: Worker) -> None:
        """Catch the worker's READY line, pass the rest of its stdout on."""
        for line in worker.proc.stdout:
            if line.startswith(READY_PREFIX):
                metrics = line.split()[3]
                worker.metrics_address = None if metrics == "-" else metrics
                worker.ready.set()
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    def run(self) -> int:
        """Start the workers, print READY, supervise until SIGTERM/SIGINT; the exit code."""
        self.stopping.set_on_signals()
        try:
            for index in range(self.num_workers):
                self.spawn(index)
            for worker in self.workers:
                if not self._wait_ready(worker):
                    return 0 if self.stopping.is_set() else 1
            if self.settings.metrics_port is not None and not self._start_metrics():
                return 1
            print(f"READY gateway {self.host}:{self.port}", flush=True)
            logger.info("%d gateway workers on %s:%d", self.num_workers, self.host, self.port)
            while not self.stopping.wait(0.2):
                if not self._supervise():
                    return 1
            return 0
        finally:
            self.stop()

    def _start_metrics(self) -> bool:
        s = self.settings
        self.metrics = MetricsServer(self.workers)
        try:
            address = self.metrics.start(s.metrics_host, s.metrics_port)
        except OSError as e:
            logger.error("metrics port %s:%s: %s", s.metrics_host, s.metrics_port, e)
            self.metrics = None
            return False
        logger.info("metrics of %d workers on http://%s:%d/metrics", self.num_workers, *address)
        return True

    def _wait_ready(self, worker: Worker) -> bool:
        while not worker.ready.wait(0.1):
            if self.stopping.is_set():
                return False
            code = worker.proc.poll()
            if code is not None:
                worker.ready.wait(1.0)  # a READY line printed just before exiting
                if not worker.ready.is_set():
                    logger.error(
                        "gateway worker %d exited with code %s before it was ready",
                        worker.index,
                        code,
                    )
                    return False
        return True

    def _supervise(self) -> bool:
        """Restart workers that exited (after their backoff); False: give up."""
        now = time.monotonic()
        for index, worker in enumerate(self.workers):
            restart_at = self._restart_at[index]
            if restart_at is not None:
                if now >= restart_at:
                    self._restart_at[index] = None
                    logger.info("restarting gateway worker %d", index)
                    self.spawn(index)
                continue
            code = worker.proc.poll()
            if code is None:
                if worker.ready.is_set() and self._start_failures[index]:
                    self._start_failures[index] = 0
                continue
            if not worker.ready.is_set():
                self._start_failures[index] += 1
                if self._start_failures[index] >= MAX_START_FAILURES:
                    logger.error(
                        "gateway worker %d failed to start %d times in a row; stopping",
                        index,
                        MAX_START_FAILURES,
                    )
                    return False
            elif now - worker.started_at >= STABLE_S:
                self._backoff_s[index] = INITIAL_BACKOFF_S
            delay = self._backoff_s[index]
            self._backoff_s[index] = min(2 * delay, MAX_BACKOFF_S)
            self._restart_at[index] = now + delay
            logger.warning(
                "gateway worker %d (pid %d) exited with code %s; restarting it in %.0f s",
                index,
                worker.proc.pid,
                code,
                delay,
            )
        return True

    def stop(self) -> None:
        """SIGTERM to every worker, then wait for all (each drains its streams first)."""
        if self.metrics is not None:
            self.metrics.stop()
        live = [w for w in self.workers if w is not None and w.proc.poll() is None]
        for worker in live:
            worker.proc.terminate()
        for worker in live:
            worker.proc.wait()
        self._port_socket.close()


def run_parent(argv: Sequence[str], settings: GatewaySettings, num_workers: int) -> int:
    return WorkerPool(argv, settings, num_workers).run()
