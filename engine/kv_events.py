"""KV-cache events and load, taken on the engine thread and fanned out to subscribers.

The block pool records `stored` / `removed` / `cleared` events as they happen and
`take_events()` drains them, so exactly one consumer may call it: `KVEventSource`, an engine
hook (`AsyncEngine.hooks`). Every `interval_s` it drains the pool, snapshots the load and hands
one `EventBatch` to each subscriber: the Redis publisher (`engine/registry.py`) and the gateways'
`WatchKVEvents` streams (the embedded index). Subscribers get diffs, not state (STYLE principle
5), except when they ask for a reset: a subscriber that is new, or that lost batches (Redis went
away), gets `reset=True` and one `stored` event holding every cached hash, from which whatever it
feeds is rebuilt; plain diffs follow in order.

Why the load is measured here: routing needs numbers that only the engine thread can read
consistently (queue, pending prompt tokens, prefill throughput), and reading them between steps
costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import KVCacheEvent

if TYPE_CHECKING:  # the gateway imports this module (through engine.registry): no torch
    from engine.engine_core import EngineCore

# How often the throughput estimate is folded, and how fast it follows changes.
_RATE_WINDOW_S = 0.5
_RATE_EMA = 0.3
_MIN_BUSY_S = 0.02  # windows with less busy time than this say nothing about the rate


@dataclass(frozen=True)
class LoadSnapshot:
    """An instance's load at one moment, as routing and autoscaling see it."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    kv_cache_usage: float
    num_pending_prefill_tokens: int  # admitted prompt tokens whose KV is not computed yet
    prefill_tokens_per_s: float  # measured; 0.0 until enough prefill work was seen
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(frozen=True)
class EventBatch:
    """What one subscriber receives per delivery. `reset`: forget the instance's blocks first."""

    reset: bool
    events: tuple[KVCacheEvent, ...]
    load: LoadSnapshot


class Subscription:
    """One consumer of batches. `deliver` runs on the engine thread: it must not block (put on a
    queue, or `call_soon_threadsafe` into an event loop)."""

    def __init__(self, deliver: Callable[[EventBatch], None]):
        self.deliver = deliver
        self.wants_reset = True  # the first batch of every subscription is a reset

    def request_reset(self) -> None:
        """Any thread: the next batch will be a reset (e.g. after batches were lost)."""
        self.wants_reset = True


class KVEventSource:
    """The engine hook that drains KV events and measures load; see the module docstring.

    `measure_prefill`: "busy" (the prefill role: it computes prompts and nothing else, so prompt
    tokens per busy second is its prefill rate), "mixed" (a decode: its steps mix prompt chunks
    with decoding, so the rate comes from `MixedRateFit`), or "" (no measurement, 0.0).
    """

    def __init__(
        self,
        core: EngineCore,
        measure_prefill: str,
        interval_s: float = 0.02,
        keepalive_s: float = 0.5,
    ):
        self.core = core
        assert measure_prefill in ("busy", "mixed", "")
        self.measure_prefill = measure_prefill
        self._fit = MixedRateFit()
        self._steps_at_window_start = core.scheduler.num_steps
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()  # subscribe/unsubscribe come from other threads
        now = time.monotonic()
        self._last_poll = self._last_sent = self._window_start = self._last_measure = now
        self._last_load: LoadSnapshot | None = None
        self._was_busy = False
        self._busy_s = 0.0
        self._computed_at_window_start = core.scheduler.num_prompt_tokens_computed
        self.prefill_tokens_per_s = 0.0
        self.latest_load: LoadSnapshot | None = None  # read by other threads (heartbeats)

    def subscribe(self, deliver: Callable[[EventBatch], None]) -> Subscription:
        sub = Subscription(deliver)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    # ---- engine thread -----------------------------------------------------------------------
    def poll(self) -> bool:
        """The hook: never reports work in flight (it must not keep the loop spinning)."""
        now = time.monotonic()
        self._measure(now)
        if now - self._last_poll < self.interval_s:
            return False
        self._last_poll = now
        events = tuple(self.core.kv.pool.take_events())
        load = self.latest_load = self._load()
        with self._lock:
            subs = list(self._subs)
        is_due = (
            bool(events) or load != self._last_load or now - self._last_sent >= self.keepalive_s
        )
        if is_due:
            self._last_load, self._last_sent = load, now
        for sub in subs:
            if sub.wants_reset:
                sub.wants_reset = False
                sub.deliver(EventBatch(True, (self._full_state(),), load))
            elif is_due:
                sub.deliver(EventBatch(False, events, load))
        return False

    def _full_state(self) -> KVCacheEvent:
        return KVCacheEvent("stored", tuple(self.core.kv.pool.cached))

    def _load(self) -> LoadSnapshot:
        core = self.core
        stats = core.stats()
        pending = sum(r.num_prompt_tokens_left for r in core.scheduler.requests.values())
        return LoadSnapshot(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            kv_cache_usage=round(stats.kv_cache_usage, 4),
            num_pending_prefill_tokens=pending,
            prefill_tokens_per_s=round(self.prefill_tokens_per_s, 1),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )

    def _measure(self, now: float) -> None:
        """Fold prompt tokens computed per busy second into an EMA, one window at a time.

        Busy time is loop time while requests were unfinished; tokens are prompt tokens the
        scheduler computed here. A prefill's busy time is all prompt work; a decode's is not
        (see `MixedRateFit`).
        """
        if not self.measure_prefill:
            return
        if self._was_busy:
            self._busy_s += now - self._last_measure
        self._last_measure = now
        self._was_busy = self.core.has_unfinished_requests()
        if now - self._window_start < _RATE_WINDOW_S:
            return
        sched = self.core.scheduler
        num_tokens = sched.num_prompt_tokens_computed - self._computed_at_window_start
        num_steps = sched.num_steps - self._steps_at_window_start
        rate = None
        if self.measure_prefill == "mixed":
            rate = self._fit.add(num_tokens, num_steps, self._busy_s)
        elif self._busy_s >= _MIN_BUSY_S and num_tokens > 0:
            rate = num_tokens / self._busy_s
        if rate is not None:
            prev = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if prev == 0 else prev + _RATE_EMA * (rate - prev)
        self._window_start, self._busy_s = now, 0.0
        self._computed_at_window_start = sched.num_prompt_tokens_computed
        self._steps_at_window_start = sched.num_steps


class MixedRateFit:
    """Prefill throughput of an engine whose steps mix prompt chunks with decoding.

    Each window gives (prompt tokens, steps, busy seconds); busy ≈ a·tokens + b·steps, where b
    is the decode part of a step and a the cost of one prompt token. A least-squares fit over
    recent windows (exponentially forgotten) gives a; the rate is 1 / a. Windows without prompt
    work pin b, windows with it pin a; until both kinds were seen (or when the fit is not
    physical) it answers None and the last estimate stands.
    """

    def __init__(self, forget: float = 0.9, min_windows: int = 4):
        self.forget, self.min_windows = forget, min_windows
        self._sums = [0.0] * 5  # Σtt, Σts, Σss, Σty, Σsy
        self._num_windows = 0

    def add(self, num_tokens: int, num_steps: int, busy_s: float) -> float | None:
        if busy_s < _MIN_BUSY_S or num_steps == 0:
            return None
        t, st, y = float(num_tokens), float(num_steps), busy_s
        new = (t * t, t * st, st * st, t * y, st * y)
        self._sums = [self.forget * old + x for old, x in zip(self._sums, new)]
        self._num_windows += 1
        tt, ts, ss, ty, sy = self._sums
        det = tt * ss - ts * ts
        if self._num_windows < self.min_windows or tt == 0 or det <= 1e-9 * tt * ss:
            return None
        a = (ty * ss - ts * sy) / det
        b = (tt * sy - ts * ty) / det
        if a <= 0 or b < 0:
            return None
        return 1.0 / a
