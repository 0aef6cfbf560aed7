"""The server against the engine on the H200: `tandem bench serve` through `tandem serve` vs the
offline engine on the same workload, in one run (issue "The server as fast as the engine").

Workload: Qwen3-8B shape, dummy bf16 weights, the real Qwen vocabulary, N random prompts of 512
tokens in / 128 out with ignore_eos, `--max-num-seqs 256 --max-num-batched-tokens 8192`.
1. offline: `LLM.generate` on the same token counts (the engine's own figure);
2. for each mode, 1P+1D (both on the one GPU) and colocated (`--num-prefill 0`): start
   `tandem serve`, then `tandem bench serve` at each concurrency; record output tok/s, errors,
   TTFT and ITL percentiles next to the offline figure.

    TRITON_INTERPRET=0 python -m bench.serve_gpu --out-dir bench/results
Writes `serve_gpu-<date>.json` ({"offline_output_tok_s", "modes": {mode: {concurrency: ...}}})
and the per-point bench results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.common import print_table, process_cpu_s, write_result
from bench.structured_output import QWEN3_8B, make_model_dir
from engine import stack_sampler
from engine.serving import DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING, prefill_backlog_steps
from engine.step_trace import KINDS, summarize

POINT_TIMEOUT_S = 240
ENGINE_FLAGS = [
    "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "1024",
    "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
]  # fmt: skip


# --compare-NAME: the concurrencies to run again on a colocated server that differs so
COMPARES = {
    "uncapped": "without the prefill cap",
    "fixed-cap": "without --prefill-backlog-steps",
    "sync-sampling": "with --no-async-sampling (sampled: --bench-flags='--temperature 0.8')",
    "sync-mixed": "with --no-async-mixed-steps (steps with prompt chunks run synchronously)",
    "decode-graphs-only": "with CUDA graphs for decode-only steps alone, no piecewise graphs",
}
BENCH_FLAGS: list[str] = []  # more `tandem bench serve` flags for every point (--bench-flags)


def offline_tok_s(path: Path, n: int) -> tuple[float, dict]:
    """The offline engine's output tok/s on this workload, and its steps' `summarize`."""
    code = (
        "import json, time, torch, random\n"
        "from engine import LLM, SamplingParams\n"
        "from engine.step_trace import StepTrace, summarize\n"
        f"llm = LLM({str(path)!r}, load_format='dummy', dtype='bfloat16', max_model_len=1024,"
        " max_num_seqs=256, max_num_batched_tokens=8192, skip_tokenizer_init=True)\n"
        "rng = random.Random(3)\n"
        f"prompts = [{{'prompt_token_ids': [rng.randrange(150000) for _ in range(512)]}}"
        f" for _ in range({n})]\n"
        # Warm-up prompts of their own: the timed ones must not find their prefix cached.
        "warm = [{'prompt_token_ids': [rng.randrange(150000) for _ in range(512)]}"
        " for _ in range(64)]\n"
        "llm.generate(warm, SamplingParams(temperature=0, max_tokens=8))\n"
        "p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)\n"
        "trace = StepTrace(llm.engine).install()\n"
        "torch.cuda.synchronize(); t = time.perf_counter()\n"
        "outs = llm.generate(prompts, p)\n"
        "torch.cuda.synchronize(); wall = time.perf_counter() - t\n"
        "print('OFFLINE', sum(len(o.outputs[0].token_ids) for o in outs) / wall)\n"
        "print('STEPS', json.dumps(summarize(trace.rows())))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines() if " " in ln)
    return float(lines["OFFLINE"]), json.loads(lines["STEPS"])


def start_serve(
    path: Path,
    num_prefill: int,
    port: int,
    extra: list[str] | None = None,
    trace_dir: Path | None = None,
    stacks_dir: Path | None = None,
    triton_cache: Path | None = None,
) -> tuple[subprocess.Popen, list[str]]:
    """`tandem serve` with this bench's flags and `num_prefill`, or with `extra` instead;
    `trace_dir`: its services write their step traces there when they stop; `stacks_dir`:
    their stack samples (`engine/stack_sampler.py`); `triton_cache`: their TRITON_CACHE_DIR."""
    flags = extra if extra is not None else [*ENGINE_FLAGS, "--num-prefill", str(num_prefill)]
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(path), *flags, "--port", str(port)]
    env = dict(os.environ)
    if triton_cache is not None:
        env["TRITON_CACHE_DIR"] = str(triton_cache)
    if trace_dir is not None:
        env["TANDEM_STEP_TRACE_DIR"] = str(trace_dir)
    if stacks_dir is not None:
        env["TANDEM_STACK_SAMPLE_DIR"] = str(stacks_dir)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    lines: list[str] = []
    deadline = time.monotonic() + 400
    # With --metrics-port, the line after "Tandem is serving" names the metrics endpoints.
    last = "Metrics: " if "--metrics-port" in cmd else "Tandem is serving"
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(last):
            # Keep reading the services' log (a full pipe would block them); kept for failures.
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, lines
        if time.monotonic() > deadline:
            break
    stop_serve(proc)
    raise RuntimeError("tandem serve did not come up:\n" + "".join(lines[-40:]))


def metrics_urls(log: list[str]) -> dict[str, str]:
    """{"gateway": url, "decode 0": url, ...} from `tandem serve`'s "Metrics: " line."""
    line = next(ln for ln in log if ln.startswith("Metrics: "))
    pairs = (item.rsplit(" ", 1) for item in line.removeprefix("Metrics: ").strip().split(", "))
    return {name: url for name, url in pairs}


TTFT, E2E = "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"
# Parts of the TTFT: the gateway's arrival to ready-for-a-decode, a decode's WAITING time and
# first-scheduled-to-first-token (vLLM's queue and prefill phases; local prefills only), and a
# remote prefill's parts at the decode (blocks reserved, the Prefill call, that call's transit
# beyond the prefill's own time).
PHASES = {
    "gateway_prepare": "tandem:request_prepare_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "remote_setup": "tandem:remote_prefill_setup_seconds",
    "remote_rpc": "tandem:remote_prefill_rpc_seconds",
    "remote_transit": "tandem:remote_prefill_transit_seconds",
}


def histogram_totals(urls: dict[str, str]) -> dict[str, dict[str, tuple[float, float]]]:
    """One scrape of each process: {TTFT | E2E: {process: (sum s, count)}}. The gateway's TTFT
    runs from its request's arrival to its first chunk, a service's from its gRPC call to its
    first token; the client's own TTFT includes both, so the differences are each layer's
    share. E2E: the gateway's, to the last byte (the services keep none). And each of
    `PHASES`' histograms where a process has it."""
    out: dict[str, dict[str, tuple[float, float]]] = {TTFT: {}, E2E: {}}
    out.update({name: {} for name in PHASES.values()})
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name not in out:
                continue
            total, count = 0.0, 0.0
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
            out[family.name][name] = (total, count)
    return out


def mean_ms_by_layer(before: dict, after: dict, client_mean_ms: float | None) -> dict:
    """A histogram's mean over a point as the client (unless None) and each process saw it,
    from its {process: (sum s, count)} before and after the point."""
    out = {} if client_mean_ms is None else {"client": client_mean_ms}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:  # a prefill answers no streams: no TTFT of its own
            out[name] = 1e3 * (total - t0) / (count - c0)
    return out


def count_by_layer(before: dict, after: dict) -> dict:
    """A histogram's observations over a point, per process (where it has any): how many
    requests a phase's mean is over (1P+1D: the decode's queue and prefill phases count only
    the prompts it prefilled itself, after remote prefills that failed or timed out)."""
    counts = {name: count - before.get(name, (0.0, 0.0))[1] for name, (_, count) in after.items()}
    return {name: int(n) for name, n in counts.items() if n > 0}


def route_lines_after(path: Path, start: int, expected: int, timeout_s: float = 5.0) -> list[str]:
    """The route log's lines past its first `start`, once `expected` of them are there (they land
    in batches up to 0.1 s after their requests, gateway/bookkeeping.py), or what is there after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines()[start:] if path.exists() else []
        if len(lines) >= expected or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def route_ttft_split_ms(lines: list[str], skip: int) -> dict:
    """Medians (ms) over a point's route-log lines past the first `skip` (the closed loop's
    first waves, in the order requests finished) of the gateway's TTFT for its call (its call to
    the decode -> first token), the decode's own part of it (`decode_ttft_s`) and the rest: the
    way there and back, transport and both event loops."""
    rows = [json.loads(x) for x in lines[skip:] if x.strip()]
    if not rows:
        return {}
    return {
        "requests": len(rows),
        "gateway_call": 1e3 * statistics.median(r["measured_ttft_s"] for r in rows),
        "decode": 1e3 * statistics.median(r["decode_ttft_s"] for r in rows),
        "transit": 1e3 * statistics.median(r["measured_ttft_s"] - r["decode_ttft_s"] for r in rows),
    }


def gateway_pid(serve: subprocess.Popen) -> int | None:
    """The gateway process of a `tandem serve` (its process group; `tandem.cli gateway`)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            pgrp = int((entry / "stat").read_text().rpartition(")")[2].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if pgrp == serve.pid and b"gateway" in argv[:4]:
            return int(entry.name)
    return None


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM to `tandem serve` alone, which stops its children once each (a second SIGTERM
    stops a draining service at once, before it writes its step trace); then SIGKILL to
    whatever is left of its process group."""
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        print("tandem serve did not stop within 120 s: SIGKILL to its group", flush=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: nothing left
        pass
    proc.wait()


def ttft_p50_by_wave_ms(r: dict) -> list[float]:
    """Median TTFT of each window of `max_concurrency` requests, in request order: how far the
    synchronized start (every client sends at t=0) still shows in later requests."""
    ttfts, c = r.get("ttfts") or [], r["max_concurrency"]
    return [1e3 * statistics.median(ttfts[i : i + c]) for i in range(0, len(ttfts), c)]


def point_figures(r: dict, offline: float) -> dict:
    return {
        "ttft_p50_by_wave_ms": ttft_p50_by_wave_ms(r),
        "output_tok_s": r["output_throughput"],
        "ratio_to_offline": r["output_throughput"] / offline if offline else None,
        "errors": r["failed"],
        "ttft_p50_ms": r["median_ttft_ms"],
        "ttft_p99_ms": r["p99_ttft_ms"],
        "itl_p50_ms": r["median_itl_ms"],
        "itl_p99_ms": r["p99_itl_ms"],
        "itl_p99_over_p50": r["p99_itl_ms"] / r["median_itl_ms"] if r["median_itl_ms"] else None,
        "tpot_p50_ms": r["median_tpot_ms"],
    }


def steps_line(st: dict) -> str:
    """One line of a `summarize`: steps, GPU idle between them, and each kind's shape."""
    kinds = " ".join(
        f"{k}={st[k]['steps']}x{st[k]['mean_seqs']:.0f}seq/{st[k]['mean_tokens']:.0f}tok"
        f"/{st[k].get('gpu_span_s', 0):.1f}s"
        for k in KINDS
    )
    idle = st.get("gpu_idle_between_steps_s", 0.0)
    inside = (
        f"running {st.get('mean_running', 0):.0f} waiting {st.get('mean_waiting', 0):.0f} "
        f"free blocks {st.get('mean_free_blocks', 0):.0f} "
        f"({st.get('mean_free_blocks_while_waiting', 0):.0f} while waiting)"
    )
    phases = st.get("first_token_phases_p50_ms_past_first", {})
    first = (
        f" first token p50 past 2 waves: queue {phases['queue']} ms prefill {phases['prefill']} ms"
        if phases.get("requests")
        else ""
    )
    return (
        f"steps {st['engine_steps']} step_s {st['step_s']:.1f} gpu_idle {idle:.2f}s {inside} "
        f"{kinds}{first}"
    )


def kernels_built_since(cache: Path, before: set[str]) -> list[str]:
    """The kernels Triton compiled into `cache` (a TRITON_CACHE_DIR) since its entries were
    `before`, sorted: one name per new entry (its compiled files are named after the kernel)."""
    names = []
    for entry in set(os.listdir(cache)) - before:
        names += {f.split(".")[0] for f in os.listdir(cache / entry) if not f.startswith("__")}
    return sorted(names)


def bench_point(
    path: Path, port: int, concurrency: int, n: int, out_dir: Path, label: str, seed: int
):
    """`seed`: a different one for every point of a server, or the prompts of the earlier points
    come back and find their KV in the prefix cache (no prefill: throughput and TTFT inflated,
    as every point after the first was before 2026-12-02)."""
    name = f"{label}-c{concurrency}.json"
    cmd = [
        sys.executable, "-m", "tandem.cli", "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--model", str(path),
        "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "128",
        "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency",
        str(concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
        "--save-detailed", *BENCH_FLAGS,
    ]  # fmt: skip
    t = time.monotonic()
    subprocess.run(cmd, check=True, timeout=POINT_TIMEOUT_S, capture_output=True, text=True)
    print(f"{label} c={concurrency}: {time.monotonic() - t:.0f} s", flush=True)
    # Per-request TTFTs and latencies kept (in request order: waves show as a period of
    # `concurrency`); the token gaps and texts dropped (megabytes per point).
    result = json.loads((out_dir / name).read_text())
    for key in ("itls", "generated_texts"):
        result.pop(key, None)
    (out_dir / name).write_text(json.dumps(result) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--concurrency", default="64,256,512")
    ap.add_argument(
        "--modes", default="pd,colocated",
        help="pd and/or colocated, each with its own concurrencies after a colon if given: "
        "'pd,colocated:512' or 'colocated:64+256'",
    )  # fmt: skip
    ap.add_argument("--no-offline", dest="offline", action="store_false")
    ap.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="the services' per-request prompt chunk (online serving; 0: the whole budget)",
    )
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=8192,
        help="the services' token budget per step (the issue's workload: 8192)",
    )  # fmt: skip
    ap.add_argument(
        "--max-prefill-tokens-while-decoding", type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING,
        help="the services' prompt tokens per step beside decodes (0: the whole budget; "
        "default: the services' own)",
    )  # fmt: skip
    ap.add_argument(
        "--prefill-backlog-steps", type=int, default=None,
        help="with the cap above: raise it to 1/N of the waiting prompt tokens (0: fixed cap; "
        "default: the services' own)",
    )  # fmt: skip
    ap.add_argument(
        "--idle-prompts", type=int, default=20,
        help="prompts sent one at a time first, for each mode's idle TTFT (0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--stack-samples", action="store_true",
        help="sample the services' thread stacks (engine/stack_sampler.py) over each server's "
        "life: summaries in modes[mode]['stacks'], raw files beside the result",
    )  # fmt: skip
    ap.add_argument(
        "--cold-triton-cache", action="store_true",
        help="give each server an empty TRITON_CACHE_DIR (a fresh machine's) and record the "
        "kernels compiled after it was serving (modes[mode]['kernels_built_while_serving'])",
    )  # fmt: skip
    ap.add_argument(
        "--gateway-flags", default="",
        help="extra `tandem serve` flags for its gateway, e.g. '--shed-busy-fraction 0'",
    )  # fmt: skip
    ap.add_argument(
        "--bench-flags", default="",
        help="more `tandem bench serve` flags for every point, e.g. --bench-flags='--temperature "
        "0.8 --top-p 0.95' (sampled traffic; the offline job stays greedy)",
    )  # fmt: skip
    for name, what in COMPARES.items():
        ap.add_argument(
            f"--compare-{name}", default="",
            help=f"concurrencies to run again on a colocated server {what} "
            f"(modes['colocated_{name.replace('-', '_')}']), e.g. 256",
        )  # fmt: skip
    args = ap.parse_args()
    i = ENGINE_FLAGS.index("--max-num-batched-tokens")
    ENGINE_FLAGS[i + 1] = str(args.max_num_batched_tokens)
    if args.long_prefill_token_threshold:
        ENGINE_FLAGS.extend(
            ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
        )
    ENGINE_FLAGS.extend(args.gateway_flags.split())
    BENCH_FLAGS.extend(args.bench_flags.split())
    # Every flag explicit (0 included): the recorded config reads the same whatever the
    # services' defaults become.
    uncapped_flags = [*ENGINE_FLAGS, "--max-prefill-tokens-while-decoding", "0"]
    ENGINE_FLAGS.extend(
        ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    )
    fixed_cap_flags = [*ENGINE_FLAGS, "--prefill-backlog-steps", "0"]
    ENGINE_FLAGS.extend(["--prefill-backlog-steps", str(prefill_backlog_steps(args))])
    runs = []
    for spec in args.modes.split(","):
        mode, _, concurrencies = spec.partition(":")
        concurrencies = concurrencies.replace("+", ",") or args.concurrency
        runs.append((mode, 1 if mode == "pd" else 0, ENGINE_FLAGS, concurrencies))
    compare_flags = {
        "uncapped": uncapped_flags,
        "fixed-cap": fixed_cap_flags,
        "sync-sampling": [*ENGINE_FLAGS, "--no-async-sampling"],
        "sync-mixed": [*ENGINE_FLAGS, "--no-async-mixed-steps"],
        "decode-graphs-only": [*ENGINE_FLAGS, "--compilation-config.cudagraph_mode",
                               "FULL_DECODE_ONLY"],
    }  # fmt: skip
    for name, flags in compare_flags.items():
        key = name.replace("-", "_")
        if concurrencies := getattr(args, f"compare_{key}"):
            runs.append((f"colocated_{key}", 0, flags, concurrencies))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model_dir(Path(tmp), QWEN3_8B)
        t = time.monotonic()
        offline, offline_steps = 0.0, {}
        if args.offline:
            offline, offline_steps = offline_tok_s(path, args.num_prompts)
        print(f"offline {offline:.0f} tok/s ({time.monotonic() - t:.0f} s)", flush=True)
        if offline_steps:
            print("offline", steps_line(offline_steps), flush=True)
        modes: dict[str, dict] = {}
        rows = []
        for mode, num_prefill, flags, concurrencies in runs:
            port = 8100 + len(modes)
            t = time.monotonic()
            trace_dir = Path(tmp) / f"trace-{mode}"
            windows: dict[str, tuple[float, float]] = {}  # each point's span, for its steps
            cache = Path(tmp) / f"triton-{mode}" if args.cold_triton_cache else None
            route_log = Path(tmp) / f"routes-{mode}.jsonl"
            route_log.touch()
            proc, log = start_serve(
                path,
                num_prefill,
                port,
                [*flags, "--num-prefill", str(num_prefill), "--metrics-port", "0"]
                + ["--route-log", str(route_log)],
                trace_dir,
                Path(tmp) / f"stacks-{mode}" if args.stack_samples else None,
                cache,
            )
            urls = metrics_urls(log)
            print(f"{mode}: serving after {time.monotonic() - t:.0f} s", flush=True)
            built_at_start = set(os.listdir(cache)) if cache is not None else set()
            try:
                modes[mode] = {}
                label = f"serve_gpu-{mode}"
                if args.idle_prompts and mode in ("pd", "colocated"):
                    r = bench_point(path, port, 1, args.idle_prompts, out_dir, label, seed=1000)
                    modes[mode]["idle_ttft_p50_ms"] = r["median_ttft_ms"]
                gw = gateway_pid(proc)
                for seed, c in enumerate(map(int, concurrencies.split(","))):
                    cpu0 = process_cpu_s(gw) if gw else float("nan")
                    hist0 = histogram_totals(urls)
                    routes0 = len(route_log.read_text().splitlines())
                    t0 = time.perf_counter()
                    r = bench_point(path, port, c, args.num_prompts, out_dir, label, seed)
                    windows[str(c)] = (t0, time.perf_counter())
                    p = modes[mode][str(c)] = point_figures(r, offline)
                    routes = route_lines_after(route_log, routes0, r["completed"])
                    p["route_ttft_p50_ms_past_first"] = route_ttft_split_ms(routes, 2 * c)
                    hist1 = histogram_totals(urls)
                    p["ttft_mean_ms_by_layer"] = mean_ms_by_layer(
                        hist0[TTFT], hist1[TTFT], r["mean_ttft_ms"]
                    )
                    p["e2e_mean_ms_by_layer"] = mean_ms_by_layer(
                        hist0[E2E], hist1[E2E], r["mean_e2el_ms"]
                    )
                    p["ttft_phases_mean_ms"] = {
                        phase: mean_ms_by_layer(hist0[name], hist1[name], None)
                        for phase, name in PHASES.items()
                    }
                    p["ttft_phases_count"] = {
                        phase: count_by_layer(hist0[name], hist1[name])
                        for phase, name in PHASES.items()
                    }
                    # With each service's mean requests in the engine (its steps below), the
                    # time a request spends inside it (Little's law): the rest is transit.
                    p["requests_per_s"] = r["completed"] / r["duration"]
                    # The gateway's CPU over the point (its one process: busy near 1 = saturated)
                    gw_cpu_s = (process_cpu_s(gw) if gw else float("nan")) - cpu0
                    p["gateway_cpu_fraction"] = gw_cpu_s / r["duration"]
                    # The client's (one process, one event loop, as vLLM's) over its run: near
                    # 1, its loop's lag is in every latency it measured.
                    p["client_cpu_fraction"] = r["client_cpu_s"] / r["duration"]
                    num_tokens = max(r["total_output_tokens"], 1)
                    p["gateway_cpu_us_per_token"] = 1e6 * gw_cpu_s / num_tokens
                    idle = modes[mode].get("idle_ttft_p50_ms")
                    if idle:
                        p["ttft_p50_over_idle"] = p["ttft_p50_ms"] / idle
                    rows.append([mode, c, f"{p['output_tok_s']:.0f}",
                                 f"{p['ratio_to_offline'] or 0:.2f}", p["errors"],
                                 f"{p['ttft_p50_ms']:.0f}/{p['ttft_p99_ms']:.0f}",
                                 f"{p.get('ttft_p50_over_idle') or 0:.1f}",
                                 f"{p['itl_p50_ms']:.1f}/{p['itl_p99_ms']:.1f}",
                                 f"{p['itl_p99_over_p50'] or 0:.1f}"])  # fmt: skip
                    print(mode, c, json.dumps(p), flush=True)
            except subprocess.TimeoutExpired:
                print("".join(log[-60:]), flush=True)
                raise
            finally:
                stop_serve(proc)
                (out_dir / f"serve_gpu-{mode}.log").write_text("".join(log[-5000:]))
            if cache is not None:  # each a compile the engine loop waited for
                late = modes[mode]["kernels_built_while_serving"] = kernels_built_since(
                    cache, built_at_start
                )
                print(f"{mode}: {len(late)} kernels compiled while serving: {late}", flush=True)
            if args.stack_samples:
                modes[mode]["stacks"] = {}
                for f in sorted((Path(tmp) / f"stacks-{mode}").glob("*.json")):
                    shutil.copy(f, out_dir / f"{mode}-{f.name}")
                    summary = stack_sampler.summarize(json.loads(f.read_text()), top=8)
                    modes[mode]["stacks"][f.stem] = summary
                    for thread, t in summary.items():
                        if t["busy_share"] > 0.02:
                            print(mode, f.stem, thread, json.dumps(t), flush=True)
            for c, (t0, t1) in windows.items():  # each service's steps during the point
                # Request phases also past the closed loop's first two waves (their queueing
                # behind each other dominates the means of the whole point).
                skip = 2 * int(c)
                modes[mode][c]["steps"] = {
                    f.stem: summarize(json.loads(f.read_text()), t0, t1, skip_first=skip)
                    for f in sorted(trace_dir.glob("*.json"))
                }
                for name, st in modes[mode][c]["steps"].items():
                    print(mode, c, name, steps_line(st), flush=True)
    config = {"model_shape": "qwen3-8b", "engine_flags": ENGINE_FLAGS,
              "uncapped_engine_flags": uncapped_flags if args.compare_uncapped else None,
              "fixed_cap_engine_flags": fixed_cap_flags if args.compare_fixed_cap else None,
              "num_prompts": args.num_prompts, "input_len": 512, "output_len": 128,
              "bench_flags": BENCH_FLAGS}  # fmt: skip
    summary = {"offline_output_tok_s": offline, "offline_steps": offline_steps, "modes": modes}
    path = write_result("serve_gpu", config, summary, out_dir)
    path.write_text(json.dumps({**summary, **json.loads(path.read_text())}, indent=2) + "\n")
    header = ("mode", "conc", "out tok/s", "/offline", "errors", "TTFT p50/p99", "/idle",
              "ITL p50/p99", "p99/p50")  # fmt: skip
    print_table([tuple(map(str, r)) for r in rows], header)


if __name__ == "__main__":
    main()
