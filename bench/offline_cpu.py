"""Offline throughput on CPU: Tandem's `LLM.generate` vs transformers' batched `generate`.

What is measured: output tokens per second of greedy decoding, SmolLM2-135M-Instruct in fp32,
on this machine's CPU, both sides in the same process with the same torch thread count.

How:
- Prompts: `--num-prompts` windows of real English text (Python's bundled documentation,
  `pydoc_data.topics`) cut through the model tokenizer at seeded random offsets, with lengths
  uniform in [`--min-len`, `--max-len`] tokens. Same prompts for both sides.
- Tandem: `LLM(...)` built once (prefix caching off, so repeats cannot hit the cache), a small
  warmup `generate` on other text, then ONE `generate` over all prompts per trial with
  `SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)`.
- transformers: `AutoModelForCausalLM` from the same model folder (fp32, sdpa), a small warmup,
  then ONE `generate` per trial over the left-padded batch of all prompts, `do_sample=False`,
  `min_new_tokens = max_new_tokens = N`.
- Both must produce exactly N tokens per prompt; output tok/s = num_prompts * N / wall time.
  Each of `--repeats` trials runs Tandem then transformers; the headline figures use each
  side's best (minimum) wall time, as `timeit` does, since other work on the machine only ever
  adds time; medians are kept too. The CPU machine is shared, so each trial also records the
  process CPU time and the 1-minute load average: a load well above `--threads` means that
  trial was contended.
- Greedy token agreement (informational, first trial): left padding changes numerics slightly,
  and `min_new_tokens` masks EOS where `ignore_eos` does not, so outputs may diverge after a
  near-tie; the tokens after a divergence usually all differ.

Writes `bench/results/offline_cpu-<YYYY-MM-DD>.json` and prints a short table.
Run from the repo root: `python -m bench.offline_cpu` (or `python bench/offline_cpu.py`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import print_table, write_result  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
NUM_WARMUP_PROMPTS = 2
NUM_WARMUP_TOKENS = 4

# (prompts, num_new_tokens) -> output token ids per prompt, exactly num_new_tokens each
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True)
class BenchConfig:
    model: str
    dtype: str
    num_prompts: int
    max_tokens: int
    min_len: int
    max_len: int
    threads: int
    repeats: int
    seed: int


@dataclass
class Trial:
    """One timed `generate` over all prompts."""

    output_token_ids: list[list[int]]
    wall_s: float
    cpu_s: float  # process CPU time, all threads
    load_avg_1m: float  # right after the call


def corpus_token_ids(tokenizer) -> list[int]:
    """Real text, offline and deterministic: the topics of Python's bundled documentation."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def make_prompts(
    corpus: list[int], num_prompts: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """`num_prompts` windows of `corpus` with seeded random offsets and lengths."""
    assert 1 <= min_len <= max_len < len(corpus), (min_len, max_len, len(corpus))
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(min_len, max_len)
        start = rng.randrange(len(corpus) - prompt_len)
        prompts.append(corpus[start : start + prompt_len])
    return prompts


def load_engine(cfg: BenchConfig) -> GenerateFn:
    from engine import LLM, SamplingParams

    llm = LLM(
        cfg.model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_len + cfg.max_tokens,
        max_num_seqs=cfg.num_prompts,
        max_num_batched_tokens=max(8192, cfg.num_prompts * (cfg.max_len + 1)),
        enable_prefix_caching=False,
    )

    def generate(prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    return generate


def load_transformers(model_path: Path, cfg: BenchConfig) -> GenerateFn:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa"
    ).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.generation_config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id

    @torch.inference_mode()
    def generate(prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=pad_id,
        )
        return out[:, width:].tolist()

    return generate


def timed(generate: GenerateFn, prompts: list[list[int]], num_tokens: int) -> Trial:
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    token_ids = generate(prompts, num_tokens)
    wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    assert all(len(t) == num_tokens for t in token_ids), [len(t) for t in token_ids]
    return Trial(token_ids, wall_s, cpu_s, os.getloadavg()[0])


def summarize(trials: list[Trial], load_s: float, num_output_tokens: int) -> dict:
    best_wall_s = min(t.wall_s for t in trials)
    median_wall_s = statistics.median(t.wall_s for t in trials)
    return {
        "output_tok_per_s": num_output_tokens / best_wall_s,
        "wall_s": best_wall_s,
        "median_output_tok_per_s": num_output_tokens / median_wall_s,
        "median_wall_s": median_wall_s,
        "load_s": load_s,
        "trials": [
            {"wall_s": t.wall_s, "cpu_s": t.cpu_s, "load_avg_1m": t.load_avg_1m} for t in trials
        ],
    }


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Position-wise equality rate, rate of identical sequences, mean common-prefix length."""
    assert len(a) == len(b)
    total = equal = identical = 0
    prefix_lens = []
    for x, y in zip(a, b):
        assert len(x) == len(y), (len(x), len(y))
        total += len(x)
        equal += sum(i == j for i, j in zip(x, y))
        identical += x == y
        prefix_lens.append(next((k for k, (i, j) in enumerate(zip(x, y)) if i != j), len(x)))
    return {
        "token_agreement": equal / total,
        "identical_sequences": identical / len(a),
        "mean_common_prefix_tokens": sum(prefix_lens) / len(prefix_lens),
    }


def parse_args() -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=3, help="timed trials per side (best is kept)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt lengths and offsets")
    a = p.parse_args()
    return BenchConfig(
        MODEL,
        "float32",
        a.num_prompts,
        a.max_tokens,
        a.min_len,
        a.max_len,
        a.threads,
        a.repeats,
        a.seed,
    )


def main() -> None:
    cfg = parse_args()
    assert cfg.repeats >= 1
    torch.set_num_threads(cfg.threads)
    from engine.tokenizer import load_tokenizer
    from engine.weights import resolve_model_path

    model_path = resolve_model_path(cfg.model)
    corpus = corpus_token_ids(load_tokenizer(str(model_path)))
    prompts = make_prompts(corpus, cfg.num_prompts, cfg.min_len, cfg.max_len, cfg.seed)
    warmup = make_prompts(corpus, NUM_WARMUP_PROMPTS, cfg.min_len, cfg.min_len, cfg.seed + 1)

    sides: dict[str, GenerateFn] = {}
    load_s: dict[str, float] = {}
    for name, load in (
        ("tandem", lambda: load_engine(cfg)),
        ("transformers", lambda: load_transformers(model_path, cfg)),
    ):
        start = time.perf_counter()
        sides[name] = load()
        load_s[name] = time.perf_counter() - start
        sides[name](warmup, NUM_WARMUP_TOKENS)
    trials: dict[str, list[Trial]] = {name: [] for name in sides}
    for _ in range(cfg.repeats):
        for name, generate in sides.items():
            trials[name].append(timed(generate, prompts, cfg.max_tokens))

    num_output_tokens = cfg.num_prompts * cfg.max_tokens
    summary = {n: summarize(trials[n], load_s[n], num_output_tokens) for n in sides}
    ratio = summary["tandem"]["output_tok_per_s"] / summary["transformers"]["output_tok_per_s"]
    greedy = token_agreement(
        trials["tandem"][0].output_token_ids, trials["transformers"][0].output_token_ids
    )
    results = {
        "num_prompt_tokens": sum(len(p) for p in prompts),
        "num_output_tokens": num_output_tokens,
        **summary,
        "tandem_over_transformers": ratio,
        "greedy": greedy,
    }
    path = write_result("offline_cpu", asdict(cfg), results)

    print_table(
        [
            (
                name,
                f"{s['output_tok_per_s']:.1f}",
                f"{s['wall_s']:.2f}",
                " ".join(f"{t['wall_s']:.1f}" for t in s["trials"]),
                " ".join(f"{t['load_avg_1m']:.1f}" for t in s["trials"]),
            )
            for name, s in summary.items()
        ],
        header=("side", "output tok/s", "best wall s", "trial wall s", "trial load 1m"),
    )
    print(
        f"ratio tandem/transformers {ratio:.2f}x | greedy token agreement "
        f"{greedy['token_agreement']:.1%}, identical sequences {greedy['identical_sequences']:.1%}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
