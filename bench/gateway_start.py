"""Gateway replica start time and idle memory, with a real model folder (SmolLM2-135M-Instruct).

Start time: from just before the `python -m gateway` process is spawned to the first
`GET /health` that answers 200 (polled every 10 ms; a fast fake decode answers the health
probe, so 200 means "ready to serve"). Idle RSS: the gateway's VmRSS after `--idle-s` seconds of
no traffic (VmHWM, the peak, recorded too). Whether the process mapped torch's library
(`libtorch` in /proc/PID/maps) is recorded as the proof of what it loaded.

Configurations: `light` (what ships: config.json read as JSON, the tokenizer on `tokenizers`,
no transformers tokenizer, no torch) and `transformers` (TANDEM_GATEWAY_TRUST_REMOTE_CODE=1
makes the gateway fall back to transformers' AutoTokenizer, as before this change: the cost
the light path removes). Targets: start <= 3 s and idle RSS < 200 MB on this CPU machine.

Writes `bench/results/gateway_start-<YYYY-MM-DD>.json` and prints a short table.
Run from the repo root: `python -m bench.gateway_start` (loopback only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `gateway`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ensure_internal_token, free_port, print_table, write_result  # noqa: E402
from bench.gateway_overhead import start  # noqa: E402

ensure_internal_token()

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_START_S, TARGET_RSS_MB = 3.0, 200.0


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """perf_counter time of the first 200 from /health."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.01)
    raise TimeoutError("gateway did not become healthy")


def one_start(config: str, decode: str, idle_s: float, log_path: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if config == "transformers":
        env["TANDEM_GATEWAY_TRUST_REMOTE_CODE"] = "1"
    port = free_port()
    args = [sys.executable, "-m", "gateway", "--model", MODEL, "--served-model-name", "smollm2"]
    args += ["--decode", decode, "--port", str(port), "--log-level", "warning"]
    with open(log_path, "ab") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=log)
        try:
            ready = wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=120)
            time.sleep(idle_s)
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            return {
                "start_s": round(ready - t0, 3),
                "idle_rss_mb": round(status_kb(proc.pid, "VmRSS") / 1024, 1),
                "peak_rss_mb": round(status_kb(proc.pid, "VmHWM") / 1024, 1),
                "maps_libtorch": "libtorch" in maps,
            }
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    starts = [r["start_s"] for r in runs]
    rss = [r["idle_rss_mb"] for r in runs]
    return {
        "start_s_median": round(statistics.median(starts), 3),
        "start_s_min": min(starts),
        "start_s_max": max(starts),
        "idle_rss_mb_median": round(statistics.median(rss), 1),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in runs),
        "maps_libtorch": any(r["maps_libtorch"] for r in runs),
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--configs", default="light,transformers")
    args = p.parse_args()
    from engine.weights import resolve_model_path

    resolve_model_path(MODEL)  # built once (from the GGUF) before anything is timed
    load_before = round(os.getloadavg()[0], 2)
    configs = args.configs.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="gateway_start-"))
    fake_args = [sys.executable, "-m", "bench.gateway_overhead", "--serve-fake-decode"]
    fake, decode = start(fake_args, dict(os.environ), workdir / "fake.log")
    results: dict[str, Any] = {}
    try:
        one_start(configs[0], decode, 0.0, workdir / "warmup.log")  # warm the page cache
        runs: dict[str, list] = {c: [] for c in configs}
        for _ in range(args.repeats):  # interleaved: load on the machine hits both alike
            for config in configs:
                runs[config].append(one_start(config, decode, args.idle_s, workdir / "gw.log"))
        results = {config: summarize(r) for config, r in runs.items()}
    finally:
        fake.terminate()
        fake.wait(timeout=20)
        shutil.rmtree(workdir, ignore_errors=True)
    config = {
        "model": MODEL,
        "repeats": args.repeats,
        "idle_s": args.idle_s,
        "configs": configs,
        "measure": "spawn of `python -m gateway` -> first GET /health 200; VmRSS after idle_s",
        "target": f"start <= {TARGET_START_S} s, idle RSS < {TARGET_RSS_MB} MB",
        "loadavg_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
    }
    path = write_result("gateway_start", config, results)
    rows = [
        (
            name,
            f"{r['start_s_median']:.2f} ({r['start_s_min']:.2f}-{r['start_s_max']:.2f})",
            f"{r['idle_rss_mb_median']:.0f}",
            f"{r['peak_rss_mb_max']:.0f}",
            str(r["maps_libtorch"]),
        )
        for name, r in results.items()
    ]
    print_table(rows, ("config", "start s (min-max)", "idle RSS MB", "peak MB", "libtorch"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
