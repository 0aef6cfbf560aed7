"""`tandem bench serve` flags (vLLM's names and meanings) and what they turn into: the load
points of the run and the `Target` every request goes to."""

from __future__ import annotations

import argparse
import json
import math
import os

from tandem.benchmark.client import BACKENDS
from tandem.benchmark.datasets import add_dataset_args
from tandem.benchmark.metrics import METRICS
from tandem.benchmark.runner import LoadPoint, Target

SWEEP_AXES = ("concurrency", "rate")
SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        "tandem bench serve",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--backend",
        default="openai",
        choices=list(BACKENDS),
        help="openai: /v1/completions; openai-chat: /v1/chat/completions",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="server URL, e.g. http://10.0.0.5:8000 (instead of --host/--port)",
    )
    p.add_argument("--host", default="127.0.0.1", help="server host")
    p.add_argument("--port", type=int, default=8000, help="server port")
    p.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    p.add_argument("--model", required=True, help="model name, and tokenizer unless --tokenizer")
    p.add_argument("--served-model-name", default=None, help="model name sent in requests")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id")
    p.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra request headers")
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (inf: all at once); Poisson or gamma arrivals",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 smoother",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument(
        "--sweep",
        default=None,
        metavar="AXIS:V1,V2,...",
        help="concurrency:1,8,32 or rate:1,2,4: one run per value",
    )
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent before the run")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=600,
        help="wait this long for a first request to succeed (0: skip the check)",
    )
    g = p.add_argument_group("requests")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (always on with the random dataset, as vLLM)",
    )
    for flag in SAMPLING_FLAGS:
        kind = int if flag == "top_k" else float
        g.add_argument(
            f"--{flag.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"sampling {flag} (temperature: 0 unless set)",
        )
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into bodies")
    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    g.add_argument(
        "--percentile-metrics",
        default=",".join(METRICS),
        help="metrics to report statistics of: ttft,tpot,itl,e2el",
    )
    g.add_argument("--metric-percentiles", default="99", help="percentiles, e.g. 50,90,99")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="include per-request lists (input_lens, ttfts, itls, errors, ...)",
    )
    g.add_argument("--result-dir", default=None, help="folder of results and plots")
    g.add_argument("--result-filename", default=None, help="result file name")
    g.add_argument("--label", default=None, help="result file prefix (default: the backend)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="saved in the result")
    g.add_argument("--plot", action="store_true", help="write latency CDF (and load) PNGs")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    axis, _, values = spec.partition(":")
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        numbers = []
    if axis not in SWEEP_AXES or not numbers or min(numbers) <= 0:
        raise ValueError(f"--sweep {spec!r}: use concurrency:1,8,32 or rate:1,2,4")
    return axis, numbers


def load_points(args) -> list[LoadPoint]:
    if args.sweep is None:
        return [LoadPoint(args.request_rate, args.burstiness, args.max_concurrency)]
    axis, values = parse_sweep(args.sweep)
    if axis == "concurrency":
        return [LoadPoint(args.request_rate, args.burstiness, int(v)) for v in values]
    return [LoadPoint(v, args.burstiness, args.max_concurrency) for v in values]


def make_target(args, ignore_eos: bool) -> Target:
    endpoint = args.endpoint or BACKENDS[args.backend]
    if args.base_url:
        base = args.base_url.rstrip("/")
        if base.endswith("/v1") and endpoint.startswith("/v1/"):
            base = base[: -len("/v1")]  # --base-url http://h:p/v1 as the OpenAI SDK takes it
    else:
        host = f"[{args.host}]" if ":" in args.host else args.host
        base = f"http://{host}:{args.port}"
    headers = {"Content-Type": "application/json"}
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers |= pairs(args.header, "--header")
    sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    return Target(
        api_url=base + endpoint,
        backend=args.backend,
        model=args.served_model_name or args.model,
        headers=headers,
        ignore_eos=ignore_eos,
        extra_body={**sampling, **(args.extra_body or {})},
    )


def percentile_args(args) -> tuple[list[str], list[float]]:
    """(--percentile-metrics, --metric-percentiles), checked."""
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if bad := sorted(set(metrics) - set(METRICS)):
        raise ValueError(f"--percentile-metrics: unknown {bad}; use some of {','.join(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = [-1.0]
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: numbers in [0, 100]")
    return metrics, percentiles
