"""The engine thread's failure handling, on a fake core (no model): a raising hook is counted and
the loop goes on; a raising step ends the loop, fails every stream and fires the death callbacks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, OutputStream
from engine.engine_core import EngineCoreOutput, EngineStats
from engine.metrics import EngineCollector

DEADLINE_S = 10.0


class FakeCore:
    """Just what `AsyncEngine` (and the metrics) call: one request at a time, one token a step."""

    config = SimpleNamespace(model=SimpleNamespace(model="fake"))

    def __init__(self, fail_at_step: int | None = None):
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self.running: str | None = None

    def has_unfinished_requests(self) -> bool:
        return self.running is not None

    def add_request(self, request) -> None:
        self.running = request.request_id

    def abort_request(self, request_id: str) -> bool:
        self.running = None
        return True

    def stats(self) -> EngineStats:
        return EngineStats(int(self.running is not None), 0, 0.0, 10, 0, 0, 0)

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom in step")
        return [EngineCoreOutput(self.running, new_token_ids=[self.num_steps])]


class BlockingCore(FakeCore):
    """A step that waits for `release`, then raises: commands queue up behind it meanwhile."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self) -> list[EngineCoreOutput]:
        self.entered.set()
        assert self.release.wait(DEADLINE_S)
        raise RuntimeError("boom after the wait")


class FakeRequest:
    request_id = "r1"


def _wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_raising_hook_is_counted_and_the_loop_goes_on():
    engine = AsyncEngine(FakeCore(), idle_wait_s=0.001)
    calls = []

    def bad_hook() -> bool:
        calls.append(1)
        raise ValueError("bad poll")

    engine.hooks.append(bad_hook)
    try:
        _wait_until(lambda: len(calls) >= 3, "the hook to run three times")
        assert engine.is_alive
        assert engine.num_hook_errors >= 3
        exported = {
            m.name: m.samples[0].value
            for m in EngineCollector(engine, None, "decode", "d").collect()
        }
        assert exported["tandem:engine_hook_errors"] >= 3
        # The loop still runs commands.
        assert asyncio.run(engine.call(lambda: 42)) == 42
    finally:
        engine.shutdown()


def test_raising_step_kills_the_loop_fails_streams_and_fires_on_death():
    engine = AsyncEngine(FakeCore(fail_at_step=3), idle_wait_s=0.001)
    died: list[BaseException] = []
    fired = threading.Event()

    def on_death(exc: BaseException) -> None:
        died.append(exc)
        fired.set()

    engine.on_death.append(on_death)

    async def consume() -> list[EngineCoreOutput]:
        outs = []
        with pytest.raises(EngineDeadError):
            async for out in engine.generate(FakeRequest()):
                outs.append(out)
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(consume(), DEADLINE_S))
        assert [t for o in outs for t in o.new_token_ids] == [1, 2]  # 1 or 2 messages
        assert fired.wait(DEADLINE_S), "on_death was not called"
        assert isinstance(died[0], RuntimeError) and not engine.is_alive
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.call(lambda: 1))
    finally:
        engine.shutdown()


def test_on_death_is_not_fired_by_a_clean_shutdown():
    engine = AsyncEngine(FakeCore(), idle_wait_s=0.001)
    died = []
    engine.on_death.append(died.append)
    engine.shutdown()
    assert not engine.is_alive and engine.error is None and died == []


def test_a_call_queued_when_the_loop_dies_fails_instead_of_hanging():
    core = BlockingCore()
    engine = AsyncEngine(core, idle_wait_s=0.001)

    async def run() -> None:
        engine.submit(lambda: core.add_request(FakeRequest()))
        assert await asyncio.to_thread(core.entered.wait, DEADLINE_S)
        pending = asyncio.ensure_future(engine.call(lambda: 1))  # queued behind the stuck step
        await asyncio.sleep(0)  # let it register and queue
        core.release.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending, DEADLINE_S)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


class FiveTokenCore(FakeCore):
    """Five tokens, then "length"; tokens 2.. only once `go` is set (the consumer has read the
    first), and `produced` once all five are out."""

    def __init__(self):
        super().__init__()
        self.go, self.produced = threading.Event(), threading.Event()

    def step(self) -> list[EngineCoreOutput]:
        if self.num_steps == 1:
            assert self.go.wait(DEADLINE_S)
        out = super().step()[0]
        if self.num_steps == 5:
            out.finish_reason, self.running = "length", None
            self.produced.set()
        out.new_logprobs = [{out.new_token_ids[0]: -0.5}]
        return [out]


def test_a_consumer_that_falls_behind_gets_the_queued_tokens_in_one_message():
    core = FiveTokenCore()
    engine = AsyncEngine(core, idle_wait_s=0.001)

    async def consume() -> list[EngineCoreOutput]:
        outs = []
        async for out in engine.generate(FakeRequest()):
            outs.append(out)
            if len(outs) == 1:  # fall behind: the engine produces the rest meanwhile
                core.go.set()
                assert await asyncio.to_thread(core.produced.wait, DEADLINE_S)
        return outs

    itls: list[float] = []
    engine.observe_itl = itls.append
    try:
        outs = asyncio.run(asyncio.wait_for(consume(), DEADLINE_S))
        assert [o.new_token_ids for o in outs] == [[1], [2, 3, 4, 5]]
        assert outs[1].new_logprobs == [{t: -0.5} for t in (2, 3, 4, 5)]
        assert outs[1].finish_reason == "length"
        # Two messages, but five engine steps: four inter-token latencies, one per step (the
        # first spans the wait for `go`), not one per message.
        assert len(itls) == 4 and all(itl >= 0 for itl in itls)
    finally:
        engine.shutdown()


def test_a_first_token_from_add_starts_the_inter_token_clock():
    """A remote prefill's first token comes from `add`, not a step: the next step's token is
    one inter-token latency after it, measured from when `add` ran."""
    core = FiveTokenCore()
    core.go.set()
    engine = AsyncEngine(core, idle_wait_s=0.001)
    itls: list[float] = []
    engine.observe_itl = itls.append

    def add(request) -> EngineCoreOutput:
        core.add_request(request)
        return EngineCoreOutput(request.request_id, new_token_ids=[0])

    async def consume() -> list[int]:
        return [
            t async for out in engine.generate(FakeRequest(), add=add) for t in out.new_token_ids
        ]

    try:
        assert asyncio.run(asyncio.wait_for(consume(), DEADLINE_S)) == [0, 1, 2, 3, 4, 5]
        assert len(itls) == 5
    finally:
        engine.shutdown()


def test_an_error_queued_behind_tokens_is_raised_after_them():
    core = FiveTokenCore()
    core.fail_at_step = 4
    engine = AsyncEngine(core, idle_wait_s=0.001)
    dead = threading.Event()
    engine.on_death.append(lambda exc: dead.set())

    async def consume() -> list[EngineCoreOutput]:
        outs = []
        with pytest.raises(EngineDeadError):
            async for out in engine.generate(FakeRequest()):
                outs.append(out)
                if len(outs) == 1:
                    core.go.set()
                    assert await asyncio.to_thread(dead.wait, DEADLINE_S)
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(consume(), DEADLINE_S))
        assert [o.new_token_ids for o in outs] == [[1], [2, 3]]
    finally:
        engine.shutdown()


class ManyStreamsCore(FakeCore):
    """Steps only once `num` requests are in; each step gives every request one token, the third
    finishes them all."""

    def __init__(self, num: int):
        super().__init__()
        self.num, self.ids = num, []

    def has_unfinished_requests(self) -> bool:
        return len(self.ids) == self.num

    def add_request(self, request) -> None:
        self.ids.append(request.request_id)

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        outs = [EngineCoreOutput(rid, new_token_ids=[100 * k + self.num_steps])
                for k, rid in enumerate(self.ids)]  # fmt: skip
        if self.num_steps == 3:
            for out in outs:
                out.finish_reason = "length"
            self.ids = []
        return outs


def test_a_steps_outputs_reach_every_stream_in_one_hand_off_to_the_event_loop():
    num = 5
    core = ManyStreamsCore(num)
    engine = AsyncEngine(core, idle_wait_s=0.001)
    hand_offs: list[int] = []  # call_soon_threadsafe calls per dispatched step
    dispatch = engine._dispatch

    def counting_dispatch(outputs):
        hand_offs.append(0)
        dispatch(outputs)

    engine._dispatch = counting_dispatch

    async def run() -> list[list[list[int]]]:
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counting(*args):
            if threading.current_thread() is engine._thread and hand_offs:
                hand_offs[-1] += 1
            return threadsafe(*args)

        loop.call_soon_threadsafe = counting

        async def one(rid: str) -> list[list[int]]:
            request = SimpleNamespace(request_id=rid)
            got = []
            async for out in engine.generate(request):
                got.extend([t] for t in out.new_token_ids)  # coalesced or not: token by token
                if out.finish_reason is not None:
                    assert out.finish_reason == "length"
            return got

        return await asyncio.gather(*(one(f"r{k}") for k in range(num)))

    try:
        streams = asyncio.run(asyncio.wait_for(run(), DEADLINE_S))
        assert streams == [[[100 * k + s] for s in (1, 2, 3)] for k in range(num)]
        assert hand_offs == [1, 1, 1]
    finally:
        engine.shutdown()


def test_output_stream_keeps_order_wakes_its_reader_and_survives_a_cancelled_get():
    async def run() -> None:
        q = OutputStream(asyncio.get_running_loop())
        assert q.empty()
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)  # the reader now waits
        assert not waiting.done()
        q.put_nowait("a")
        q.put_nowait("b")
        assert await asyncio.wait_for(waiting, DEADLINE_S) == "a"
        assert not q.empty() and q.get_nowait() == "b"
        with pytest.raises(IndexError):
            q.get_nowait()
        cancelled = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        q.put_nowait("c")  # put after a reader went away: kept for the next one
        assert await asyncio.wait_for(q.get(), DEADLINE_S) == "c"

    asyncio.run(run())
