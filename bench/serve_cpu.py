"""Online serving on CPU: 1 prefill + 1 decode (remote prefill over UCX) vs 1 colocated decode.

What is measured, per configuration, through the OpenAI gateway with the official `openai` SDK
(`AsyncOpenAI`, streamed chat completions, `temperature=0`, `max_tokens=64`,
`extra_body={"ignore_eos": True}` so every request yields exactly 64 tokens):
- TTFT: request sent -> first chunk carrying content (p50, p90, p99, mean), ms.
- ITL: gap between consecutive content chunks of one stream (p50, p90, p99, mean), ms.
- E2E latency: request sent -> stream closed (p50, p90, p99, mean), ms.
- Output tok/s: completion tokens (from `usage`) of all measured requests / summed round walls.
- The decode's GetLoad counters over the measured rounds (num_remote_prefills,
  num_local_prefills, kv_transfer_bytes, ...), to show which prefill path really ran.

Configurations, each in a fresh `tandem.launcher.Cluster` (stopped in `finally`):
- `1p1d`: `tandem prefill` + `tandem decode` (UCX KV transfer), gateway with `--prefill`.
- `colocated`: `tandem decode` only, gateway without `--prefill` (the decode prefills locally).

Workload: 16 different chat messages of mixed length (short questions and "summarize this"
requests over windows of Python's bundled documentation, `pydoc_data.topics`), made
deterministically from `--seed`. Each configuration is warmed up with a few requests on other
text, then runs `--rounds` rounds of all 16 messages sent concurrently (one round at a time).
Prefix caching is off in the services, so repeating the messages across rounds cannot hit the
cache and every request pays its full prefill. The ratios 1p1d / colocated of TTFT and ITL
p50/p99 are recorded.

Caveat: this machine has 2 CPU cores. The prefill, the decode and the gateway (and the client)
share them, so disaggregation cannot give the prefill its own compute here: 1P+1D is not
expected to win on this machine; the figures show the overhead of the remote path (extra
gRPC hop, KV transfer, prefill/decode contention for the same cores), not its benefit.

Writes `bench/results/serve_cpu-<YYYY-MM-DD>.json` and prints a short table.
Run from the repo root: `python -m bench.serve_cpu` (or `python bench/serve_cpu.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench`, `engine`, `protos` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ensure_internal_token, print_table, write_result  # noqa: E402
from tandem.launcher import Cluster  # noqa: E402

ensure_internal_token()

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONFIGS = ("1p1d", "colocated")
PERCENTILES = (50, 90, 99)
NUM_WARMUP = 2

SHORT_QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Name four planets of the solar system.",
    "How do I boil an egg?",
    "What is the difference between a list and a tuple in Python?",
]


@dataclass(frozen=True)
class BenchConfig:
    model: str
    num_concurrent: int
    rounds: int
    max_tokens: int
    temperature: float
    max_model_len: int
    kv_backend: str
    prefix_caching: bool
    seed: int
    prompt_tokens: list[int] = field(default_factory=list)  # per message, filled after the run


@dataclass
class RequestResult:
    ttft_s: float
    itls_s: list[float]
    e2e_s: float
    completion_tokens: int
    prompt_tokens: int


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(xs_s: list[float]) -> dict[str, float]:
    """p50/p90/p99 and mean of a list of seconds, in milliseconds."""
    out = {f"p{q}": round(percentile(xs_s, q) * 1e3, 2) for q in PERCENTILES}
    out["mean"] = round(statistics.fmean(xs_s) * 1e3, 2)
    return out


def make_messages(n: int, seed: int, offset: int = 0) -> list[str]:
    """n different user messages of mixed length, deterministic for (seed, offset).

    Even indices: a short question; odd indices: "summarize" over a window of 20-300 words of
    Python's documentation, so prompts range from ~40 to ~500 tokens."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    rng = random.Random(seed)
    msgs: list[str] = []
    for i in range(n):
        if i % 2 == 0:
            msgs.append(SHORT_QUESTIONS[(i // 2 + offset) % len(SHORT_QUESTIONS)])
        else:
            length = rng.randint(20, 300)
            start = rng.randrange(0, len(words) - length)
            text = " ".join(words[start : start + length])
            msgs.append(f"Summarize the following text in a few sentences.\n\n{text}")
    if offset:  # warmup messages: make sure none equals a measured one
        msgs = [f"(warmup {i}) {m}" for i, m in enumerate(msgs)]
    return msgs


async def one_request(client: Any, cfg: BenchConfig, message: str) -> RequestResult:
    """One streamed chat completion; times every chunk that carries content."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=cfg.model,
        messages=[{"role": "user", "content": message}],
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    times: list[float] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    t_end = time.perf_counter()
    if not times or usage is None:
        raise RuntimeError(f"stream ended without content or usage ({len(times)} chunks)")
    return RequestResult(
        ttft_s=times[0] - t0,
        itls_s=[b - a for a, b in zip(times, times[1:])],
        e2e_s=t_end - t0,
        completion_tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
    )


async def run_load(
    base_url: str, decode_address: str, cfg: BenchConfig, messages: list[str], warmup: list[str]
) -> tuple[list[RequestResult], list[float], dict[str, Any], dict[str, Any]]:
    """Warm up (one request at a time), snapshot the decode's GetLoad, run `cfg.rounds` rounds
    of all messages at once, snapshot again. Returns results, round walls, before, after."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=base_url, api_key="unused", timeout=600.0, max_retries=0
    ) as client:
        for m in warmup:
            await one_request(client, cfg, m)
        before = await asyncio.to_thread(get_load, decode_address)
        results: list[RequestResult] = []
        walls: list[float] = []
        for _ in range(cfg.rounds):
            t0 = time.perf_counter()
            results += await asyncio.gather(*(one_request(client, cfg, m) for m in messages))
            walls.append(time.perf_counter() - t0)
        after = await asyncio.to_thread(get_load, decode_address)
    return results, walls, before, after


def get_load(address: str) -> dict[str, Any]:
    """The decode service's GetLoad answer as a dict."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos import common_pb2, decode_pb2_grpc

    token = ensure_internal_token()
    with grpc.insecure_channel(address) as channel:
        resp = decode_pb2_grpc.DecodeStub(channel).GetLoad(
            common_pb2.LoadRequest(), timeout=10, metadata=[("authorization", f"Bearer {token}")]
        )
    return MessageToDict(
        resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


COUNTERS = (
    "num_requests_total",
    "num_remote_prefills",
    "num_local_prefills",
    "kv_transfer_bytes",
    "num_preemptions",
    "prefix_cache_hits",
)


def run_config(
    name: str, cfg: BenchConfig, messages: list[str], warmup: list[str], show_logs: bool
) -> dict[str, Any]:
    """Start the services of one configuration, measure, stop them; return the figures."""
    svc = [
        cfg.model,
        "--max-model-len",
        str(cfg.max_model_len),
        "--kv-backend",
        cfg.kv_backend,
        *([] if cfg.prefix_caching else ["--no-enable-prefix-caching"]),
    ]
    cluster = Cluster(log_prefix=show_logs)
    try:
        t_start = time.perf_counter()
        prefill = cluster.start("prefill", svc) if name == "1p1d" else None
        decode = cluster.start("decode", svc)
        assert decode.address is not None
        gw_argv = [
            "--model", cfg.model,
            "--max-model-len", str(cfg.max_model_len),
            "--decode", decode.address,
            "--port", "0",
            "--log-level", "warning",
            *(["--prefill", prefill.address] if prefill and prefill.address else []),
        ]  # fmt: skip
        gateway = cluster.start("gateway", gw_argv)
        startup_s = time.perf_counter() - t_start
        base_url = f"http://{gateway.address}/v1"
        print(f"[{name}] services up in {startup_s:.1f} s; gateway {base_url}", flush=True)

        results, walls, before, after = asyncio.run(
            run_load(base_url, decode.address, cfg, messages, warmup)
        )
        dead = cluster.check()
        if dead is not None:
            raise RuntimeError(f"{dead.role} exited with code {dead.proc.returncode}")
    finally:
        cluster.stop()

    counters = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in COUNTERS}
    bad = [r.completion_tokens for r in results if r.completion_tokens != cfg.max_tokens]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} requests did not produce {cfg.max_tokens} tokens")
    total_tokens = sum(r.completion_tokens for r in results)
    return {
        "startup_s": round(startup_s, 2),
        "num_requests": len(results),
        "round_wall_s": [round(w, 3) for w in walls],
        "ttft_ms": summarize_ms([r.ttft_s for r in results]),
        "itl_ms": summarize_ms([x for r in results for x in r.itls_s]),
        "e2e_ms": summarize_ms([r.e2e_s for r in results]),
        "output_tok_s": round(total_tokens / sum(walls), 2),
        "num_itl_samples": sum(len(r.itls_s) for r in results),
        "decode_counters_measured": counters,
        "decode_load_after": after,
        "prompt_tokens": [r.prompt_tokens for r in results[: len(messages)]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("bench.serve_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--num-concurrent", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-backend", default="ucx", choices=["ucx", "inproc"])
    p.add_argument("--prefix-caching", action="store_true", help="leave prefix caching on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of 1p1d,colocated")
    p.add_argument("--show-logs", action="store_true", help="forward the services' logs")
    p.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    args = p.parse_args(argv)
    cfg = BenchConfig(
        model=args.model,
        num_concurrent=args.num_concurrent,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        temperature=0.0,
        max_model_len=args.max_model_len,
        kv_backend=args.kv_backend,
        prefix_caching=args.prefix_caching,
        seed=args.seed,
    )
    names = [c for c in args.configs.split(",") if c]
    if any(c not in CONFIGS for c in names):
        p.error(f"--configs takes {CONFIGS}")
    messages = make_messages(cfg.num_concurrent, cfg.seed)
    warmup = make_messages(NUM_WARMUP, cfg.seed + 1, offset=3)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    figures = {name: run_config(name, cfg, messages, warmup, args.show_logs) for name in names}
    figures_all: dict[str, Any] = dict(figures)
    if "1p1d" in figures and "colocated" in figures:
        a, b = figures["1p1d"], figures["colocated"]
        figures_all["ratio_1p1d_over_colocated"] = {
            f"{m}_{q}": round(a[m][q] / b[m][q], 3)
            for m in ("ttft_ms", "itl_ms", "e2e_ms")
            for q in ("p50", "p99")
        } | {"output_tok_s": round(a["output_tok_s"] / b["output_tok_s"], 3)}
    figures_all["load_avg_1m_before"] = round(load_before, 2)
    figures_all["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    figures_all["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    figures_all["caveat"] = (
        "2 CPU cores shared by prefill, decode, gateway and client: 1P+1D cannot get its own "
        "compute here and is not expected to win; this measures the remote path's overhead."
    )
    config = asdict(cfg) | {"configs": names, "num_warmup": len(warmup)}
    config["prompt_tokens"] = next(iter(figures.values()))["prompt_tokens"]

    rows = [
        (
            name,
            *(
                f"{f[m][q]:.0f}"
                for m in ("ttft_ms", "itl_ms", "e2e_ms")
                for q in ("p50", "p90", "p99")
            ),
            f"{f['output_tok_s']:.1f}",
            str(f["decode_counters_measured"]["num_remote_prefills"]),
            f"{f['decode_counters_measured']['kv_transfer_bytes'] / 2**20:.1f}",
        )
        for name, f in figures.items()
    ]
    header = (
        "config",
        *(f"{m} {q}" for m in ("TTFT", "ITL", "E2E") for q in ("p50", "p90", "p99")),
        "tok/s",
        "remote",
        "KV MiB",
    )
    print(f"\n{cfg.num_concurrent} concurrent x {cfg.rounds} rounds, {cfg.max_tokens} tokens (ms)")
    print_table(rows, header)
    if "ratio_1p1d_over_colocated" in figures_all:
        r = figures_all["ratio_1p1d_over_colocated"]
        print("1p1d / colocated: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if not args.no_write:
        print(f"wrote {write_result('serve_cpu', config, figures_all)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
