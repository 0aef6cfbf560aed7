"""What `--kv-cache-dtype fp8` costs in accuracy: SmolLM2-135M-Instruct (real weights), the same
engine with a 16/32-bit KV cache and with an FP8 e4m3 one (scale 1.0).

- Next-token distributions, teacher-forced: windows of real text (Python's bundled
  documentation, `pydoc_data.topics`, cut at seeded offsets) go through the engine as prompts
  with `prompt_logprobs`, and the full logits of every prompt position are captured at the
  model's `compute_logits`. Per position: whether the top-1 token agrees, and
  KL(reference || fp8) in nats. Prefill attention reads the K/V it has just stored, so every
  position after the first sees FP8 keys and values.
- Greedy continuations: each window's first 64 tokens as a prompt, 32 tokens out, compared
  token by token (share equal, and how many prompts match in full).

    python -m bench.fp8_kv_accuracy [--device cuda --dtype bfloat16]
Writes `bench/results/fp8_kv_accuracy[_<device>][_<dtype>]-<date>.json` (device off CPU, dtype
when given).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import print_table, write_result  # noqa: E402
from bench.offline_cpu import corpus_token_ids, make_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.weights import SMOLLM2_REPO_ID  # noqa: E402


def prompt_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits at every position but the last ([len - 1, vocab], fp32): what the
    model predicted for the next prompt token, computed through the engine and its KV cache."""
    model = llm.engine.runner.model
    real, captured = model.compute_logits, []

    def capture(hidden):
        logits = real(hidden)
        if hidden.shape[0] > 1:  # the prompt rows (decode rows come one per sequence)
            captured.append(logits.float().cpu())
        return logits

    model.compute_logits = capture
    try:
        out = []
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        for p in prompts:  # one at a time: one captured tensor per prompt
            captured.clear()
            llm.generate([{"prompt_token_ids": p}], params)
            out.append(torch.cat(captured)[: len(p) - 1])
    finally:
        model.compute_logits = real
    return out


def compare(ref: list[torch.Tensor], fp8: list[torch.Tensor]) -> dict:
    """Top-1 agreement and KL(ref || fp8) over all positions."""
    agree, kls = [], []
    for a, b in zip(ref, fp8):
        agree.append((a.argmax(-1) == b.argmax(-1)).float())
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kls.append((la.exp() * (la - lb)).sum(-1))
    agree_t, kl_t = torch.cat(agree), torch.cat(kls)
    return {
        "num_positions": agree_t.numel(),
        "top1_agreement": agree_t.mean().item(),
        "kl_mean": kl_t.mean().item(),
        "kl_p99": kl_t.quantile(0.99).item(),
        "kl_max": kl_t.max().item(),
    }


def make_llm(args, kv_cache_dtype: str) -> LLM:
    on_gpu = args.device != "cpu"
    return LLM(
        SMOLLM2_REPO_ID,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.window + 8,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
        # GPU: a fixed cache, not a memory fraction (which would count the first engine's).
        kv_cache_memory_bytes=(1 << 30) if on_gpu else None,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="the model's (CPU: fp32)")
    ap.add_argument("--num-windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    ref_llm = make_llm(args, "auto")
    corpus = corpus_token_ids(ref_llm.tokenizer)
    windows = make_prompts(corpus, args.num_windows, args.window, args.window, args.seed)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    starts = [{"prompt_token_ids": w[:64]} for w in windows]
    ref_logits = prompt_logits(ref_llm, windows)
    ref_out = [o.outputs[0].token_ids for o in ref_llm.generate(starts, greedy)]
    ref_kv_dtype = str(ref_llm.engine.runner.kv_cache.dtype)
    ref_blocks = ref_llm.engine.runner.kv_cache.shape[0]
    del ref_llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    fp8_llm = make_llm(args, "fp8")
    assert fp8_llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    fp8_logits = prompt_logits(fp8_llm, windows)
    fp8_out = [o.outputs[0].token_ids for o in fp8_llm.generate(starts, greedy)]
    results = compare(ref_logits, fp8_logits)
    same = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(ref_out, fp8_out)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(ref_out, fp8_out)]  # fmt: skip
    results |= {
        "greedy_token_agreement": statistics.fmean(same),
        "greedy_prompts_identical": sum(d == len(o) for d, o in zip(first_diff, ref_out)),
        "greedy_first_divergence": first_diff,
        "num_greedy_prompts": len(ref_out),
        "reference_kv_dtype": ref_kv_dtype,
        "kv_blocks_reference": ref_blocks,
        "kv_blocks_fp8": fp8_llm.engine.runner.kv_cache.shape[0],
    }
    config = {
        "model": SMOLLM2_REPO_ID,
        "device": args.device,
        "dtype": str(fp8_llm.config.model.dtype),
        "kv_cache_dtype": "fp8 (e4m3, scale 1.0)",
        "num_windows": args.num_windows,
        "window_tokens": args.window,
        "text": "pydoc_data.topics, seeded windows",
        "load_average_1m": os.getloadavg()[0],
    }
    suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
    suffix += "" if args.dtype == "auto" else f"_{args.dtype}"
    write_result(f"fp8_kv_accuracy{suffix}", config, results, Path(args.out_dir))
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in results.items()]
    print_table(rows, ("figure", "value"))


if __name__ == "__main__":
    main()
