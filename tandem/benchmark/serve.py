"""`tandem bench serve`: vLLM's `vllm bench serve` for any OpenAI-compatible server.

Run the same command against Tandem and against vLLM (only `--base-url` differs) to compare
them on the same prompts, arrivals and concurrency. Flags keep vLLM's names and meanings; the
saved JSON keeps vLLM's field names. Added: `--sweep concurrency:1,8,32` / `--sweep rate:1,2,4`
(one point per value, same prompts, one result file) and `--plot` (PNGs next to the result).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.benchmark.client import Clock
from tandem.benchmark.datasets import sample_requests
from tandem.benchmark.flags import (
    build_parser,
    load_points,
    make_target,
    pairs,
    percentile_args,
)
from tandem.benchmark.metrics import calculate_metrics, parse_goodput
from tandem.benchmark.report import print_result, save_and_plot
from tandem.benchmark.runner import LoadPoint, Target, run_load


def load_tokenizer(name: str):
    """The gateway's tokenizer loading: the light tokenizer (no transformers import, ~5 s less
    before the first request), else transformers' own for a folder it cannot reproduce."""
    from engine.tokenizer_files import load_tokenizer_light_first

    path = Path(name).expanduser()
    if not path.is_dir():
        from engine.weights import resolve_model_path

        path = resolve_model_path(name)
    return load_tokenizer_light_first(path)


class NotReadyError(RuntimeError):
    """The server did not answer a first request well: nothing to measure."""


async def wait_until_ready(target: Target, request, timeout_s: float, **kw) -> None:
    """Send one request until it succeeds: connection errors and 503 are retried (the server is
    starting), any other failure ends the benchmark before it starts."""
    start = time.monotonic()
    deadline, next_note = start + timeout_s, start
    while True:
        (out,), _ = await run_load(target, [request], LoadPoint(), **kw)
        if out.is_success:
            return
        retry = not out.error.startswith("HTTP ") or out.error.startswith("HTTP 503")
        if not retry or time.monotonic() > deadline:
            raise NotReadyError(f"the first request failed: {out.error}")
        if time.monotonic() >= next_note:  # say why it waits, not a silent minute
            waited_s = time.monotonic() - start
            print(
                f"Waiting for {target.api_url} ({waited_s:.0f} of {timeout_s:.0f} s; "
                f"--ready-check-timeout-sec 0 skips this): {out.error}",
                file=sys.stderr,
                flush=True,
            )
            next_note = time.monotonic() + 10.0
        await asyncio.sleep(1.0)


async def run_benchmark(args, *, clock: Clock = time.perf_counter, session=None) -> dict[str, Any]:
    """Every load point of `args`; returns the result as saved (and writes it, and plots)."""
    tokenizer_id = args.tokenizer or args.model
    tokenizer = load_tokenizer(tokenizer_id)
    requests = sample_requests(args, tokenizer)
    goodput_ms = parse_goodput(args.goodput)
    metrics, percentiles = percentile_args(args)
    # vLLM: random prompts run to their requested length.
    target = make_target(args, ignore_eos=args.ignore_eos or args.dataset_name == "random")
    kw = {"clock": clock, "session": session}
    if args.ready_check_timeout_sec > 0:
        await wait_until_ready(target, requests[0], args.ready_check_timeout_sec, **kw)
    if args.num_warmups > 0:
        warm = LoadPoint(max_concurrency=args.max_concurrency)
        await run_load(target, [requests[0]] * args.num_warmups, warm, **kw)

    points = []
    for point in load_points(args):
        pbar = None if args.disable_tqdm else _progress(len(requests))
        on_done = None if pbar is None else (lambda _out, bar=pbar: bar.update(1))
        cpu_start_s = time.process_time()
        outputs, duration_s = await run_load(
            target, requests, point, seed=args.seed, on_done=on_done, **kw
        )
        client_cpu_s = time.process_time() - cpu_start_s
        if pbar is not None:
            pbar.close()
        result = {
            "request_rate": point.request_rate if point.request_rate < math.inf else "inf",
            "burstiness": point.burstiness if point.burstiness < math.inf else "inf",
            "max_concurrency": point.max_concurrency,
        } | calculate_metrics(
            requests, outputs, duration_s, tokenizer, percentiles, metrics, goodput_ms
        )
        # This process's own CPU over the point (all its threads): near `duration`, its one
        # event loop was saturated and its lag is in every latency above. Not a vLLM field.
        result["client_cpu_s"] = client_cpu_s
        print_result(result, metrics, percentiles, bool(goodput_ms))
        points.append(result)

    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    } | pairs(args.metadata, "--metadata")
    return save_and_plot(args, header, points)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total)


def serve_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        load_points(args)
        parse_goodput(args.goodput)
        percentile_args(args)
    except (ValueError, AssertionError) as e:
        parser.error(str(e))
    if args.dataset_name != "random" and not args.dataset_path:
        parser.error(f"--dataset-name {args.dataset_name} needs --dataset-path")
    try:
        asyncio.run(run_benchmark(args))
    except (NotReadyError, ValueError, OSError) as e:  # a server, tokenizer or file problem
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 1
    return 0


def bench_main(argv: list[str]) -> int:
    """`tandem bench SUBCOMMAND`: only `serve` so far."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tandem bench serve [--help] ...")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"unknown bench command {argv[0]!r}; try: tandem bench serve --help", file=sys.stderr)
        return 2
    return serve_main(argv[1:])
