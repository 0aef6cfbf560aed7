"""Prefill throughput as instances report it for routing (engine/kv_events.py)."""

from __future__ import annotations

import random

from engine.kv_events import MixedRateFit

SEC_PER_TOKEN = 1 / 25_000  # a prompt token's cost
SEC_PER_STEP = 0.008  # the decode part of a step


def test_mixed_steps_give_the_prefill_rate_not_tokens_per_busy_second():
    rng = random.Random(0)
    fit = MixedRateFit()
    rate = None
    for _ in range(40):  # windows of a decode: mostly decoding, prompts now and then
        steps = rng.randint(20, 60)
        tokens = rng.choice([0, 0, 512, 3000, 6000])
        busy = tokens * SEC_PER_TOKEN + steps * SEC_PER_STEP
        busy *= 1 + rng.uniform(-0.03, 0.03)  # timing noise
        rate = fit.add(tokens, steps, busy) or rate
    assert rate is not None and abs(rate - 25_000) / 25_000 < 0.05
    # What the busy-time estimator would have said: several times too low.
    assert 3000 / (3000 * SEC_PER_TOKEN + 40 * SEC_PER_STEP) < 0.5 * rate


def test_no_estimate_before_both_kinds_of_window_were_seen():
    fit = MixedRateFit()
    for _ in range(10):  # decode only: nothing says what a prompt token costs
        assert fit.add(0, 50, 50 * SEC_PER_STEP) is None
    assert fit.add(0, 0, 0.5) is None  # no step: not a window of work
    rates = [fit.add(2000, 50, 2000 * SEC_PER_TOKEN + 50 * SEC_PER_STEP) for _ in range(2)]
    assert abs(rates[-1] - 25_000) < 100
