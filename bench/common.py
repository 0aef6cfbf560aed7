"""Helpers shared by the benchmarks: where they ran, on which commit, and where results go.

Every benchmark writes one JSON per day to `bench/results/<name>-<YYYY-MM-DD>.json` holding
`{"benchmark", "date", "git_commit", "machine", "config", "results"}`; the helpers here fill
the first four so each benchmark only supplies its config and figures.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def today() -> str:
    """The local date as YYYY-MM-DD (the suffix of result files)."""
    return datetime.date.today().isoformat()


def git_commit() -> str:
    """`git rev-parse --short HEAD`, plus "-dirty" when the working tree has changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU, core count, Python/torch versions, torch threads and any GPUs torch can see."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "num_cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds."""
    return sum(process_user_system_s(pid))


def process_user_system_s(pid: int) -> tuple[float, float]:
    """(utime, stime) of every thread of `pid`, in seconds: its own code and the kernel's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def write_result(
    name: str, config: dict[str, Any], results: dict[str, Any], results_dir: Path = RESULTS_DIR
) -> Path:
    """Write `<results_dir>/<name>-<date>.json` (overwriting that day's run); return its path."""
    payload = {
        "benchmark": name,
        "date": today(),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "config": config,
        "results": results,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}-{payload['date']}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    """Print rows as a plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for k, row in enumerate([header, *rows]):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))


def ensure_internal_token() -> str:
    """Benchmarks start services, which refuse to run without an internal token: make one for
    this run (inherited by every process it starts) unless the environment has one."""
    import os
    import secrets

    from engine.internal_auth import ENV_TOKEN

    return os.environ.setdefault(ENV_TOKEN, secrets.token_hex(32))


def stop_processes(procs, timeout_s: float) -> None:
    """SIGTERM every process, then wait up to `timeout_s` for each; kill (and reap) any still up."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompt_tokens_left(core) -> int:
    """Prompt tokens an engine core's requests (running and waiting) have still to compute:
    the difference across a step is the prompt tokens that step computed."""
    sched = core.scheduler
    return sum(r.num_prompt_tokens_left for r in (*sched.running, *sched.waiting))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile q (0-100) of a non-empty list: the value at index q% of the
    sorted list (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
