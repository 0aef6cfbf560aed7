"""The prefill cap while decoding, fixed vs following the backlog (`--prefill-backlog-steps`), in
the engine on CPU: a closed loop of C streams, each replaced by a fresh one as it finishes.

Why: `--max-prefill-tokens-while-decoding 512` admits at most one 512-token prompt per step
while anything decodes. A closed loop of C streams of 128 output tokens needs C/128 fresh
prompts per step to keep C running; past C = 128 the fixed cap cannot keep up, the running
batch shrinks to what it admits, and throughput stays flat (the H200 measured ~3.1k tok/s from
c=64 to c=512, 0.57x offline: bench/results/serve_gpu-2026-12-02.json). The backlog rule
raises the cap to 1/N of the waiting prompt tokens, so the budget follows the queue.

Workload, scaled to a small model whose steps cost about the same with or without a few
hundred prompt tokens (as an 8B decode step on the H200 is weight-bound): a Qwen3-shaped model
(4 layers, hidden 256, a 4,096-token vocabulary, dummy fp32 weights); prompts of
`--input-len` random tokens, `--output-len` tokens out with ignore_eos; the cap is
`--input-len` (one prompt per step, as 512 is for 512-token prompts); no prefix caching.
Per configuration and concurrency: output tok/s, the mean number of decodes per step, TTFT
(added -> first token: in a closed loop, the wait in the queue) and the inter-token gap p50 /
p99 per stream (wall time).

    python -m bench.prefill_backlog
Writes `bench/results/prefill_backlog-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3Config  # noqa: E402

from bench.common import percentile, print_table, prompt_tokens_left, write_result  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.request import Request  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,  # a small head: the step's cost is the layers', as for an 8B model
)
VOCAB = SHAPE["vocab_size"]


def closed_loop(llm: LLM, concurrency: int, num_requests: int, args, seed: int) -> dict:
    """Keep `concurrency` streams in the engine until `num_requests` have finished; the first
    `concurrency` to finish are warm-up (the loop has not reached its steady state yet)."""
    core = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft, gaps = [], []
    decodes_per_step: list[int] = []
    prefill_per_step: list[int] = []  # prompt tokens computed in each measured step
    num_chunked_steps = 0
    num_started = num_done = num_tokens = 0
    start = None

    def add() -> None:
        nonlocal num_started
        rid = f"r{seed}-{num_started}"
        prompt = [rng.randrange(VOCAB) for _ in range(args.input_len)]
        core.add_request(Request(rid, prompt, params, llm.eos_token_ids))
        added[rid] = time.perf_counter()
        num_started += 1

    for _ in range(concurrency):
        add()

    while num_done < num_requests:
        left = prompt_tokens_left(core)
        outputs = core.step()
        now = time.perf_counter()
        measuring = start is not None
        if measuring:
            running = core.scheduler.running
            num_decodes = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
            decodes_per_step.append(num_decodes)
            prefill_per_step.append(left - prompt_tokens_left(core))
            num_chunked_steps += num_decodes < len(running)
        for o in outputs:
            if not o.new_token_ids:
                continue
            if measuring:
                num_tokens += len(o.new_token_ids)
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                else:
                    ttft.append(now - added[o.request_id])
            last[o.request_id] = now
            if o.finish_reason is not None:
                num_done += 1
                last.pop(o.request_id)
                if num_done == concurrency and start is None:
                    start, num_tokens = now, 0
                    last.clear()  # gaps of streams that began before the window: not counted
                if num_started < num_requests + concurrency:
                    add()
    elapsed = time.perf_counter() - start
    while core.has_unfinished_requests():  # the streams past the count: let them end
        core.step()
    return {
        "output_tok_s": num_tokens / elapsed,
        "mean_decodes_per_step": statistics.fmean(decodes_per_step),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "itl_p99_over_p50": percentile(gaps, 99) / percentile(gaps, 50),
        "num_steps": len(decodes_per_step),
        "prefill_tokens_per_step_p50": percentile(prefill_per_step, 50),
        "prefill_tokens_per_step_max": max(prefill_per_step),
        # Steps after which some running request was still mid-prompt (chunked).
        "chunked_step_fraction": num_chunked_steps / len(decodes_per_step),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="16,64,128")
    ap.add_argument("--num-requests", type=int, default=384, help="measured per point")
    ap.add_argument("--backlog-steps", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: the highest concurrency")
    ap.add_argument("--configs", default="fixed_cap,backlog,uncapped")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    configs = {
        "fixed_cap": (args.input_len, 0),
        "backlog": (args.input_len, args.backlog_steps),
        "uncapped": (0, 0),
    }
    configs = {name: configs[name] for name in args.configs.split(",")}
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        Qwen3Config(architectures=["Qwen3ForCausalLM"], dtype="float32", **SHAPE).save_pretrained(
            path
        )
        for name, (cap, steps) in configs.items():
            llm = LLM(
                str(path),
                load_format="dummy",
                dtype="float32",
                max_model_len=args.input_len + args.output_len,
                max_num_seqs=args.max_num_seqs or max(concurrencies),
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=cap,
                prefill_backlog_steps=steps,
                enable_prefix_caching=False,
                skip_tokenizer_init=True,
                async_scheduling=False,
            )
            closed_loop(llm, 8, 16, args, seed=99)  # warm-up
            results[name] = {}
            for seed, c in enumerate(concurrencies):
                r = results[name][str(c)] = closed_loop(llm, c, args.num_requests, args, seed)
                rows.append((name, str(c), f"{r['output_tok_s']:.0f}",
                             f"{r['mean_decodes_per_step']:.1f}",
                             f"{r['prefill_tokens_per_step_p50']:.0f}/"
                             f"{r['prefill_tokens_per_step_max']}",
                             f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f}",
                             f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f}",
                             f"{r['itl_p99_over_p50']:.1f}"))  # fmt: skip
                print(name, c, r, flush=True)
            del llm
    config = {
        "load_average_1m_after": os.getloadavg()[0],
        "model": "Qwen3 shape, dummy fp32 weights",
        "shape": SHAPE,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_requests_per_point": args.num_requests,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs or max(concurrencies),
        "configs": {
            k: {"max_prefill_tokens_while_decoding": cap, "prefill_backlog_steps": steps}
            for k, (cap, steps) in configs.items()
        },
    }
    for c in map(str, concurrencies) if {"fixed_cap", "backlog"} <= configs.keys() else ():
        fixed = results["fixed_cap"][c]["output_tok_s"]
        results["backlog"][c]["output_tok_s_over_fixed_cap"] = (
            results["backlog"][c]["output_tok_s"] / fixed
        )
    write_result("prefill_backlog", config, results, Path(args.out_dir))
    header = ("config", "conc", "out tok/s", "decodes/step", "prefill/step p50/max",
              "TTFT p50/p99", "ITL p50/p99",
              "p99/p50")  # fmt: skip
    print_table(rows, header)


if __name__ == "__main__":
    main()
