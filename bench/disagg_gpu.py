"""Disaggregated serving on one GPU: 1 prefill + 1 decode process (UCX over CUDA memory).

1. Tokens: remote prefill (P writes KV into D's blocks) equals local prefill on D
   (= colocated), greedy, bf16, a few prompts.
2. TTFT overhead: Qwen3-8B shape (random weights), 2,048-token prompts, idle system:
   Generate with max_tokens=1 through P vs locally on D, median of distinct prompts.

    python -m bench.disagg_gpu --out-dir DIR [--model-dir DIR_WITH_CONFIG_AND_TOKENIZER]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import ensure_internal_token, write_result
from bench.gpu_engine import make_config_dir, random_prompts
from engine.sampling_params import SamplingParams
from tandem.launcher import Cluster
from tests.fixtures.tiny_models import make_tiny_checkpoint
from tests.integration.services import (
    collect,
    decode_stub,
    generate_request,
    get_load,
    prefill_stub,
)

ensure_internal_token()

FLAGS = [
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--load-format",
    "dummy",
    "--max-model-len",
    "4096",
    "--kv-cache-memory-bytes",
    str(16 << 30),
    "--max-num-seqs",
    "64",
]


async def tokens_equal(p_addr: str, d_addr: str) -> list[bool]:
    """Remote vs local prefill on the same D (prefix caching off, so the local run computes
    the whole prompt itself); fp32 tiny model: margins large enough for exact equality."""
    stub = decode_stub(d_addr)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    same = []
    for i, prompt in enumerate(random_prompts(6, 120, 10, vocab=2000)):
        remote = await collect(stub, generate_request(f"eq-r{i}", prompt, greedy, [p_addr]))
        local = await collect(stub, generate_request(f"eq-l{i}", prompt, greedy))
        same.append(remote[0] == local[0] and len(remote[0]) == 32)
    return same


async def measure(p_addr: str, d_addr: str, n: int) -> dict:
    stub = decode_stub(d_addr)
    same: list[bool] = []
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttft = {"remote": [], "local": []}
    parts = ("remote_setup_s", "remote_rpc_s", "remote_compute_s", "remote_server_s", "kv_wait_s")
    breakdown: dict[str, list[float]] = {k: [] for k in ("prefill_s", *parts)}
    local_prefill_s = []
    prompts = random_prompts(2 * n + 2, 2048, 11)
    for i in range(n + 1):  # first pair warms up
        for kind, prompt in (("remote", prompts[2 * i]), ("local", prompts[2 * i + 1])):
            t = time.perf_counter()
            _, final, _ = await collect(
                stub,
                generate_request(f"t-{kind}{i}", prompt, one, [p_addr] if kind == "remote" else []),
            )
            if i:
                ttft[kind].append(time.perf_counter() - t)
                if kind == "remote":
                    for k in breakdown:
                        breakdown[k].append(getattr(final.timings, k))
                else:
                    local_prefill_s.append(final.timings.prefill_s)
    load_d, load_p = await get_load(stub), await get_load(prefill_stub(p_addr))
    remote_ms = statistics.median(ttft["remote"]) * 1e3
    local_ms = statistics.median(ttft["local"]) * 1e3
    return {
        "tokens_equal": same,
        "ttft_remote_ms": remote_ms,
        "ttft_local_ms": local_ms,
        "overhead": remote_ms / local_ms - 1,
        # Medians, ms: D's own prefill_s for a local prompt, and where a remote one's went.
        "local_prefill_ms": statistics.median(local_prefill_s) * 1e3,
        "remote_breakdown_ms": {k: statistics.median(v) * 1e3 for k, v in breakdown.items()},
        "kv_backend": load_d.kv_backend,
        "kv_transfer_bytes": load_p.kv_transfer_bytes,
        "remote_prefills": load_d.num_remote_prefills,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--num", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_config_dir("qwen3-8b", Path(tmp))
        tiny = make_tiny_checkpoint("qwen3", Path(tmp) / "tok")
        for f in tiny.glob("tokenizer*"):  # services read eos ids from a tokenizer
            shutil.copy(f, model / f.name)
        cluster = Cluster(log_prefix=False)
        tiny_flags = [
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--num-gpu-blocks-override",
            "128",
            "--no-enable-prefix-caching",
        ]
        try:
            p = cluster.start("prefill", [str(tiny), *tiny_flags])
            d = cluster.start("decode", [str(tiny), *tiny_flags])
            same = asyncio.run(tokens_equal(p.address, d.address))
        finally:
            cluster.stop()
        cluster = Cluster(log_prefix=False)
        try:
            p = cluster.start("prefill", [str(model), *FLAGS])
            d = cluster.start("decode", [str(model), *FLAGS])
            res = asyncio.run(measure(p.address, d.address, args.num))
        finally:
            cluster.stop()
        res["tokens_equal"] = same
    print(res)
    if args.out_dir:
        write_result(
            "disagg_gpu",
            {"model": "qwen3-8b shape, dummy, bf16", "prompt": 2048},
            res,
            results_dir=Path(args.out_dir),
        )


if __name__ == "__main__":
    main()
