"""What a run leaves: vLLM's result table on stdout, the result JSON (one file; a sweep's
points under "points") and, with `--plot`, PNGs named after it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.benchmark.flags import parse_sweep
from tandem.benchmark.metrics import DETAILED_FIELDS, METRICS, percentile_name


def save_and_plot(args, header: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any]:
    def brief(result: dict[str, Any]) -> dict[str, Any]:
        keep = args.save_detailed
        return {k: v for k, v in result.items() if keep or k not in DETAILED_FIELDS}

    if args.sweep is None:
        saved = header | brief(points[0])
    else:
        axis, values = parse_sweep(args.sweep)
        saved = header | {
            "sweep": {"axis": axis, "values": values},
            "points": [brief(r) for r in points],
        }
    stem = Path(args.result_filename).stem if args.result_filename else _default_stem(args)
    out_dir = Path(args.result_dir) if args.result_dir else Path.cwd()
    if args.save_result or args.plot:
        out_dir.mkdir(parents=True, exist_ok=True)
    if args.save_result:
        path = out_dir / (args.result_filename or f"{stem}.json")
        path.write_text(json.dumps(saved, indent=1))
        print(f"result: {path}")
    if args.plot:
        from tandem.benchmark import plots

        labels = _point_labels(args, points)
        written = [plots.plot_latency_cdfs(list(zip(labels, points)), out_dir / f"{stem}-cdf.png")]
        if args.sweep is not None:
            axis, values = parse_sweep(args.sweep)
            written.append(
                plots.plot_load_curves(
                    axis, list(zip(values, points)), out_dir / f"{stem}-load.png"
                )
            )
        print("plots: " + ", ".join(str(p) for p in written))
    return saved


def _point_labels(args, points: list[dict[str, Any]]) -> list[str]:
    if args.sweep is None:
        return [args.label or args.backend]
    axis, values = parse_sweep(args.sweep)
    return [f"{axis} {v:g}" for v in values]


def _default_stem(args) -> str:
    label = args.label or args.backend
    model = args.model.rstrip("/").split("/")[-1]
    dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.sweep is not None:
        return f"{label}-sweep-{args.sweep.split(':')[0]}-{model}-{dt}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return f"{label}-{args.request_rate}qps{conc}-{model}-{dt}"


def print_result(r: dict[str, Any], metrics: list[str], percentiles, has_goodput: bool) -> None:
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"])]
    if r["max_concurrency"] is not None:
        rows.append(("Maximum request concurrency:", r["max_concurrency"]))
    if r["request_rate"] != "inf":
        rows.append(("Request rate configured (RPS):", f"{r['request_rate']:.2f}"))
    rows += [
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
    ]
    if has_goodput:
        rows.append(("Request goodput (req/s):", f"{r['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    for m in METRICS:
        if m in metrics:
            name = m.upper()
            rows += [
                (f"Mean {name} (ms):", f"{r[f'mean_{m}_ms']:.2f}"),
                (f"Median {name} (ms):", f"{r[f'median_{m}_ms']:.2f}"),
            ]
            rows += [
                (f"P{percentile_name(p)} {name} (ms):", f"{r[f'p{percentile_name(p)}_{m}_ms']:.2f}")
                for p in percentiles
            ]
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for key, value in rows:
        print(f"{key:<40} {value!s:<10}")
    for error, count in r["error_counts"].items():
        print(f"  failed x{count}: {error[:200]}")
    print("=" * 50, flush=True)
