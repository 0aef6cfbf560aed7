"""Load shedding: refuse what the gateway cannot serve now, at once, so what it accepts stays fast.

Offered more than its CPU can serve, a gateway without a bound queues the excess: every request
waits behind all earlier ones and latency grows for as long as the overload lasts (measured:
p50 9 s after 5 s at 2.5x its capacity). Instead, each gateway process bounds the requests it
has in flight (POSTs admitted and not finished, streams included); a new one past the bound gets
a 503 with `Retry-After` before its body is read, which costs a small fraction of serving it.

The bound adapts to what this process can do now (`AdmissionLimit`, on by default). A gateway
process is one event loop: the requests in flight share one thread, so each one's latency grows
with their number once that thread is busy (processor sharing). Every `WINDOW_S` the process is
*overloaded* if its event loop's thread was busy more than `shed_busy_fraction` of the window
and ran at least `MIN_CPU_FRACTION` of it (Linux's per-thread schedstat: time on a CPU, time
ready and waiting for one). Busy counts the waiting: a worker that shares its cores with other
busy processes (more `--workers` than free cores) never gets a whole core, yet its requests
queue all the same. The CPU floor keeps out the other case of waiting: a gateway with little to
do on a node crowded by engines (`tandem serve` on a small machine) waits for a CPU at every
wake-up without any queue of its own (measured: busy 0.6-0.85, CPU 0.2-0.4, while 32 streams
run through it). Without schedstat, CPU time stands for both.
Both are measured over the last two windows, and what follows an overloaded window depends on
whether the process was offered more than it admitted:
- it refused a request (the adaptive bound, this window or the last): the limit drops to
  `DECREASE` x requests in flight (unless it is lower already: a cut that has not taken effect
  yet is not compounded), so nothing new is admitted until some of what is in flight is done;
- it refused none: its time goes to what it has already admitted (streams relayed from a busy
  GPU, a benchmark's closed loop where each new request replaces one that ended). Refusing the
  replacements would turn a slow relay into errors (measured: 486-744 503s at c=256 behind one
  H200, `bench/serve_gpu.py`), so the limit only closes in to `HEADROOM` x the most in flight
  over the last second, + `MIN_LIMIT`: room for what comes back, none for a sudden surge,
  whose excess is then refused and shrinks the limit as above. A fresh process starts at
  `MAX_LIMIT`, where an idle one's limit is anyway: a benchmark's first burst is not a surge.
  What this cannot tell apart: clients that retry a 503 at once (no Retry-After), surging onto
  a loop already busy with streams, keep being refused while the streams last (measured on 2
  CPUs: 256 streams onto a relay-saturated gateway, 77,396 503s in 20 s,
  `bench/results/gateway_stream_shedder-2026-12-02.json`); the SDKs wait for Retry-After.
Not overloaded, it grows to `INCREASE` x max(limit, requests in flight) (from the floor, 4, to
1,000 in under 3 s). Under overload it settles near the concurrency this process serves with
some of its time to spare: a handful of requests behind a fast decode, thousands of streams
behind slow ones; once the overload is over it is soon out of the way.
Lag (`tandem:event_loop_lag_seconds`: how late the watcher's own timer fires, the least over
the last `LAG_WINDOWS` windows) is exported but does not decide. Requiring it as well (a
standing queue, as CoDel does) was tried and measured: it kept a GPU-bound `tandem serve` from
refusing a closed-loop c=64 benchmark, but at twice the saturation rate the gateway then served
55 req/s of 1,232 with p99 9.9 s (34,107 client timeouts): its queue forms in the sockets and
the clients, not in the loop's ready callbacks, so the loop's timers stay on time while the
latency grows without bound.
`max_inflight_requests` (off by default) is the operator's fixed cap on top: the capacity
measured for your traffic (req/s) x the latency you accept (s), by Little's law.

Never refused: GET routes (/health, /v1/models, /version: probes must answer under load, and
the liveness probe is /v1/models) and requests already admitted (a stream runs to its end).
Each worker process (`--workers`) bounds itself.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import GatewaySettings
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

WINDOW_S = 0.05
# The calling thread's "on-CPU ns, waiting-for-a-CPU ns, time slices" (CONFIG_SCHED_INFO).
SCHEDSTAT = Path("/proc/thread-self/schedstat")
# Busy counts as overload only while the loop also ran this share of the time itself.
MIN_CPU_FRACTION = 0.5
LAG_WINDOWS = 4  # the exported lag: the least over this many windows
DECREASE, INCREASE = 0.8, 1.1
# Busy and refusing nothing: the limit closes in to this x the most in flight (+ MIN_LIMIT).
HEADROOM = 1.25
# ... the most in flight over this many windows (1 s): a closed loop's clients come back within
# it even when a whole batch ended at one step (measured: at one 5 ms step, 128 streams ended
# together and came back over more than two windows).
PEAK_WINDOWS = 20
MIN_LIMIT, MAX_LIMIT = 4, 1_000_000
# OpenAI's own wording for a 503.
OVERLOADED = "The server is overloaded or not ready yet."


@dataclass
class AdmissionLimit:
    """The adaptive bound on requests in flight; `end_window` every WINDOW_S."""

    limit: int = MAX_LIMIT  # what an idle process's limit grows to within seconds

    def end_window(
        self, is_overloaded: bool, num_inflight: int, peak_inflight: int, has_refused: bool
    ) -> None:
        """`peak_inflight`: the most in flight over the windows measured; `has_refused`: the
        adaptive bound refused a request in them (offered more than admitted)."""
        if not is_overloaded:  # what is in flight is served without overload: room for 10% more
            self.limit = min(MAX_LIMIT, int(INCREASE * max(self.limit, num_inflight)) + 1)
        elif has_refused:  # admit nothing more until some of what is in flight is done
            self.limit = min(self.limit, max(MIN_LIMIT, int(DECREASE * num_inflight)))
        else:  # busy with what it admitted: keep room for replacements, none for a surge
            self.limit = min(self.limit, int(HEADROOM * peak_inflight) + MIN_LIMIT)


class Shedder:
    """Counts requests in flight, watches the process's load and adapts the limit; `admit`
    says whether a new request may start. Single-threaded: all of it runs on the serving loop."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics):
        self.max_busy_fraction = settings.shed_busy_fraction
        self.is_adaptive = bool(self.max_busy_fraction)
        self.adaptive = AdmissionLimit() if self.is_adaptive else AdmissionLimit(MAX_LIMIT)
        self.max_inflight = settings.max_inflight_requests or MAX_LIMIT
        self.num_inflight = 0
        # The most in flight, this window and the PEAK_WINDOWS - 1 before it.
        self.peak_inflight = [0] * PEAK_WINDOWS
        # The adaptive bound's refusals, this window and the last.
        self.num_refused = [0, 0]
        self.busy_fraction = self.cpu_fraction = 0.0  # over the last two windows
        self.lags_s = [0.0] * LAG_WINDOWS  # how late the watcher woke, the last windows
        self._task: asyncio.Task | None = None
        self.refusal = APIError(OVERLOADED, 503, retry_after_s=settings.retry_after_s).response()
        r = metrics.registry
        self.shed = Counter(
            "tandem:requests_shed",
            "Requests refused with 503 because this gateway process was overloaded, by bound "
            "(adaptive: the limit its load sets; max_inflight: the configured cap).",
            ["reason"],
            registry=r,
        )
        for reason in ("adaptive", "max_inflight"):
            self.shed.labels(reason)  # exported from the start (0), for rates and alerts
        gauges = {
            "tandem:requests_in_flight": (
                "POST requests admitted by this gateway process, not finished (streams included).",
                lambda: self.num_inflight,
            ),
            "tandem:admission_limit": (
                "Requests this gateway process admits at once now (the lower of both bounds).",
                lambda: min(self.adaptive.limit, self.max_inflight),
            ),
            "tandem:event_loop_busy_fraction": (
                "Share of the last 0.1 s the event loop's thread ran or waited for a CPU.",
                lambda: self.busy_fraction,
            ),
            "tandem:event_loop_cpu_fraction": (
                "Share of the last 0.1 s the event loop's thread ran on a CPU.",
                lambda: self.cpu_fraction,
            ),
            "tandem:event_loop_lag_seconds": (
                f"Least delay of a {WINDOW_S} s timer on the event loop over the last "
                f"{LAG_WINDOWS * WINDOW_S:g} s (a standing queue of ready work).",
                lambda: min(self.lags_s),
            ),
        }
        for name, (documentation, read) in gauges.items():
            Gauge(name, documentation, registry=r).set_function(read)

    def start(self) -> None:
        """On the serving loop (the lifespan)."""
        if self.is_adaptive:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def admit(self) -> str | None:
        """None: admitted (call `done` when it ends); else the bound that refuses it."""
        if self.num_inflight >= self.max_inflight:
            return "max_inflight"
        if self.num_inflight >= self.adaptive.limit:
            self.num_refused[-1] += 1
            return "adaptive"
        self.num_inflight += 1
        if self.num_inflight > self.peak_inflight[-1]:
            self.peak_inflight[-1] = self.num_inflight
        return None

    def done(self) -> None:
        self.num_inflight -= 1
        assert self.num_inflight >= 0

    async def _watch(self) -> None:
        """Every WINDOW_S, on the loop's thread (whose schedstat it reads): adapt the limit to
        the last two windows (one alone may be a garbage collection or a burst)."""
        loop = asyncio.get_running_loop()
        fd = _open_schedstat()
        try:
            await self._watch_windows(loop, fd)
        finally:
            if fd is not None:
                os.close(fd)

    async def _watch_windows(self, loop: asyncio.AbstractEventLoop, fd: int | None) -> None:
        times = [(loop.time(), *loop_thread_times(fd))] * 3  # (wall, cpu, busy) seconds
        while True:
            await asyncio.sleep(WINDOW_S)
            times = [*times[1:], (loop.time(), *loop_thread_times(fd))]
            (start, cpu_start_s, busy_start_s), (now, cpu_s, busy_s) = times[0], times[-1]
            self.lags_s = [*self.lags_s[1:], now - times[-2][0] - WINDOW_S]
            self.cpu_fraction = (cpu_s - cpu_start_s) / (now - start)
            self.busy_fraction = (busy_s - busy_start_s) / (now - start)
            is_overloaded = (
                self.busy_fraction > self.max_busy_fraction and self.cpu_fraction > MIN_CPU_FRACTION
            )
            peak, has_refused = max(self.peak_inflight), any(self.num_refused)
            self.adaptive.end_window(is_overloaded, self.num_inflight, peak, has_refused)
            self.peak_inflight = [*self.peak_inflight[1:], self.num_inflight]
            self.num_refused = [self.num_refused[-1], 0]


def _open_schedstat() -> int | None:
    """The calling thread's schedstat, kept open: one pread per window instead of an open, a
    read and a close (0.5 vs 8 us measured, and fewer cache misses on an idle loop's wake-up)."""
    try:
        return os.open(SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return None


def loop_thread_times(fd: int | None = None) -> tuple[float, float]:
    """(seconds on a CPU, seconds on a CPU or waiting for one) of the calling thread (or of the
    thread whose schedstat `fd` is); without schedstat, the calling thread's CPU time for both."""
    try:
        raw = os.pread(fd, 128, 0) if fd is not None else SCHEDSTAT.read_bytes()
        on_cpu_ns, waiting_ns, _ = raw.split()
    except (OSError, ValueError):
        cpu_s = time.thread_time()
        return cpu_s, cpu_s
    return int(on_cpu_ns) / 1e9, (int(on_cpu_ns) + int(waiting_ns)) / 1e9


class SheddingMiddleware:
    """Pure ASGI, in front of the routes: a refused request's body is never read."""

    def __init__(self, app: ASGIApp, *, shedder: Shedder):
        self.app, self.shedder = app, shedder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        reason = self.shedder.admit()
        if reason is not None:
            self.shedder.shed.labels(reason).inc()
            await self.shedder.refusal(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.shedder.done()
