"""vLLM's serving figures from request outputs, under vLLM's result field names.

Per completed request: TTFT; TPOT = (E2EL - TTFT) / (output tokens - 1) when it made more than
one token; ITLs; E2EL. Output tokens are the server's usage, else the tokenizer's count of the
text. Goodput counts completed requests that meet every given SLO (a request of one token has
TPOT 0 for that purpose), per second of the run. Latency statistics over no value read 0.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from tandem.benchmark.client import RequestOutput
from tandem.benchmark.datasets import SampleRequest

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# Per-request lists: in the result only with --save-detailed (as vLLM drops them otherwise).
DETAILED_FIELDS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "e2els",
    "generated_texts",
    "errors",
)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if name not in GOODPUT_METRICS or not slos[name] >= 0:
            raise ValueError(
                f"invalid --goodput {pair!r}: use KEY:MS with KEY one of "
                f"{', '.join(GOODPUT_METRICS)} and MS >= 0"
            )
    return slos


def percentile_name(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def output_len(out: RequestOutput, tokenizer) -> int:
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is None:
        raise ValueError("the server reported no usage: pass --tokenizer to count output tokens")
    return len(tokenizer.encode(out.generated_text, add_special_tokens=False))


def calculate_metrics(
    requests: list[SampleRequest],
    outputs: list[RequestOutput],
    duration_s: float,
    tokenizer,
    percentiles: list[float],
    percentile_metrics: list[str],
    goodput_ms: dict[str, float],
) -> dict[str, Any]:
    """The result fields of one load point (summary first, then per-request lists)."""
    ok = [(req, out) for req, out in zip(requests, outputs) if out.is_success]
    output_lens = [output_len(out, tokenizer) if out.is_success else 0 for out in outputs]
    lens_ok = [n for n, out in zip(output_lens, outputs) if out.is_success]
    ttfts = [out.ttft_s for _, out in ok]
    e2els = [out.latency_s for _, out in ok]
    all_tpots = [
        (out.latency_s - out.ttft_s) / (n - 1) if n > 1 else 0.0 for (_, out), n in zip(ok, lens_ok)
    ]
    tpots = [t for t, n in zip(all_tpots, lens_ok) if n > 1]
    itls = [gap for _, out in ok for gap in out.itl_s]
    values_s = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}

    good = 0
    if goodput_ms:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            good += all(per_request[m][i] * 1000 <= slo for m, slo in goodput_ms.items())

    total_input = sum(req.prompt_len for req, _ in ok)
    total_output = sum(output_lens)
    errors = [out.error for out in outputs]
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "error_counts": dict(Counter(e for e in errors if e)),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        **_peaks([out for _, out in ok]),
    }
    for metric in METRICS:
        if metric not in percentile_metrics:
            continue
        ms = np.asarray(values_s[metric] or [0.0]) * 1000
        result[f"mean_{metric}_ms"] = float(np.mean(ms))
        result[f"median_{metric}_ms"] = float(np.median(ms))
        result[f"std_{metric}_ms"] = float(np.std(ms))
        for p in percentiles:
            result[f"p{percentile_name(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    result |= {
        "input_lens": [req.prompt_len for req in requests],
        "output_lens": output_lens,
        "ttfts": [out.ttft_s for out in outputs],
        "itls": [out.itl_s for out in outputs],
        "e2els": [out.latency_s for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": errors,
    }
    return result


def _peaks(outputs: list[RequestOutput]) -> dict[str, float]:
    """vLLM's max_output_tokens_per_s / max_concurrent_requests: over one-second buckets from
    the first request's start, the most content chunks and the most requests in flight."""
    if not outputs:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_s for o in outputs)
    num_buckets = int(np.ceil(max(o.start_s + o.latency_s for o in outputs) - t0)) + 1
    tokens = np.zeros(num_buckets)
    in_flight = np.zeros(num_buckets)
    for o in outputs:
        token_times = o.start_s + o.ttft_s + np.concatenate([[0.0], np.cumsum(o.itl_s)])
        np.add.at(tokens, (token_times - t0).astype(int).clip(0, num_buckets - 1), 1)
        first, last = int(o.start_s - t0), int(o.start_s + o.latency_s - t0)
        in_flight[first : last + 1] += 1
    return {
        "max_output_tokens_per_s": float(tokens.max()),
        "max_concurrent_requests": int(in_flight.max()),
    }
