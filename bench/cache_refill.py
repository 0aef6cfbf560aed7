"""Cache refill: what one piece of the gateway's request path costs when it runs after an idle
gap, against the same piece run again at once.

A gateway at 100 req/s runs each small request alone, ~10 ms after the last one. On these
2-core VMs that gap is long enough for the request path's code and data to leave the CPU caches
(other tenants of the host share the last-level cache), so each request pays to fetch them
again. This times single calls of the gateway's own pieces, each after sleeping `gap` (as the
event loop does in epoll between requests): the first call after the gap (cold) and a second
call right after it (warm), in wall time and in the thread's CPU time. The pieces:

  * `json_dumps`: `json.dumps` of a small dict (a control: no gateway code);
  * `chat_template`: the chat template rendered for the 4-token chat (gateway_overhead's);
  * `tokenize`: that prompt tokenized (`gateway.preprocess.encode_bounded`);
  * `parse_body`: the request body parsed and validated (`gateway.offload.parse_body`).

Writes `bench/results/cache_refill-<YYYY-MM-DD>.json` and prints a table.
Run from the repo root: `python -m bench.cache_refill [--calls 300]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `gateway`, `engine` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import print_table, write_result  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]  # gateway_overhead's
GAPS_MS = (0.0, 0.1, 1.0, 3.0, 10.0)


def pieces() -> dict[str, Callable[[], Any]]:
    from engine.tokenizer_files import load_light_tokenizer
    from engine.weights.hub import resolve_model_path
    from gateway.offload import parse_body
    from gateway.preprocess import encode_bounded
    from gateway.protocol import ChatCompletionRequest

    tokenizer = load_light_tokenizer(resolve_model_path(MODEL))
    # The fields of gateway.model_info.ModelInfo that encode_bounded reads.
    info = SimpleNamespace(tokenizer=tokenizer, max_model_len=8192)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    body = json.dumps({"model": "smollm2", "messages": MESSAGES, "max_tokens": 4}).encode()
    small = {"id": "chatcmpl-0", "object": "chat.completion", "choices": [{"index": 0}]}
    return {
        "json_dumps": lambda: json.dumps(small),
        "chat_template": lambda: tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True
        ),
        "tokenize": lambda: encode_bounded(info, prompt, False),
        "parse_body": lambda: parse_body(ChatCompletionRequest, body, 1000),
    }


def measure(fn: Callable[[], Any], gap_s: float, calls: int) -> dict[str, float]:
    """Medians over `calls` rounds of: sleep `gap_s`, call (cold), call again (warm)."""
    cold_wall, warm_wall, cold_cpu, warm_cpu = [], [], [], []
    clock, cpu = time.perf_counter, time.thread_time
    for _ in range(5):
        fn()
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        w0, c0 = clock(), cpu()
        fn()
        w1, c1 = clock(), cpu()
        fn()
        w2, c2 = clock(), cpu()
        cold_wall.append(w1 - w0)
        warm_wall.append(w2 - w1)
        cold_cpu.append(c1 - c0)
        warm_cpu.append(c2 - c1)
    us = 1e6
    return {
        "cold_wall_us": round(statistics.median(cold_wall) * us, 1),
        "warm_wall_us": round(statistics.median(warm_wall) * us, 1),
        "cold_cpu_us": round(statistics.median(cold_cpu) * us, 1),
        "warm_cpu_us": round(statistics.median(warm_cpu) * us, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="rounds per piece and gap")
    args = p.parse_args()
    load_before = open("/proc/loadavg").read().split()[:3]
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name, fn in pieces().items():
        results[name] = {}
        for gap_ms in GAPS_MS:
            r = measure(fn, gap_ms / 1000, args.calls)
            results[name][f"{gap_ms:g}"] = r
            ratio = r["cold_wall_us"] / max(r["warm_wall_us"], 1e-3)
            cold, warm = str(r["cold_wall_us"]), str(r["warm_wall_us"])
            rows.append((name, f"{gap_ms:g}", cold, warm, f"{ratio:.1f}x"))
    config = {
        "model": MODEL,
        "calls": args.calls,
        "gaps_ms": list(GAPS_MS),
        "idle": "time.sleep(gap) before each cold call",
        "figures": "medians over calls; wall: perf_counter, cpu: this thread's CPU time",
        "loadavg_before": load_before,
        "loadavg_after": open("/proc/loadavg").read().split()[:3],
    }
    path = write_result("cache_refill", config, results)
    print_table(rows, ("piece", "gap ms", "cold us", "warm us", "cold / warm"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
