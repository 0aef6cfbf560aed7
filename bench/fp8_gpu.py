"""FP8 weights against bf16 on the H200, in one run (issue "Speed round 2", item 3).

Speed (Qwen3-8B shape, dummy weights; the copy and matmul ceilings measured in the same run):
- decode step time at batch 1, 8 and 32 (context 512), bf16 and `quantization="fp8"`, each
  next to its floor (weight + KV bytes) / copy bandwidth; the target is batch-1 fp8 <= 0.6 x bf16;
- offline throughput, N prompts of 512 in / 128 out (target fp8 >= 1.3 x bf16);
- each decoder GEMM of that shape alone at 1, 8 and 32 rows (GPU time, CUDA graphs): bf16,
  FP8 W8A8 (`torch._scaled_mm` after quantizing the activations) and FP8 weight-only (the
  Triton kernel decode sizes use, its default tile and the one tuned at start-up), each next
  to its weight bytes' floor.
Accuracy (SmolLM2-135M-Instruct, real weights, bf16 vs FP8 weights, both on the GPU): the bf16
model writes greedy continuations of a few prompts (a few thousand positions in all); the
models then score those texts (`prompt_logprobs=20`): top-1 agreement of the next-token
prediction, and KL(bf16 || fp8) over the tokens in both top-20 lists (a lower bound of the full
KL; the tail outside the top 20 holds little mass); then the greedy continuations are compared.
FP8 is scored on both of its paths: whole-prompt prefills (W8A8 `_scaled_mm`) and 32-token
chunks (every GEMM at decode sizes: the weight-only kernels).

    python -m bench.fp8_gpu --out-dir bench/results [--num-prompts 1000] [--skip-accuracy]
Writes `fp8_gpu-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
from pathlib import Path

import torch

from bench.common import print_table, write_result
from bench.gpu_engine import (
    ceilings,
    dummy_llm,
    make_config_dir,
    offline,
    random_prompts,
    step_read_bytes,
    step_times,
)
from engine import LLM, SamplingParams
from kernels.utils import graph_time_us

MODES = {"bf16": None, "fp8": "fp8"}
BATCHES = (1, 8, 32)
ACCURACY_PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper.",
    "List the steps to bake bread at home.",
    "Why is the sky blue? Answer in detail.",
    "Describe the water cycle for a school report.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "What should a traveller know before visiting Japan?",
    "Summarize the causes of the French Revolution.",
]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


GEMM_ROWS = (1, 2, 4, 8, 16, 32)
GEMM_SHAPES = {  # Qwen3-8B's decoder projections: (in, out)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 24576),
    "down": (12288, 4096),
}


def _gemm_row(w: torch.Tensor, lin, tuned: dict, m: int, ceil: dict) -> dict:
    from kernels.fp8_gemm import fp8_weight_gemm

    n, k = w.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return {
        "bf16_us": graph_time_us(lambda: torch.nn.functional.linear(x, w)),
        "w8a8_us": graph_time_us(lambda: lin.w8a8(x)),
        "weight_only_default_us": graph_time_us(
            lambda: fp8_weight_gemm(x, lin.weight, lin.weight_scale)
        ),
        "weight_only_tuned_us": graph_time_us(
            lambda: fp8_weight_gemm(x, lin.weight, lin.weight_scale, **tuned)
        ),
        "bf16_floor_us": 2 * n * k / (ceil["copy_GBps"] * 1e3),
        "fp8_floor_us": n * k / (ceil["copy_GBps"] * 1e3),
    }


@torch.inference_mode()
def gemms(ceil: dict) -> dict:
    """Each decoder GEMM alone; the tuned tiles as `tune_fp8_small_m` picks them."""
    from engine.quantization import Fp8Linear
    from kernels.fp8_gemm import choose_tiles

    out: dict = {"tiles": {}}
    for name, (k, n) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        lin = Fp8Linear(w, None)
        tuned, _ = choose_tiles(lin.weight, lin.weight_scale)
        out["tiles"][name] = {key: str(c) for key, c in tuned.items()}
        for m in GEMM_ROWS:
            out[f"{name}_m{m}"] = _gemm_row(w, lin, tuned, m, ceil)
    _free()
    return out


def speed(path: Path, quantization: str | None, ceil: dict, num_prompts: int) -> dict:
    llm = dummy_llm(path, quantization=quantization)
    runner = llm.engine.runner
    weight_bytes, kv_tok = runner.weights_bytes, llm.config.kv_bytes_per_token()
    n_params = sum(p.numel() for p in runner.model.parameters()) + sum(
        b.numel() for name, b in runner.model.named_buffers() if name.endswith("weight")
    )
    step_times(llm, random_prompts(2, 64, 99), 8)  # warm-up
    read_bytes = step_read_bytes(runner)  # one row of the input-embedding table, not all of it
    res: dict = {"weight_GB": weight_bytes / 1e9, "step_read_weight_GB": read_bytes / 1e9}
    tiles = {  # the weight-only kernel's tiles tuned at start-up (fp8), per weight shape
        f"{m.in_features}->{m.out_features}": {key: str(c) for key, c in m.tiles.items()}
        for m in runner.model.modules()
        if hasattr(m, "tiles")
    }
    if tiles:
        res["small_m_tiles"] = tiles
    for b in BATCHES:
        _, step = step_times(llm, random_prompts(b, 512, b), 64)
        floor, read_floor = (
            (w + b * 544 * kv_tok) / (ceil["copy_GBps"] * 1e9) for w in (weight_bytes, read_bytes)
        )
        res[f"b{b}"] = {
            "step_ms": step * 1e3,
            "floor_ms": floor * 1e3,
            "over_floor": step / floor,
            "read_floor_ms": read_floor * 1e3,
            "over_read_floor": step / read_floor,
        }
    del llm, runner
    _free()
    if not num_prompts:
        return res
    kwargs = {"quantization": quantization} if quantization else {}
    res["offline"] = offline(path, num_prompts, 256, 8192, n_params, ceil, **kwargs)
    _free()
    return res


def _agreement(a, b) -> dict:
    """Top-1 agreement and mean KL (over both top-20 lists) of two engines' prompt logprobs."""
    agree = positions = 0
    kls = []
    for oa, ob in zip(a, b):
        for pa, pb in zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:]):
            positions += 1
            agree += max(pa, key=pa.get) == max(pb, key=pb.get)
            both = [t for t in pa if t in pb]
            kls.append(sum(math.exp(pa[t]) * (pa[t] - pb[t]) for t in both))
    return {
        "positions": positions,
        "top1_agreement": agree / positions,
        "mean_kl_top20": sum(kls) / len(kls),
    }


def accuracy(prompts: list[str] = ACCURACY_PROMPTS, max_tokens: int = 384) -> dict:
    """bf16 against FP8 weights on both of FP8's paths: whole prompts in one prefill run every
    GEMM as W8A8 (`fp8`), prompts fed in chunks of MAX_M tokens run every GEMM through the
    weight-only kernels of decode sizes (`fp8_decode_sizes`)."""
    from engine.weights import SMOLLM2_REPO_ID
    from kernels.fp8_gemm import MAX_M

    engines = {"bf16": {}, "fp8": {"quantization": "fp8"}}
    engines["fp8_decode_sizes"] = {
        "quantization": "fp8",
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": MAX_M,
        "long_prefill_token_threshold": MAX_M,
    }
    llms = {
        # All engines in one process on one GPU: each a fixed KV cache (a memory fraction
        # counts the process's allocations, the first engine's too).
        m: LLM(
            SMOLLM2_REPO_ID,
            dtype="bfloat16",
            max_model_len=2048,
            kv_cache_memory_bytes=1 << 30,
            **kwargs,
        )
        for m, kwargs in engines.items()
    }
    base = llms["bf16"]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    texts = [o.prompt_token_ids + o.outputs[0].token_ids for o in base.chat(chats, greedy)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    seqs = [{"prompt_token_ids": t} for t in texts]
    scores = {m: llm.generate(seqs, score) for m, llm in llms.items()}
    short = SamplingParams(temperature=0, max_tokens=64)
    continuations = {m: llm.chat(chats, short) for m, llm in llms.items()}
    out: dict = {"model": "SmolLM2-135M-Instruct"}
    for m in llms:
        if m == "bf16":
            continue
        same = sum(
            x.outputs[0].token_ids == y.outputs[0].token_ids
            for x, y in zip(continuations["bf16"], continuations[m])
        )
        out[m] = _agreement(scores["bf16"], scores[m]) | {
            "greedy_64_identical": f"{same}/{len(chats)}"
        }
    del llms, base
    _free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-speed", action="store_true", help="the accuracy report alone")
    ap.add_argument("--skip-offline", action="store_true", help="decode steps and GEMMs only")
    args = ap.parse_args()
    results: dict = {}
    if not args.skip_speed:
        ceil = results["ceilings"] = ceilings()
        results["gemms"] = gemms(ceil)
        print_table(
            [(g, *(f"{r[c]:.1f}" for c in ("bf16_us", "w8a8_us", "weight_only_default_us",
                                           "weight_only_tuned_us", "fp8_floor_us")))
             for g, r in results["gemms"].items() if g != "tiles"],
            ("gemm", "bf16 us", "w8a8 us", "w-only us", "tuned us", "fp8 floor us"),
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            path = make_config_dir("qwen3-8b", Path(tmp))
            for mode, q in MODES.items():
                results[mode] = speed(path, q, ceil, 0 if args.skip_offline else args.num_prompts)
        bf16, fp8 = results["bf16"], results["fp8"]
        results["fp8_over_bf16"] = {
            f"b{b}_step": fp8[f"b{b}"]["step_ms"] / bf16[f"b{b}"]["step_ms"] for b in BATCHES
        }
        if not args.skip_offline:
            results["fp8_over_bf16"]["offline_tok_s"] = (
                fp8["offline"]["output_tok_s"] / bf16["offline"]["output_tok_s"]
            )
    name = "fp8_gpu_accuracy" if args.skip_speed else "fp8_gpu"
    config = {"model_shape": "qwen3-8b", "batches": BATCHES, "num_prompts": args.num_prompts}
    if not args.skip_speed:  # written before the accuracy part, and again with it
        write_result(name, config, results, Path(args.out_dir))
        rows = [
            (m, *(f"{results[m][f'b{b}']['step_ms']:.2f}" for b in BATCHES),
             f"{results[m].get('offline', {}).get('output_tok_s', 0):.0f}")
            for m in MODES
        ]  # fmt: skip
        print_table(rows, ("weights", *(f"b{b} ms" for b in BATCHES), "offline tok/s"))
    if not args.skip_accuracy:
        results["accuracy"] = accuracy()
        write_result(name, config, results, Path(args.out_dir))
        print(results["accuracy"])


if __name__ == "__main__":
    main()
