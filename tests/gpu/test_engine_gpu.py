"""The engine on CUDA: Triton kernels + CUDA graphs give the CPU engine's tokens (fp32), graph
replay equals eager, and bf16 SmolLM2 follows transformers on the GPU.

GPU only: `TRITON_INTERPRET=0 pytest -m gpu tests/gpu` (skipped cleanly without CUDA)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from engine import LLM, SamplingParams
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
PROMPTS = [list(range(3, 60)), [5, 6, 7], list(range(100, 400, 3)), [9] * 33]


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "eager"])
def test_gpu_fp32_equals_cpu(tiny_model_path, mode):
    """With piecewise graphs, 60-token steps: prompt chunks and mixed steps replay pieces (a
    20-token step padded to the 24-token pieces)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(max_model_len=256, dtype="float32", num_gpu_blocks_override=128)
    kw["max_num_batched_tokens"] = 60
    cpu = LLM(str(tiny_model_path), device="cpu", **kw).generate(PROMPTS, params)
    graphs = {} if mode == "eager" else {"cudagraph_mode": mode}
    gpu = LLM(
        str(tiny_model_path),
        device="cuda",
        enforce_eager=mode == "eager",
        **graphs,
        **kw,
    )
    runner = gpu.engine.runner
    assert (runner.graphs is None) == (mode == "eager")
    assert (runner.piecewise is not None) == (mode == "FULL_AND_PIECEWISE")
    steps = []
    if runner.piecewise is not None:
        run = runner.piecewise.run
        runner.piecewise.run = lambda x, n, meta: steps.append(n) or run(x, n, meta)
    out = gpu.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in cpu]
    if mode == "FULL_AND_PIECEWISE":
        sizes = runner.piecewise.sizes
        assert 60 in steps and any(n not in sizes for n in steps), "full and padded pieces ran"


def test_cuda_graph_replay_equals_eager_bf16(tiny_qwen3_path):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(max_model_len=256, dtype="bfloat16", device="cuda", num_gpu_blocks_override=256)
    prompts = PROMPTS * 5  # 20 sequences: a padded graph size (32)
    graph = LLM(str(tiny_qwen3_path), **kw).generate(prompts, params)
    eager = LLM(str(tiny_qwen3_path), enforce_eager=True, **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]


def test_seeded_sampling_gpu_equals_cpu(tiny_qwen3_path):
    params = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=16, ignore_eos=True)
    kw = dict(max_model_len=256, dtype="float32", num_gpu_blocks_override=128)
    cpu = LLM(str(tiny_qwen3_path), device="cpu", **kw).generate(PROMPTS[:2], params)
    gpu = LLM(str(tiny_qwen3_path), device="cuda", **kw).generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


SMOLLM2 = os.environ.get("TANDEM_SMOLLM2_PATH", "HuggingFaceTB/SmolLM2-135M-Instruct")
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
]


def test_smollm2_bf16_first_32_tokens_match_transformers():
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import apply_chat_template
    from engine.weights import resolve_model_path

    try:
        path = resolve_model_path(SMOLLM2)
    except (OSError, FileNotFoundError, ValueError) as e:
        pytest.skip(f"SmolLM2 not available here: {e}")
    llm = LLM(SMOLLM2, max_model_len=512, dtype="bfloat16", device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    prompts = [
        apply_chat_template(llm.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    report = []
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        ours = out.outputs[0].token_ids
        with torch.no_grad():
            for i, tok in enumerate(ours):
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
                ref = int(logits.argmax())
                if ref != tok:
                    top2 = logits.topk(2).values
                    margin = float(top2[0] - top2[1])
                    report.append(
                        (len(report), i, ref, tok, margin, float(logits[ref] - logits[tok]))
                    )
                    break
                ids.append(tok)
    print("divergences (prompt, position, hf, ours, hf top-2 margin, hf logit gap):", report)
    # bf16 logits of ~20 have a resolution of 0.125, and reductions differ between kernels, so
    # the two argmaxes may break an exact tie differently. A divergence is accepted only where
    # transformers' own top two logits are within one bf16 step (measured on the H200: 2 of 5
    # prompts identical for 32 tokens, 3 diverged at exact ties, gap 0.0).
    assert all(gap <= 0.125 for *_, gap in report), report


def test_spec_decode_gpu_fp32_equals_cpu_without_speculation(tiny_repetitive_path):
    """Verify steps on CUDA (eager, Triton prefill kernel over the paged context) mixed with
    graph-replayed decode steps: the CPU engine's tokens without speculation, greedy and
    seeded, with drafts accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    kw = dict(max_model_len=256, dtype="float32", num_gpu_blocks_override=128)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    seeded = SamplingParams(temperature=0.15, seed=3, max_tokens=64, ignore_eos=True)
    cpu = LLM(str(tiny_repetitive_path), device="cpu", **kw)
    gpu = LLM(str(tiny_repetitive_path), device="cuda", speculative_config=spec, **kw)
    assert gpu.engine.runner.graphs is not None and not gpu.engine.runner.async_scheduling
    for params in (greedy, seeded):
        want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params)]
        assert [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)] == want
    assert gpu.engine.stats().spec_decode.num_accepted_tokens > 0


@contextlib.contextmanager
def compiles_recorded(names: list[str]):
    """Append the name of every Triton kernel variant built meanwhile (an in-memory cache miss:
    on a cold disk cache, a compile of seconds)."""

    def hook(*, fn, **_):
        names.append(fn.name)
        return False  # compile it as usual

    from triton import knobs

    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = None


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_no_kernel_compiles_after_start_up(tiny_qwen3_path, mode):
    """A fresh machine's Triton cache is cold, so a kernel variant first built while serving
    stalls every running request for seconds (bench/README.md: the first-wave stall). Start-up
    must build every variant steps use: here mixed steps of 1 to 7 decodes beside prompt chunks,
    odd and even token counts, block tables 1 to 20 blocks wide, single-pass and split decode
    attention; FULL_DECODE_ONLY runs the chunked steps eagerly (every kernel at the step's
    token count), FULL_AND_PIECEWISE replays pieces around eager attention."""
    llm = LLM(
        str(tiny_qwen3_path), device="cuda", dtype="bfloat16", max_model_len=512,
        num_gpu_blocks_override=256, max_num_batched_tokens=61, cudagraph_mode=mode,
    )  # fmt: skip
    lengths = (5, 17, 40, 77, 130, 260, 301)
    prompts = [[3 + (i * 7 + n) % 200 for i in range(n)] for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    compiled: list[str] = []
    with compiles_recorded(compiled):
        outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [40] * len(prompts)
    assert not compiled, f"built while serving: {compiled}"
