"""Where a gateway process spends its CPU: py-spy samples of it under load, sorted into stages.

`start_profile(pid, duration_s)` runs `py-spy record --threads --format raw` on the process while
the caller keeps the load going; `finish` returns each stage's share of the samples.
`bench/gateway_overhead.py` multiplies the shares by the measured CPU per request to get
milliseconds per request per stage.

py-spy samples only threads that are running (their OS state), so samples are proportional to
CPU time; work without Python frames shows under the innermost Python frame above it (the
Rust tokenizer under `encode_bounded`, uvloop's own I/O under the loop's run call, gRPC's
poller thread, named `_poll_wrapper`, as a whole). Waking a loop or a worker is CPU too: a
sample in `select` or an idle pool worker is the thread running on its way in or out of a wait.

A sample belongs to the stage of its innermost frame that names one (`STAGES`, first match from
the leaf up), so a Redis reply parsed inside the quota call counts as `edge_quota_redis`, and
`json.dumps` inside the response as `response`. Frames that only say "event loop" (asyncio,
selectors) count only when nothing more specific is on the stack.

py-spy counts a thread as running when the OS says it is runnable, which includes waiting for
a core: just woken (gRPC's poller thread, the loop returning from epoll) or preempted inside a
write that woke its peer on this 2-core machine. Such stages read high: on 2026-12-03 the
poller thread drew 3-7x the samples its CPU time (schedstat) accounts for. With `thread_cpu`
(each thread's CPU over the profile window, `thread_cpu_s` before and after) `shares` weighs
every thread's samples to that thread's CPU, and gives the CPU of threads py-spy does not see
(grpc's C threads: event_engine, timers) to `grpc` or `other_threads`. Within one thread the
bias stays (the main thread's samples at wake-ups and writes still read high).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# stage, then substrings of a frame "function (path:line)"; checked in this order for each frame.
_TABLE = """
access_log         gateway/access_log.py /logging/
metrics            prometheus_client/ gateway/metrics.py
edge_auth          gateway/allowlist.py gateway/auth.py gateway/edge.py
edge_quota_redis   gateway/quota gateway/accounting.py /redis/
validation         pydantic gateway/protocol.py gateway/offload.py gateway/json_scan
template_tokenize  chat_template jinja2/ <template> light_tokenizer tokenizers tokenize_chat
                   encode_bounded transformers/ gateway/chat_tools.py
routing            gateway/router.py gateway/kv_router.py gateway/index.py block_hash
                   gateway/registry.py gateway/kv_watch.py gateway/cost_model.py
grpc               grpc/ grpc_ protos/ google/protobuf params_proto gateway/clients.py
                   gateway/mux.py
detokenize         engine/output_processor detokeniz engine/outputs gateway/dispatch.py
response           gateway/serving.py gateway/chat_output starlette/responses /json/ orjson
                   gateway/routes/
preprocess_other   gateway/preprocess.py engine/sampling_params gateway/structured
                   gateway/extra_params
http               h11 httptools uvicorn/
framework          fastapi/ starlette/ anyio/
thread_handoff     concurrent/futures /threading.py /queue.py
"""
GENERIC = ("event_loop", ("/asyncio/", "/selectors.py", "/uvloop/", "<module>", "runpy"))


def _parse_table(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    stages: dict[str, list[str]] = {}
    last = ""
    for line in text.strip().splitlines():
        if not line.startswith(" "):
            last, line = line.split(maxsplit=1)
        stages.setdefault(last, []).extend(line.split())
    return tuple((stage, tuple(needles)) for stage, needles in stages.items())


STAGES = _parse_table(_TABLE)


def stage_of(stack: list[str]) -> str:
    """`stack`: frames root first (py-spy's order), each `function (path:line)` with the path
    relative to its import root; paths are matched with a leading "/"."""
    if stack and "_poll_wrapper" in stack[0]:  # the thread's name (--threads): gRPC's poller
        return "grpc"
    frames = [f.replace(" (", " (/", 1) for f in stack]
    for frame in reversed(frames):
        for stage, needles in STAGES:
            if any(n in frame for n in needles):
                return stage
    if any(n in frame for frame in frames for n in GENERIC[1]):
        return GENERIC[0]
    return "other"


def samples(raw: str) -> Iterator[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output → (stack, root first; number of samples) per line."""
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


_THREAD = re.compile(r"thread \((\d+)\)")  # py-spy --threads: "thread (TID): NAME", TID the OS's
GRPC_THREADS = ("event_engine", "grpc_global_tim", "lifeguard", "default-executo", "resolver")


def shares(
    raw: str, thread_cpu: dict[str, tuple[str, float]] | None = None
) -> tuple[dict[str, float], int]:
    """py-spy's raw (collapsed) output → ({stage: share}, number of samples). The share is of
    the samples, or with `thread_cpu` ({tid: (thread name, CPU s)}) of the CPU: a thread's
    samples are weighed to its CPU, and threads without samples count under their own stage."""
    counts: dict[str, Counter[str]] = {}
    for stack, count in samples(raw):
        match = _THREAD.match(stack[0]) if stack else None
        tid = match.group(1) if match else ""
        counts.setdefault(tid, Counter())[stage_of(stack)] += count
    num_samples = sum(sum(c.values()) for c in counts.values())
    weighted: Counter[str] = Counter()
    for tid, stages in counts.items():
        weight = 1.0
        if thread_cpu is not None:
            weight = thread_cpu.get(tid, ("", 0.0))[1] / sum(stages.values())
        for stage, count in stages.items():
            weighted[stage] += count * weight
    for tid, (name, cpu_s) in (thread_cpu or {}).items():
        if tid not in counts:
            weighted["grpc" if name in GRPC_THREADS else "other_threads"] += cpu_s
    total = sum(weighted.values())
    return {s: n / total for s, n in weighted.most_common()}, num_samples


def thread_cpu_s(pid: int) -> dict[str, tuple[str, float]]:
    """{tid: (name, CPU s so far)} of every thread of `pid` (schedstat: ns, not clock ticks)."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        threads[tid] = (name, cpu_ns / 1e9)
    return threads


def thread_cpu_between(
    before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]
) -> dict[str, tuple[str, float]]:
    """Each thread's CPU between two `thread_cpu_s` (a thread new since `before` from 0)."""
    return {
        tid: (name, cpu_s - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu_s) in after.items()
    }


def py_spy() -> str | None:
    found = Path(sys.executable).with_name("py-spy")
    return str(found) if found.exists() else shutil.which("py-spy")


def start_profile(pid: int, duration_s: float, rate_hz: int = 200) -> subprocess.Popen:
    """Start sampling `pid` now, for `duration_s` (the caller keeps the load running meanwhile);
    `finish(proc)` returns the shares once it is done."""
    binary = py_spy()
    assert binary, "py-spy not found (pip install py-spy)"
    tmp = tempfile.mkdtemp(prefix="gateway_stages-")
    out = Path(tmp) / "stacks.txt"
    args = [binary, "record", "--pid", str(pid), "--duration", str(int(duration_s))]
    args += ["--rate", str(rate_hz), "--threads", "--nonblocking", "--format", "raw"]
    args += ["--output", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.output_path = out  # type: ignore[attr-defined]
    return proc


def start_native_profile(pid: int, duration_s: float, rate_hz: int = 999):
    """`perf record` of `pid`'s on-CPU time for `duration_s`, or None without perf. Unlike
    py-spy's samples of runnable threads, a cpu-clock sample is taken only while the process
    runs: a write that wakes its peer and is then preempted costs no samples here. `finish_native`
    gives the shares by shared object (the interpreter, the kernel, tokenizers, ...)."""
    binary = shutil.which("perf")
    if binary is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="gateway_native-")) / "perf.data"
    args = [binary, "record", "-q", "-e", "cpu-clock", "-F", str(rate_hz), "-p", str(pid)]
    args += ["-o", str(out), "--", "sleep", str(int(duration_s))]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.output_path = out  # type: ignore[attr-defined]
    return proc


_DSO_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)")


def finish_native(proc: subprocess.Popen) -> dict[str, float]:
    """Wait for `perf record`; {shared object: share of the on-CPU samples}, largest first."""
    _, err = proc.communicate(timeout=120)
    out: Path = proc.output_path  # type: ignore[attr-defined]
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"perf record failed: {err.decode()[-500:]}")
        report = subprocess.run(
            ["perf", "report", "-i", str(out), "--stdio", "--sort", "dso", "--no-children",
             "-g", "none"],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    shares = {}
    for line in report.stdout.splitlines():
        match = _DSO_LINE.match(line)
        if match and not line.startswith("#"):
            shares[match.group(2)] = round(float(match.group(1)) / 100, 4)
    return shares


def finish(
    proc: subprocess.Popen, thread_cpu: dict[str, tuple[str, float]] | None = None
) -> tuple[dict[str, float], int]:
    """Wait for py-spy; the stage shares (of the CPU with `thread_cpu`: see `shares`)."""
    _, err = proc.communicate(timeout=120)
    out: Path = proc.output_path  # type: ignore[attr-defined]
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")
    try:
        return shares(out.read_text(), thread_cpu)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
