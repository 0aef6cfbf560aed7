"""--late-scheduling: `StepClock` predicts when the step in flight ends from the steps whose end
the host saw, and the engine loop takes commands (new requests) until shortly before it, so
that they join the next step (engine/step_clock.py, engine/async_engine.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.step_clock import MAX_WAIT_S, StepClock

LAUNCH_S = 0.002


def run_steps(clock: StepClock, steps: list[tuple[int, float]], t0: float = 100.0) -> float:
    """Steps back to back from t0: (prompt tokens, device seconds), each launched while the one
    before runs and read when it ends (the host waiting); returns the last end."""
    end = t0
    clock.launched(steps[0][0], LAUNCH_S)
    for i, (_, duration) in enumerate(steps):
        if i + 1 < len(steps):
            clock.launched(steps[i + 1][0], LAUNCH_S)
        end += duration
        clock.read(end)
    return end


def test_learns_step_times_and_schedules_before_the_in_flight_step_ends():
    clock = StepClock(margin_s=0.001)
    assert clock.schedule_at() is None  # nothing learned, nothing in flight
    decode, per_token = 0.008, 20e-6
    steps = [(0, decode)] * 3 + [(500, decode + 500 * per_token)] * 3 + [(0, decode)]
    end = run_steps(clock, steps)
    assert clock.predicted_s(0) == pytest.approx(decode)
    assert clock.predicted_s(250) == pytest.approx(decode + 250 * per_token)
    assert clock.schedule_at() is None  # read everything: no step in flight
    clock.launched(500, LAUNCH_S)  # in flight since `end`
    expected = end + decode + 500 * per_token - (LAUNCH_S + 0.001)
    assert clock.schedule_at() == pytest.approx(expected)


def test_no_deadline_without_a_seen_end_or_with_two_steps_in_flight():
    clock = StepClock()
    end = run_steps(clock, [(0, 0.008)] * 3)
    clock.launched(0, LAUNCH_S)
    assert clock.schedule_at() is not None
    clock.launched(0, LAUNCH_S)  # two in flight: the next one's start is not known
    assert clock.schedule_at() is None
    clock.read(None)  # its tokens were ready when asked for: its end was not seen
    assert clock.schedule_at() is None
    clock.read(end + 0.02)  # seen, but after an unseen one: no sample, a deadline again
    assert clock.predicted_s(0) == pytest.approx(0.008)
    clock.launched(0, LAUNCH_S)
    assert clock.schedule_at() == pytest.approx(end + 0.02 + 0.008 - LAUNCH_S - clock.margin_s)


def test_varying_steps_are_scheduled_earlier_and_never_far_ahead():
    steady, varying = StepClock(), StepClock()
    run_steps(steady, [(0, 0.010)] * 20, t0=0.0)
    run_steps(varying, [(0, 0.010 + (0.002 if i % 2 else -0.002)) for i in range(20)], t0=0.0)
    for clock in (steady, varying):
        clock.launched(0, LAUNCH_S)
    # Both predict ~10 ms; the one whose steps vary by 2 ms leaves ~2 errors more slack.
    slack = [c._last_end_s + c.predicted_s(0) - c.schedule_at() for c in (steady, varying)]
    assert slack[1] - slack[0] > 0.003
    slow = StepClock()
    run_steps(slow, [(0, 1.0)] * 3)
    slow.launched(0, LAUNCH_S)
    assert slow.schedule_at() - slow._last_end_s == pytest.approx(MAX_WAIT_S)


class FakeCore:
    """A core with a step always ready, whose first step is to be scheduled `wait_s` late."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.requests: list[str] = []
        self.seen_by_step: list[list[str]] = []
        self.log: list[tuple[str, list[str]]] = []
        self.asked = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return len(self.seen_by_step) < 2

    def schedule_at(self) -> float | None:
        if self.seen_by_step:
            return None
        self.asked.set()
        return time.monotonic() + self.wait_s

    def step(self) -> list:
        self.seen_by_step.append(list(self.requests))
        self.log.append(("step", list(self.requests)))
        return []

    def hook(self) -> bool:
        """An engine hook (a KV-transfer poll): what it saw."""
        self.log.append(("hook", list(self.requests)))
        return False


def test_the_engine_loop_takes_requests_and_polls_hooks_until_the_step_is_scheduled():
    core = FakeCore(wait_s=2.0)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    engine.hooks.append(core.hook)  # read once the first step's wait is over
    try:
        assert core.asked.wait(10)  # the loop waits for the first step's time

        async def add() -> None:
            await engine.call(core.requests.append, "arrived-meanwhile")

        asyncio.run(add())
        deadline = time.monotonic() + 10
        while len(core.seen_by_step) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert core.seen_by_step[0] == ["arrived-meanwhile"]
        # The hooks ran after the wait, before the step: what they bring (a remote prefill's
        # KV written meanwhile) joins it too.
        assert core.log[:2] == [("hook", ["arrived-meanwhile"]), ("step", ["arrived-meanwhile"])]
    finally:
        engine.shutdown()
