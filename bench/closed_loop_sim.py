"""Issue 11's closed loop at 64 streams, in virtual time: the engine's own scheduler, a GPU whose
step times are a fitted model, and async scheduling's launch-ahead, so that scheduling rules can
be compared for TTFT and inter-token gaps before a GPU run.

Why: at 64 streams on one GPU, TTFT p50 sits at ~4x idle (H100 and H200, 2026-12-06), a queue of
2-3 prompts that never drains while each step admits one 512-token prompt. Rules that admit more
than one prompt in some steps trade that queue against longer steps (the ITL target), and each
trial on the GPU costs a device call. This runs `engine.scheduler.Scheduler` itself (with a
`KVCacheManager`, no model): every step it schedules is given a GPU time from the model below,
and the host loop follows `EngineCore`'s async scheduling (step N+1 is scheduled and launched
while N runs; N's tokens are read once it ends; a request that arrives meanwhile can start in
N+2 at the earliest). A finished stream is replaced by a fresh prompt `--client-ms` later
(its last token's way out to the client and the next request's way in: ~15 ms through the
gateway on an H100 machine; the first predictions assumed 1 ms, and were wrong by that).

Step time model (`--step-ms`, `--row-us`, `--prompt-token-us`): base + rows x per-row +
prompt tokens x per-token, fitted to the 2026-12-06 H100 step summaries (decode-only steps of
55 rows: 8.1 ms; 61 rows + ~507 prompt tokens: 17.7 ms). Idle TTFT is one step with the
prompt alone, plus the host's `--host-ms`.

How far to trust it (bench/README.md, 2026-12-07): it reproduces the measured effect of the cap
rules on TTFT and ITL. With a 1 ms client loop it predicted 4x the TTFT gain that
`--late-scheduling` then gave on an H100; with the measured loop (8-15 ms) it predicts 0-1 ms.
It saw none of that rule's cost at 256 streams (its step times are too regular there).

    python -m bench.closed_loop_sim [--cap 512 --backlog-steps 32] [--late-scheduling] [--table]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import percentile, write_result  # noqa: E402
from engine.config import SchedulerConfig  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request, RequestStatus  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

PLACEHOLDER = -1


# The rule measured as `--late-scheduling` on 2026-12-07 (bench/README.md) and then removed from
# the engine: it learned step times from the steps whose end the host saw and scheduled the
# next step at the in-flight one's predicted end minus the launch time, 1 ms and two mean errors.
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


class SimScheduler(Scheduler):
    """Candidate rule: once every `extra_every` steps at most, while at least
    `extra_min_waiting` prompts wait (that free slots could start), the step's prefill budget is
    raised by one cap: two prompts instead of one."""

    extra_every = 0
    extra_min_waiting = 2
    _last_extra = -(10**9)

    def _prefill_budget_while_decoding(self) -> tuple[int, int]:
        budget, chunk = super()._prefill_budget_while_decoding()
        if not self.extra_every or self.num_steps - self._last_extra < self.extra_every:
            return budget, chunk
        free_slots = max(self.config.max_num_seqs - len(self.running), 0)
        if min(len(self.waiting), free_slots) < self.extra_min_waiting:
            return budget, chunk
        self._last_extra = self.num_steps
        return budget + self.config.max_prefill_tokens_while_decoding, chunk


@dataclass
class Launched:
    end_s: float
    rows: list[Request]  # rows that sample a token in this step


@dataclass
class Stream:
    arrival_s: float
    scheduled_s: float | None = None  # first scheduled (host time)
    token_times: list[float] = field(default_factory=list)


def num_prompt_tokens(sched) -> int:
    return sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)


def step_s(num_rows: int, num_prompt: int, args) -> float:
    """The step time model: base + rows x per-row + prompt tokens x per-token."""
    return (
        args.step_ms + num_rows * args.row_us / 1e3 + num_prompt * args.prompt_token_us / 1e3
    ) / 1e3


def run(args) -> dict:
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        max_prefill_tokens_while_decoding=args.cap,
        prefill_backlog_steps=args.backlog_steps,
    )
    kv = KVCacheManager(num_blocks=args.num_blocks, block_size=16, enable_caching=False)
    sched = SimScheduler(config, kv)
    sched.extra_every = args.extra_prompt_every
    sched.extra_min_waiting = args.extra_min_waiting
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    arrivals: list[tuple[float, int]] = []  # (time, id)
    streams: dict[str, Stream] = {}
    next_id = 0

    def arrive(at_s: float) -> None:
        nonlocal next_id
        if next_id < args.num_requests:
            heapq.heappush(arrivals, (at_s, next_id))
            next_id += 1

    for _ in range(args.concurrency):
        arrive(0.0)
    host_s, gpu_free_s = 0.0, 0.0
    pending: Launched | None = None
    step_times: list[float] = []
    num_waiting: list[int] = []
    gpu_idle_s = 0.0
    clock = StepClock() if args.late_scheduling else None
    finished = 0
    while finished < args.num_requests:
        if args.late_schedule_ms and pending is not None:
            # The oracle: the in-flight step's end known exactly.
            host_s = max(host_s, pending.end_s - args.late_schedule_ms / 1e3)
        if clock is not None and (at_s := clock.schedule_at()) is not None:
            host_s = max(host_s, at_s)  # the engine's rule: arrivals meanwhile join the step
        while arrivals and arrivals[0][0] <= host_s:
            at_s, i = heapq.heappop(arrivals)
            prompt = [rng.randrange(1, 30000) for _ in range(args.input_len)]
            r = Request(f"r{i}", prompt, params, arrival_time=at_s)
            r.max_tokens = args.output_len
            sched.add_request(r)
            streams[r.request_id] = Stream(at_s)
        num_waiting.append(len(sched.waiting))
        out = sched.schedule()
        for s in out.scheduled:
            stream = streams[s.request.request_id]
            if stream.scheduled_s is None:
                stream.scheduled_s = host_s
        launched = None
        if not out.is_empty:
            start_s = max(gpu_free_s, host_s + args.host_ms / 1e3)
            gpu_idle_s += max(start_s - gpu_free_s, 0.0) if step_times else 0.0
            prompt = num_prompt_tokens(out)
            duration = step_s(len(out.scheduled), prompt, args)
            duration *= rng.uniform(1 - args.jitter, 1 + args.jitter)
            if clock is not None:
                clock.launched(prompt, args.host_ms / 1e3)
            gpu_free_s = start_s + duration
            step_times.append(duration)
            rows = [s.request for s in out.scheduled if s.reaches_end]
            for r in rows:
                r.append_output_token(PLACEHOLDER)
                r.num_placeholders += 1
            sched.update_after_step(out)
            launched = Launched(gpu_free_s, rows)
        if pending is None and launched is None:  # idle: jump to the next arrival
            host_s = max(host_s, arrivals[0][0]) if arrivals else host_s
            continue
        if pending is not None:  # read the step before: wait for it
            if clock is not None:
                clock.read(pending.end_s if host_s < pending.end_s else None)
            host_s = max(host_s, pending.end_s) + args.host_ms / 1e3
            for r in pending.rows:
                if r.is_finished:
                    continue
                r.num_placeholders -= 1
                stream = streams[r.request_id]
                stream.token_times.append(pending.end_s)
                if len(stream.token_times) >= args.output_len:
                    del r.output_token_ids[len(stream.token_times) :]
                    r.num_placeholders = 0
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    finished += 1
                    arrive(host_s + args.client_ms / 1e3)
        pending = launched
    warm = [s for i, s in enumerate(streams.values()) if i >= args.concurrency]
    ttft = sorted((s.token_times[0] - s.arrival_s) * 1e3 for s in warm)
    gaps = sorted((b - a) * 1e3 for s in warm for a, b in zip(s.token_times, s.token_times[1:]))
    total_s = max(s.token_times[-1] for s in streams.values())
    idle_ms = args.host_ms + step_s(1, args.input_len, args) * 1e3
    itl_p50 = percentile(gaps, 50)
    return {
        "output_tok_s": round(args.num_requests * args.output_len / total_s),
        "idle_ttft_ms": round(idle_ms, 1),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p50_over_idle": round(percentile(ttft, 50) / idle_ms, 2),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "itl_p50_ms": round(itl_p50, 2),
        "itl_p99_ms": round(percentile(gaps, 99), 2),
        "itl_p99_over_p50": round(percentile(gaps, 99) / itl_p50, 2),
        "queue_ms_mean": round(
            statistics.mean((s.scheduled_s - s.arrival_s) * 1e3 for s in warm), 1
        ),
        "prefill_phase_ms_mean": round(
            statistics.mean((s.token_times[0] - s.scheduled_s) * 1e3 for s in warm), 1
        ),
        "mean_waiting": round(statistics.mean(num_waiting), 2),
        "mean_step_ms": round(statistics.mean(step_times) * 1e3, 2),
        "num_steps": len(step_times),
        "gpu_idle_ms_between_steps": round(gpu_idle_s * 1e3, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=60000)
    p.add_argument("--cap", type=int, default=512, help="--max-prefill-tokens-while-decoding")
    p.add_argument("--backlog-steps", type=int, default=32, help="--prefill-backlog-steps")
    p.add_argument("--extra-prompt-every", type=int, default=0)
    p.add_argument("--extra-min-waiting", type=int, default=2)
    p.add_argument("--late-schedule-ms", type=float, default=0.0, help="oracle: exact ends")
    p.add_argument(
        "--late-scheduling", action="store_true", help="the rule measured and removed (StepClock)"
    )
    p.add_argument("--jitter", type=float, default=0.05, help="step time spread, +-fraction")
    p.add_argument("--step-ms", type=float, default=7.0)
    p.add_argument("--row-us", type=float, default=20.0)
    p.add_argument("--prompt-token-us", type=float, default=19.0)
    p.add_argument("--host-ms", type=float, default=0.5)
    p.add_argument(
        "--client-ms", type=float, default=15.0,
        help="a finished stream's last token out of the engine to its next request in it (the "
        "2026-12-07 H100 run: the client's TTFT exceeds the decode's by ~18 ms)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--table", action="store_true",
        help="bench/README.md's configurations: bench/results/closed_loop_sim-<date>.json",
    )  # fmt: skip
    args = p.parse_args()
    if not args.table:
        print(run(args))
        return
    results = {}
    for name, changes in TABLE.items():
        point = argparse.Namespace(**{**vars(args), **changes})
        results[name] = run(point)
        print(name, results[name], flush=True)
    config = {k: v for k, v in vars(args).items() if k != "table"}
    print("wrote", write_result("closed_loop_sim", {"defaults": config, "points": TABLE}, results))


# name -> the flags it changes from the defaults
_FAST_CLIENT = {"client_ms": 1.0}  # what the first predictions assumed
TABLE = {
    "c64_jitter5_shipped": {**_FAST_CLIENT},
    "c64_jitter5_late": {**_FAST_CLIENT, "late_scheduling": True},
    "c64_jitter5_oracle_2ms": {**_FAST_CLIENT, "late_schedule_ms": 2.0},
    "c64_jitter20_shipped": {**_FAST_CLIENT, "jitter": 0.2},
    "c64_jitter20_late": {**_FAST_CLIENT, "jitter": 0.2, "late_scheduling": True},
    "c256_jitter5_shipped": {**_FAST_CLIENT, "concurrency": 256},
    "c256_jitter5_late": {**_FAST_CLIENT, "concurrency": 256, "late_scheduling": True},
    "c64_backlog4": {**_FAST_CLIENT, "backlog_steps": 4},
    "c64_extra_prompt_every_50": {**_FAST_CLIENT, "extra_prompt_every": 50},
    # The client's loop as the H100 run showed it (the default now).
    "c64_client8_shipped": {"client_ms": 8.0},
    "c64_client8_late": {"client_ms": 8.0, "late_scheduling": True},
    "c64_client15_shipped": {},
    "c64_client15_late": {"late_scheduling": True},
}


if __name__ == "__main__":
    main()
