"""Per-step timing of an engine: where a serving or offline run's time goes, step by step.

Off by default. `StepTrace(core).install()` wraps the engine's step, its scheduler's `schedule`
and its runner's `execute` / `launch_decode` / `launch_mixed`; every runner call becomes one
row (its kind, sequences, tokens, host time) with, on CUDA, two events around the GPU work it
enqueues; every step also notes the requests running and waiting as it begins, and each
request's first token notes its phases (queued, first scheduled, first token out). The
GPU's idle time between two steps is the gap from one row's end event to the next one's start
event (zero while the GPU still runs the step before): the host's share of a step that the GPU
waited for. `summarize` turns rows (live or read back from JSON) into totals over a window.

Users: `bench/gpu_engine.py` (the offline job), and a service started with
`TANDEM_STEP_TRACE_DIR=<dir>`, which writes `<dir>/<instance id>.json` as it begins to stop
(`bench/serve_gpu.py` reads them back for each point's window).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

KINDS = ("decode_only", "mixed", "async_decode", "async_mixed")
MAX_ROWS = 2_000_000  # a long-lived service stops recording there (and says so in the file)


class StepTrace:
    def __init__(self, core: Any):
        self.core = core
        self.cuda = core.runner.device.type == "cuda"
        # (kind, sequences, tokens, host start, host s, start event, end event)
        self.calls: list[tuple[str, int, int, float, float, Any, Any]] = []
        # (host start, step s, schedule s, requests running, requests waiting, free KV blocks)
        self.steps: list[tuple[float, float, float, int, int, int]] = []
        self.dropped = 0
        self._schedule_s = 0.0
        # (queued, first scheduled, first token out of the engine) per request, in order of
        # their first tokens (time.monotonic(); on Linux the clock of `perf_counter` too)
        self.requests: list[tuple[float, float, float]] = []
        self._first_seen: set[str] = set()

    # ---- recording -------------------------------------------------------------------------
    def install(self) -> StepTrace:
        runner, sched, core = self.core.runner, self.core.scheduler, self.core
        execute, launch, launch_mixed, schedule, step = (
            runner.execute,
            runner.launch_decode,
            runner.launch_mixed,
            sched.schedule,
            core.step,
        )

        def traced_execute(s, kv):
            decode = max(x.num_new_tokens for x in s.scheduled) == 1
            return self._call("decode_only" if decode else "mixed", s, execute, s, kv)

        def traced_launch(s, kv, prev):  # host time only: the GPU runs on
            return self._call("async_decode", s, launch, s, kv, prev)

        def traced_launch_mixed(s, kv, prev):
            return self._call("async_mixed", s, launch_mixed, s, kv, prev)

        def traced_schedule():
            t = time.perf_counter()
            try:
                return schedule()
            finally:
                self._schedule_s += time.perf_counter() - t

        def traced_step():
            t, self._schedule_s = time.perf_counter(), 0.0
            # Requests in the engine as the step begins: running (in the batch, decoding or
            # prefilling) and waiting (queued for a slot, for prefill budget or for blocks),
            # and the KV blocks free for them (evictable prefix-cache blocks count as free).
            running, waiting = len(sched.running), len(sched.waiting)
            free_blocks = core.kv.num_free_blocks
            try:
                outputs = step()
                self._first_tokens(outputs)
                return outputs
            finally:
                if len(self.steps) < MAX_ROWS:
                    step_s = time.perf_counter() - t
                    row = (t, step_s, self._schedule_s, running, waiting, free_blocks)
                    self.steps.append(row)

        runner.execute, runner.launch_decode = traced_execute, traced_launch
        runner.launch_mixed = traced_launch_mixed
        sched.schedule, core.step = traced_schedule, traced_step
        return self

    def _first_tokens(self, outputs) -> None:
        """The phases of each request whose first token this step gave out: what
        `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds` sum, per
        request, so that a window's medians (e.g. past a closed loop's first waves) can be
        read apart from its means."""
        if len(self._first_seen) >= MAX_ROWS:  # a long-lived service stops recording there
            return
        now = time.monotonic()
        requests = self.core.scheduler.requests
        for out in outputs:
            rid = out.request_id
            if not out.new_token_ids or rid in self._first_seen:
                continue
            self._first_seen.add(rid)
            r = requests.get(rid)  # gone if it finished with its first token
            if r is None or r.queued_time is None or r.first_scheduled_time is None:
                continue
            self.requests.append((r.queued_time, r.first_scheduled_time, now))

    def remove(self) -> None:
        """The classes' own methods again."""
        del self.core.runner.execute, self.core.runner.launch_decode, self.core.runner.launch_mixed
        del self.core.scheduler.schedule, self.core.step

    def clear(self) -> None:
        self.calls.clear()
        self.steps.clear()
        self.requests.clear()
        self.dropped = 0

    def _call(self, kind: str, sched, fn, *args):
        if len(self.calls) >= MAX_ROWS:
            self.dropped += 1
            return fn(*args)
        new = [s.num_new_tokens for s in sched.scheduled]
        e0 = e1 = None
        if self.cuda:
            import torch

            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        out = fn(*args)
        host_s = time.perf_counter() - t
        if e1 is not None:
            e1.record()
        self.calls.append((kind, len(new), sum(new), t, host_s, e0, e1))
        return out

    # ---- reading ---------------------------------------------------------------------------
    def rows(self) -> dict:
        """Plain numbers (synchronizes the GPU): GPU times in ms from the first call's start.
        Safe while the engine runs: the rows so far (each appended after its end event)."""
        recorded, steps = self.calls[: len(self.calls)], self.steps[: len(self.steps)]
        calls = []
        ref = recorded[0][5] if recorded and self.cuda else None
        if ref is not None:
            import torch

            torch.cuda.synchronize()
        for kind, seqs, tokens, t, host_s, e0, e1 in recorded:
            row = {"kind": kind, "seqs": seqs, "tokens": tokens, "t": t, "host_s": host_s}
            if ref is not None:
                row["gpu_start_ms"] = ref.elapsed_time(e0)
                row["gpu_end_ms"] = ref.elapsed_time(e1)
            calls.append(row)
        steps = [
            {"t": t, "step_s": s, "schedule_s": sc, "running": run, "waiting": wait, "free": free}
            for t, s, sc, run, wait, free in steps
        ]
        requests = [
            {"queued": q, "scheduled": sc, "first_token": f}
            for q, sc, f in self.requests[: len(self.requests)]
        ]
        return {"calls": calls, "steps": steps, "requests": requests, "dropped_calls": self.dropped}

    def write(self, path: Path) -> None:
        """Whole or not at all (a process killed while writing leaves the last file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rows()) + "\n")
        tmp.replace(path)


def summarize(
    rows: dict, t_from: float = float("-inf"), t_to: float = float("inf"), skip_first: int = 0
) -> dict:
    """Totals of the calls and steps that started in [t_from, t_to] (`time.perf_counter`, the
    host's monotonic clock, shared by the processes of one machine), and the medians of the
    phases of the requests queued in it, all of them and past the first `skip_first` (a closed
    loop's first waves queue behind each other: their waits dominate the means)."""
    calls = [c for c in rows["calls"] if t_from <= c["t"] <= t_to]
    steps = [s for s in rows["steps"] if t_from <= s["t"] <= t_to]
    requests = sorted(
        (r for r in rows.get("requests", []) if t_from <= r["queued"] <= t_to),
        key=lambda r: r["queued"],
    )
    gpu = bool(calls) and "gpu_start_ms" in calls[0]
    out: dict[str, Any] = {
        "engine_steps": len(steps),
        "step_s": sum(s["step_s"] for s in steps),
        # Requests in the engine, weighted by each step's time (Little's law against the
        # request rate gives the time a request spends inside the engine).
        "mean_running": _time_weighted(steps, "running"),
        "mean_waiting": _time_weighted(steps, "waiting"),
        # KV blocks free as steps begin, and as steps begin with requests waiting: a queue
        # beside few free blocks waits for blocks, beside many for budget or slots.
        "mean_free_blocks": _time_weighted(steps, "free"),
        "mean_free_blocks_while_waiting": _time_weighted(
            [s for s in steps if s.get("waiting")], "free"
        ),
        "schedule_s": sum(s["schedule_s"] for s in steps),
        "runner_host_s": sum(c["host_s"] for c in calls),
        "dropped_calls": rows.get("dropped_calls", 0),
        "first_token_phases_p50_ms": _phases_p50_ms(requests),
        "first_token_phases_p50_ms_past_first": _phases_p50_ms(requests[skip_first:]),
    }
    for kind in KINDS:
        mine = [c for c in calls if c["kind"] == kind]
        out[kind] = {
            "steps": len(mine),
            "execute_s": sum(c["host_s"] for c in mine),
            "mean_seqs": statistics.mean(c["seqs"] for c in mine) if mine else 0,
            "mean_tokens": statistics.mean(c["tokens"] for c in mine) if mine else 0,
            "tokens": sum(c["tokens"] for c in mine),
        }
        if gpu:
            spans = (c["gpu_end_ms"] - c["gpu_start_ms"] for c in mine)
            out[kind]["gpu_span_s"] = sum(spans) / 1e3
    if gpu:
        idle: dict[str, float] = {}  # by (previous, this) kind
        for before, after in zip(calls, calls[1:]):
            key = f"{before['kind']}->{after['kind']}"
            gap = max(0.0, after["gpu_start_ms"] - before["gpu_end_ms"]) / 1e3
            idle[key] = idle.get(key, 0.0) + gap
        out["gpu_idle_between_steps_s"] = sum(idle.values())
        out["gpu_idle_between_steps_by_kind_s"] = idle
        if calls:
            out["gpu_first_to_last_s"] = (calls[-1]["gpu_end_ms"] - calls[0]["gpu_start_ms"]) / 1e3
    return out


def _time_weighted(steps: list[dict], key: str) -> float:
    total = sum(s["step_s"] for s in steps)
    if not total or not steps or key not in steps[0]:
        return 0.0
    return sum(s[key] * s["step_s"] for s in steps) / total


def _phases_p50_ms(requests: list[dict]) -> dict:
    """Medians, in ms: queued -> first scheduled, first scheduled -> first token, and their
    sum (the engine's share of TTFT), with the number of requests."""
    if not requests:
        return {"requests": 0}
    queue = [r["scheduled"] - r["queued"] for r in requests]
    prefill = [r["first_token"] - r["scheduled"] for r in requests]
    total = [r["first_token"] - r["queued"] for r in requests]
    return {
        "requests": len(requests),
        "queue": round(statistics.median(queue) * 1e3, 2),
        "prefill": round(statistics.median(prefill) * 1e3, 2),
        "engine_ttft": round(statistics.median(total) * 1e3, 2),
    }
