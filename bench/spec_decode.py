"""N-gram speculative decoding: acceptance rate and TPOT against K (num_speculative_tokens).

For K in {0, 1, 2, 4} (0: speculation off) and batch sizes {1, 32}, on two workloads:
- `repeat`: chat prompts that ask the model to repeat a long passage of this repository's
  source code word for word (code-like / retrieval-like text: the n-gram drafts come from the
  prompt);
- `random`: prompts of random token ids (nothing to look up: the drafts' overhead alone).
Measured by driving the engine core as its loop does (steps back to back): per request the
time from its first token to its last over its output tokens - 1 (TPOT; median over the
batch), the drafts' acceptance rate (accepted / drafted tokens), the mean tokens per verify
step, and whether the greedy tokens equal those of K = 0 (bf16 may flip a near tie).

Verify steps run on the piecewise CUDA graphs, attention eagerly between them (the decode
graphs hold one token per request), and async scheduling is off under speculation; steps
without drafts still replay the decode graphs. Each batch is warmed up whole first: a verify
step's kernels compile on the first step of their shape.

    python -m bench.spec_decode                         # GPU: SmolLM2-135M-Instruct, real weights
    python -m bench.spec_decode --dummy-shape qwen3-8b  # GPU: Qwen3-8B shape, random weights
    python -m bench.spec_decode --tiny                  # CPU: a tiny repetitive model, smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO_ROOT, RESULTS_DIR, print_table, write_result
from engine import LLM, SamplingParams
from engine.request import Request
from engine.tokenizer import apply_chat_template

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
PASSAGE_FILES = [
    "engine/block_pool.py",
    "engine/kv_cache_manager.py",
    "engine/scheduler.py",
    "engine/request.py",
    "engine/sampler.py",
    "engine/detokenizer.py",
    "engine/output_processor.py",
    "engine/spec_decode.py",
]


def passages(num: int, num_chars: int) -> list[str]:
    """`num` code passages of about `num_chars` characters, cut from the engine's sources."""
    texts = [(REPO_ROOT / f).read_text() for f in PASSAGE_FILES]
    out = []
    for i in range(num):
        text = texts[i % len(texts)]
        start = (i // len(texts)) * num_chars % max(len(text) - num_chars, 1)
        out.append(text[start : start + num_chars])
    return out


def repeat_prompts(llm: LLM, num: int, num_chars: int) -> list[list[int]]:
    tok = llm.tokenizer
    prompts = []
    for passage in passages(num, num_chars):
        messages = [
            {
                "role": "user",
                "content": "Repeat the following code exactly, line for line, with no "
                f"comments of your own:\n\n{passage}",
            }
        ]
        prompts.append(apply_chat_template(tok, messages, add_generation_prompt=True))
    return prompts


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (num, length), generator=g).tolist()


def make_prompts(workload: str, llm: LLM, num: int, args) -> list[list[int]]:
    if workload == "repeat":
        return repeat_prompts(llm, num, args.passage_chars)
    return random_prompts(num, 40 if args.tiny else 256, llm.config.model.vocab_size)


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """One batch alone; per request: first-token and last-token times, tokens."""
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"s{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        core.add_request(Request(rid, p, params))
    stats = core.scheduler.spec_stats
    drafted, accepted, verifies = (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_drafts,
    )
    first, last, tokens = {}, {}, {rid: [] for rid in ids}
    num_steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        outs = core.step()
        num_steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                tokens[o.request_id].extend(o.new_token_ids)
    wall_s = time.perf_counter() - start
    tpot = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    drafted = stats.num_draft_tokens - drafted
    accepted = stats.num_accepted_tokens - accepted
    verifies = stats.num_drafts - verifies
    return {
        "tpot_ms": 1e3 * statistics.median(tpot),
        "output_tok_per_s": sum(len(t) for t in tokens.values()) / wall_s,
        "num_steps": num_steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_verify": 1 + accepted / verifies if verifies else 1.0,
        "tokens": [tokens[r] for r in ids],
    }


def profile_batch(llm: LLM, prompts: list[list[int]], top: int = 12) -> dict:
    """A batch of 24 tokens under torch.profiler: per step, the ops with the most host time
    (self CPU) and the most device time (self CUDA), in ms per engine step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    core, phases = llm.engine, {"schedule": 0.0, "execute": 0.0}

    def timed(name, fn):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                phases[name] += time.perf_counter() - t

        return wrapped

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.runner.execute = timed("execute", core.runner.execute)
    start = time.perf_counter()
    try:
        with profile(activities=acts) as prof:
            r = run_batch(llm, prompts, 24)
    finally:
        del core.scheduler.schedule, core.runner.execute  # the classes' methods again
    wall = time.perf_counter() - start
    ev = prof.key_averages()
    steps = r["num_steps"]

    def rank(attr: str) -> dict:
        rows = sorted(ev, key=lambda e: getattr(e, attr), reverse=True)[:top]
        return {e.key[:80]: round(getattr(e, attr) / 1e3 / steps, 4) for e in rows}

    return {
        "steps": steps,
        "wall_ms_per_step": round(1e3 * wall / steps, 4),
        "phase_ms_per_step": {k: round(1e3 * v / steps, 4) for k, v in phases.items()},
        "host_ms_per_step": rank("self_cpu_time_total"),
        "device_ms_per_step": rank("self_device_time_total") if torch.cuda.is_available() else {},
    }


def make_llm(model: str, k: int, args, **kw) -> LLM:
    spec = None
    if k:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    return LLM(
        model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
        speculative_config=spec,
        seed=0,
        **kw,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2, help="real weights (default SmolLM2-135M)")
    parser.add_argument(
        "--dummy-shape",
        choices=["qwen3-0.6b", "qwen3-8b"],
        default=None,
        help="random weights of this shape instead of --model (drafts rarely accepted: the "
        "verify overhead, not the gain)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model")
    parser.add_argument(
        "--ks",
        type=int,
        nargs="+",
        default=[0, 1, 2, 4],
        help="K values; the first is the baseline",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passage-chars", type=int, default=1500)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each measured batch, one more of 24 tokens under torch.profiler: the ops "
        "with most host and most device time (into the JSON and printed)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    kw: dict = {}
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if args.tiny:
        from tests.fixtures.tiny_models import make_repetitive_checkpoint

        model = str(make_repetitive_checkpoint(Path(tmp.name) / "tiny"))
        kw["device"] = "cpu"
        args.max_model_len = 512
        args.max_tokens = min(args.max_tokens, 48)
        args.passage_chars = min(args.passage_chars, 300)
        args.batch_sizes = [b if b == 1 else min(b, 8) for b in args.batch_sizes]
    elif args.dummy_shape:
        from bench.gpu_engine import make_config_dir
        from bench.structured_output import qwen3_tokenizer
        from tests.fixtures.tiny_models import CHAT_TEMPLATE

        path = make_config_dir(args.dummy_shape, Path(tmp.name))
        tok = qwen3_tokenizer()  # the repeat workload's chat prompts need Qwen3's tokenizer
        tok.chat_template = CHAT_TEMPLATE  # Qwen-style ChatML, as Qwen3 renders a user turn
        tok.save_pretrained(path)
        model = str(path)
        kw["load_format"] = "dummy"

    rows, results, baseline = [], [], {}
    for k in args.ks:
        llm = make_llm(model, k, args, **kw)
        for name in ("repeat", "random"):
            for bs in args.batch_sizes:
                prompts = make_prompts(name, llm, bs, args)
                # Warm-up, the whole batch: a verify step's kernels compile (Triton
                # specializations) on the first step of their shape, and one compile inside
                # the measured batch adds ~10 ms to every request's TPOT.
                run_batch(llm, prompts, 16)
                r = run_batch(llm, prompts, args.max_tokens)
                tokens = r.pop("tokens")
                base = baseline.setdefault((name, bs), {"tokens": tokens, "tpot_ms": r["tpot_ms"]})
                r["same_tokens_as_k0"] = tokens == base["tokens"]
                r["speedup_vs_k0"] = base["tpot_ms"] / r["tpot_ms"]
                if args.profile:
                    r["profile"] = profile_batch(llm, prompts)
                    print(f"{name} batch {bs} K={k}:", json.dumps(r["profile"], indent=1))
                results.append({"workload": name, "batch_size": bs, "k": k, **r})
                rows.append(
                    (
                        name,
                        str(bs),
                        str(k),
                        f"{r['acceptance_rate']:.2f}",
                        f"{r['mean_tokens_per_verify']:.2f}",
                        f"{r['tpot_ms']:.2f}",
                        f"{r['speedup_vs_k0']:.2f}x",
                        f"{r['output_tok_per_s']:.0f}",
                        "yes" if r["same_tokens_as_k0"] else "NO",
                    )
                )
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r[0], int(r[1]), int(r[2])))
    k0 = args.ks[0]
    header = (
        "workload", "batch", "K", "accept", "tok/verify", "TPOT ms", f"vs K={k0}", "tok/s",
        f"same as K={k0}",
    )  # fmt: skip
    print_table(rows, header)
    config = {
        "model": args.dummy_shape or ("tiny-repetitive" if args.tiny else args.model),
        "load_format": "dummy" if args.dummy_shape else "real",
        "device": "cpu" if args.tiny else ("cuda" if torch.cuda.is_available() else "cpu"),
        "ks": args.ks,
        "batch_sizes": args.batch_sizes,
        "max_tokens": args.max_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "passage_chars": args.passage_chars,
    }
    if not args.no_write:
        name = "spec_decode" + ("-tiny" if args.tiny else "")
        print(write_result(name, config, {"runs": results}, results_dir=args.out_dir))
    tmp.cleanup()


if __name__ == "__main__":
    main()
