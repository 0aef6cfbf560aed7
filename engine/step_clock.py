"""When to schedule the next step under async scheduling: as late as its launch allows.

With async scheduling the engine schedules and launches step N+1 while step N runs, then reads
N's tokens. Scheduled at once after that read, step N+2 is fixed while N+1 still runs for a
whole step: a request that arrives meanwhile (a client's next one, typically a millisecond after
its last token went out) waits for N+3, and its time to first token is three steps instead of
two. Scheduling N+2 shortly before N+1 ends takes those arrivals along, and costs nothing while
the estimate holds: N+2 cannot start on the device before N+1 ends anyway.
(`bench/closed_loop_sim.py`: issue 11's 64 streams, TTFT p50 52 -> 35 ms in the model.)

`StepClock` learns from the steps whose end the host saw, because it was waiting for their
tokens when they ended: a decode-only step's device time, the extra per prompt token of a step
with prompt chunks (moving averages), and the host's time from scheduling a step to its launch.
After reading step N (its end seen) with N+1 in flight, N+1 started when N ended, so
`schedule_at()` = N's end + N+1's predicted time - (the host's launch time + `margin_s` + twice
the predictions' mean error, so that steps whose times vary get more slack). A step
whose end the host did not see (its tokens were ready when asked for) gives no sample and no
deadline. A prediction too long costs the device an idle gap of the error; too short, the
arrivals it could have taken. Only the engine loop uses it (engine/async_engine.py), and only
with `--late-scheduling`.
"""

from __future__ import annotations

from collections import deque

ALPHA = 0.2  # weight of a new sample in the moving averages
MARGIN_S = 0.001  # scheduled this long before the launch must start, on top of the host's time
ERROR_LEADS = 2.0  # and this many mean prediction errors earlier
MAX_WAIT_S = 0.05  # never more than this ahead of the in-flight step's predicted end


class StepClock:
    def __init__(self, margin_s: float = MARGIN_S) -> None:
        self.margin_s = margin_s
        self.decode_s: float | None = None  # a decode-only step's device time
        self.prompt_token_s: float | None = None  # extra device time per prompt token
        self.launch_s: float | None = None  # the host's time from schedule() to launched
        self.error_s: float | None = None  # a prediction's mean absolute error
        self._in_flight: deque[int] = deque()  # launched, unread: their prompt tokens
        self._last_end_s: float | None = None  # the last read step's end, if seen

    def launched(self, num_prompt_tokens: int, launch_s: float) -> None:
        """A step was launched ahead, `launch_s` after its scheduling began."""
        self._in_flight.append(num_prompt_tokens)
        self.launch_s = _average(self.launch_s, launch_s)

    def read(self, end_s: float | None) -> None:
        """The oldest launched step was read: `end_s` its end if the host saw it (it was
        waiting for its tokens), else None."""
        num_prompt_tokens = self._in_flight.popleft()
        previous, self._last_end_s = self._last_end_s, end_s
        if end_s is None or previous is None:
            return
        # Launched before the previous one ended (async): it ran from that end to its own.
        duration_s = end_s - previous
        if (predicted_s := self.predicted_s(num_prompt_tokens)) is not None:
            self.error_s = _average(self.error_s, abs(duration_s - predicted_s))
        if num_prompt_tokens == 0:
            self.decode_s = _average(self.decode_s, duration_s)
        elif self.decode_s is not None:
            per_token = max(duration_s - self.decode_s, 0.0) / num_prompt_tokens
            self.prompt_token_s = _average(self.prompt_token_s, per_token)

    def predicted_s(self, num_prompt_tokens: int) -> float | None:
        if self.decode_s is None:
            return None
        if num_prompt_tokens == 0:
            return self.decode_s
        if self.prompt_token_s is None:
            return None
        return self.decode_s + num_prompt_tokens * self.prompt_token_s

    def schedule_at(self) -> float | None:
        """When to schedule the next step (time.monotonic()), or None: at once. Known only with
        one step in flight that started at a seen end."""
        if len(self._in_flight) != 1 or self._last_end_s is None or self.launch_s is None:
            return None
        duration_s = self.predicted_s(self._in_flight[0])
        if duration_s is None:
            return None
        lead_s = self.launch_s + self.margin_s + ERROR_LEADS * (self.error_s or 0.0)
        return self._last_end_s + min(max(duration_s - lead_s, 0.0), MAX_WAIT_S)

    def reset(self) -> None:
        """The pipeline was drained (a synchronous step ran): no step is in flight."""
        self._in_flight.clear()
        self._last_end_s = None


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + ALPHA * (sample - mean)
