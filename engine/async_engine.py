"""The engine loop on its own thread, driven from asyncio (the gRPC services).

One thread owns the `EngineCore` and everything that is not thread-safe beside it (the KV
transfer agent): other threads never touch them, they submit callables with `call()`, which
run between steps. Outputs flow back to per-request asyncio queues.

Readiness: `last_step_time` advances every loop iteration; a loop stuck in a step for longer
than the health check's threshold makes the service not ready.

Failure: a hook that raises is logged and counted (`num_hook_errors`) and the loop goes on. An
exception from a step (or a command) ends the loop: `error` is set, every open stream gets
`EngineDeadError`, then each `on_death` callback runs on the dying thread (the service makes
itself unhealthy and exits non-zero, so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.engine_core import EngineCore
from engine.outputs import EngineCoreOutput
from engine.request import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A hook runs on the engine thread after every iteration; it returns True while it has work in
# flight (e.g. transfers to poll), which keeps the loop spinning instead of sleeping.
Hook = Callable[[], bool]
# Called once, on the engine thread, with the exception that ended the loop.
DeathCallback = Callable[[BaseException], None]
HOOK_ERROR_LOG_INTERVAL_S = 10.0  # a hook failing every iteration logs once per interval


class EngineDeadError(RuntimeError):
    pass


class OutputStream:
    """One request's outputs (or the exception that ends it), put on its event loop and read by
    one consumer: asyncio.Queue's part that `generate` uses, without its per-item cost (its
    `get` looks the running loop up, a `getpid` system call, each time it waits: a tenth of
    the event loop's time at 256 streams)."""

    __slots__ = ("_items", "_loop", "_waiter", "observe_itl", "last_token_time")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        observe_itl: Callable[[float], Any] | None = None,
    ):
        self._items: deque = deque()
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        # Inter-token latency, per engine step that gave this request tokens, timed when the
        # engine handed the step's outputs over: a consumer that falls behind and reads several
        # steps as one item (see `generate`) still counts and times each step, as vLLM's
        # engine-timestamped iteration stats do.
        self.observe_itl = observe_itl
        self.last_token_time: float | None = None

    def put_step(self, item: EngineCoreOutput, step_time: float) -> None:
        """`item`, one engine step's output for this request, produced at `step_time`."""
        if item.new_token_ids and self.observe_itl is not None:
            last = self.last_token_time
            if last is not None:
                self.observe_itl(step_time - last)
            self.last_token_time = step_time
        self.put_nowait(item)

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: its reader was cancelled
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        """The oldest item; IndexError when empty."""
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()


class AsyncEngine:
    def __init__(self, core: EngineCore, idle_wait_s: float = 0.05, busy_wait_s: float = 0.00005):
        self.core = core
        self.idle_wait_s = idle_wait_s
        self.busy_wait_s = busy_wait_s
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._pending_calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.hooks: list[Hook] = []
        self.on_death: list[DeathCallback] = []
        self.num_hook_errors = 0
        self._hook_error_logged_at: dict[int, float] = {}  # id(hook) -> monotonic time
        self.last_step_time = time.monotonic()
        self.error: BaseException | None = None
        # Observes the time between a stream's engine steps (`OutputStream.observe_itl`): the
        # decode service sets its inter-token latency histogram here.
        self.observe_itl: Callable[[float], Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- API for asyncio callers -----------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread; its result or exception comes back here
        (`EngineDeadError` if the loop dies first)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        # Registered before the liveness check: either the check sees the error, or the dying
        # loop sees this future and fails it. Nothing waits forever on a dead loop.
        self._pending_calls[id(fut)] = (loop, fut)
        try:
            self._check_alive()

            def run() -> None:
                try:
                    result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the caller, not swallowed
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, result)

            self._cmds.put(run)
            return await fut
        finally:
            self._pending_calls.pop(id(fut), None)

    async def generate(
        self, request: Request, add: Callable[[Request], Any] | None = None
    ) -> AsyncIterator[EngineCoreOutput]:
        """Add `request` (with `add`, default `core.add_request`) and stream its outputs until
        it finishes. `add` may return a first output to yield (a remotely sampled token).
        Leaving the iterator early (client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        q = OutputStream(loop, self.observe_itl)
        self._streams[request.request_id] = (loop, q)
        finished = False
        add = add or self.core.add_request

        def add_and_stamp(r: Request) -> Any:
            # On the engine thread, before any step can give this request a token: a first
            # token from `add` (a remote prefill's) starts the inter-token clock.
            first = add(r)
            if isinstance(first, EngineCoreOutput) and first.new_token_ids:
                q.last_token_time = time.monotonic()
            return first

        try:
            first = await self.call(add_and_stamp, request)
            if isinstance(first, EngineCoreOutput):
                yield first
                if first.finish_reason is not None:
                    finished = True
                    return
            carry = None  # an exception taken from the queue while coalescing
            while True:
                if carry is not None:
                    item, carry = carry, None
                else:
                    item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                # One message per wake-up, not per token, when the consumer fell behind the
                # engine (a busy event loop, a slow client): it catches up instead of falling
                # further behind (vLLM's RequestOutputCollector merges the same way).
                while item.finish_reason is None and not q.empty():
                    nxt = q.get_nowait()
                    if not isinstance(nxt, EngineCoreOutput):
                        carry = nxt  # raised after what came before it
                        break
                    item = merge_outputs(item, nxt)
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished and self.error is None:
                # Fire and forget: this may run inside a cancelled task.
                self._cmds.put(lambda: self.core.abort_request(request.request_id))

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` on the engine thread, fire and forget (safe from cancelled tasks)."""
        self._cmds.put(fn)

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"The engine loop is not running: {self.error!r}")

    # ---- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                busy = False
                if self.core.has_unfinished_requests():
                    self._dispatch(self.core.step())
                    busy = True
                for hook in self.hooks:
                    busy |= self._run_hook(hook)
                self.last_step_time = time.monotonic()
                if not busy and not self.core.has_unfinished_requests():
                    self._wait_for_command(self.idle_wait_s)
                elif not self.core.has_unfinished_requests():
                    self._wait_for_command(self.busy_wait_s)
        except BaseException as e:  # noqa: BLE001 - recorded, reported to every waiter, logged
            logger.exception("Engine loop died")
            self.error = e
            for loop, q in list(self._streams.values()):
                _call_soon(loop, q.put_nowait, EngineDeadError(f"engine loop died: {e!r}"))
            for loop, fut in list(self._pending_calls.values()):
                err = EngineDeadError(f"engine loop died: {e!r}")
                _call_soon(loop, _set_exception, fut, err)
            for callback in self.on_death:
                try:
                    callback(e)
                except Exception:  # noqa: BLE001 - logged; the next callback must still run
                    logger.exception("on_death callback %r failed", callback)

    def _run_hook(self, hook: Hook) -> bool:
        """A hook's failure is its own (a bad transfer, a bad message): logged with its traceback
        (at most once per `HOOK_ERROR_LOG_INTERVAL_S` per hook), counted, and the loop goes on."""
        try:
            return bool(hook())
        except Exception:
            self.num_hook_errors += 1
            now = time.monotonic()
            last = self._hook_error_logged_at.get(id(hook))
            if last is None or now - last >= HOOK_ERROR_LOG_INTERVAL_S:
                self._hook_error_logged_at[id(hook)] = now
                logger.exception(
                    "engine hook %r raised (%d hook errors so far)", hook, self.num_hook_errors
                )
            return False

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _wait_for_command(self, timeout_s: float) -> None:
        try:
            cmd = self._cmds.get(timeout=timeout_s)
        except queue.Empty:
            return
        cmd()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs to their streams: one hand-off per event loop per step, not one per
        request (each `call_soon_threadsafe` wakes the loop through its self-pipe and takes the
        GIL from the loop: 256 of them cost ~3 ms per step on the engine thread)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Any]]] = {}
        streams = self._streams
        now = time.monotonic()
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                loop, q = stream
                batch = batches.get(loop)
                if batch is None:
                    batch = batches[loop] = []
                batch.append((q, out))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch, now)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is waiting there any more
        logger.debug("event loop closed; dropped %r", fn)


def _put_all(batch: list[tuple[OutputStream, Any]], step_time: float) -> None:
    """Event loop: one step's outputs into their streams' queues, in the engine's order."""
    for q, item in batch:
        q.put_step(item, step_time)


def _set_result(fut: asyncio.Future, result: Any) -> None:
    if not fut.cancelled():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.cancelled():
        fut.set_exception(exc)


def merge_outputs(a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
    """One request's two consecutive outputs as one."""
    return EngineCoreOutput(
        a.request_id,
        a.new_token_ids + b.new_token_ids,
        a.new_logprobs + b.new_logprobs,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        b.finish_reason,
        b.stop_reason,
        b.num_cached_tokens or a.num_cached_tokens,
    )
