"""No attention kernel variant is compiled while serving: start-up builds every one it meets.

Why: Triton compiles a kernel once per specialization of its arguments (which ints are 1 or
divisible by 16, which pointers are 16-byte aligned, the constexprs). The eager attention of a
mixed step passed values that change from step to step (the split count, the block table's
width, `seq_lens[d:]` for d decodes), so new variants kept appearing after start-up, each a
multi-second compile on a cold Triton cache: the ~5 s stall of a fresh machine's first
requests. This test asks Triton's own binder for an sm_90 launch (no GPU needed) which variant
each launch of `TritonPagedAttention` would use, under varied mixed batches, and checks each
one was already built by `warm_up`. Reverting the kernels' `do_not_specialize` lists fails it.
"""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import engine.attention_triton
from engine import LLM, SamplingParams
from engine.attention_triton import TritonPagedAttention
from engine.piecewise_graph import PiecewiseGraphs
from kernels.paged_decode_attention import DecodeRope
from kernels.utils import is_interpreting
from tests.engine.test_attention_triton import _meta

pytestmark = pytest.mark.skipif(not is_interpreting(), reason="records the interpreter's launches")

BLOCK_SIZE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 4, 2, 32
_SM90 = make_backend(GPUTarget("cuda", 90, 32))
_BINDERS: dict[int, tuple] = {}


def _specialization(fn: InterpretedFunction, args: tuple, kwargs: dict) -> tuple[str, list, list]:
    """(name, the declared constexprs and launch options (warps, stages), the specialization of
    every other argument) of a launch of `fn`, as Triton's own binder for sm_90 sees it."""
    entry = _BINDERS.get(id(fn))
    if entry is None:
        names = ("do_not_specialize", "do_not_specialize_on_alignment")
        jit = JITFunction(fn.fn, **{k: fn.kwargs.get(k) for k in names})
        binder = create_function_from_signature(jit.signature, jit.params, _SM90)
        entry = _BINDERS[id(fn)] = (binder, [p.is_constexpr for p in jit.params])
    binder, is_constexpr = entry
    _, specialization, _ = binder(*args, **kwargs)
    launch = sorted((k, v) for k, v in kwargs.items() if k not in fn.arg_names)
    declared = [s for s, c in zip(specialization, is_constexpr) if c] + launch
    return fn.fn.__name__, declared, [s for s, c in zip(specialization, is_constexpr) if not c]


def _variant(name: str, declared: list, others: list) -> tuple[str, str]:
    """What Triton compiles one variant of a kernel per (a `_specialization`)."""
    return name, repr((declared, others))


@pytest.fixture
def specializations(monkeypatch):
    """Every interpreted kernel launch's `_specialization`, in order."""
    seen: list[tuple[str, list, list]] = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.append(_specialization(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return seen


def _mixed_step(decode_lens: list[int], chunks: list[tuple[int, int]]):
    """Metadata of a step (as tests/engine's `_meta` builds it): decodes first (context lengths
    `decode_lens`), then prompt chunks (new tokens, cached prefix), over blocks 1, 2, ...;
    and its number of tokens."""
    computed = [n - 1 for n in decode_lens] + [prefix for _, prefix in chunks]
    new = [1] * len(decode_lens) + [n for n, _ in chunks]
    blocks = [-(-(c + n) // BLOCK_SIZE) for c, n in zip(computed, new)]
    tables = torch.zeros(len(new), max(blocks), dtype=torch.int32)
    for row, num_blocks in zip(tables, blocks):
        row[:num_blocks] = torch.arange(1, 1 + num_blocks)
    return _meta(computed, new, tables, BLOCK_SIZE), sum(new)


# (decodes' contexts, chunks as (new tokens, cached prefix)): split counts 1 to 5 and more,
# block tables 1, 16 and 17 blocks wide, 1 to 5 decodes before the prompt rows.
STEPS = [
    ([], [(40, 0)]),
    ([9], [(7, 0)]),
    ([20, 33], [(16, 0)]),
    ([100, 7, 64], [(5, 11)]),
    ([256, 3, 70, 130], [(8, 0), (3, 1)]),
    ([272, 40, 41, 42, 43], [(32, 240)]),
    ([300] * 2, []),
    ([5], []),
]


def test_serving_compiles_no_attention_variant_after_warm_up(specializations, monkeypatch):
    monkeypatch.setattr(engine.attention_triton, "ROPE_IN_ATTENTION", True)  # its variants too
    backend = TritonPagedAttention(static_max_seq_len=1024)
    kv_layer = torch.randn(40, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    backend.warm_up(kv_layer, NUM_Q_HEADS, torch.float32, num_tokens=48, qk_norm=True)
    built = {_variant(*launch) for launch in specializations}
    specializations.clear()
    cos_sin = torch.randn(512, HEAD_DIM)
    norm = torch.ones(HEAD_DIM)
    for decode_lens, chunks in STEPS:
        meta, num_tokens = _mixed_step(decode_lens, chunks)
        q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM)
        kv = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        backend.forward(q, kv, kv, kv_layer, meta, HEAD_DIM**-0.5, kv_written=True)
        if not chunks:  # a decode step: also with the RoPE work in the kernel, slots at an offset
            # of a step buffer as the runner's are (int64 slices 8-byte aligned, odd or even)
            buffers = torch.zeros(2, 1 + len(decode_lens), dtype=torch.int64)
            positions, slots = buffers[:, 1:].unbind(0)
            positions += torch.tensor(decode_lens) - 1
            slots.fill_(-1)
            rope = DecodeRope(kv, kv, slots, positions, cos_sin, norm, norm)
            assert backend.attend_rope(q, kv_layer, meta, HEAD_DIM**-0.5, rope) is not None
    kernels = {name for name, _, _ in specializations}
    assert kernels == {"_paged_decode_kernel", "_paged_decode_reduce_kernel",
                       "_prefill_attention_kernel"}  # fmt: skip
    new = sorted({_variant(*launch) for launch in specializations} - built)
    assert not new, f"{len(new)} variants first met while serving: {[n for n, _ in new]}"


@pytest.mark.parametrize("pieces", [False, True], ids=["eager", "pieces"])
def test_no_kernel_specializes_on_a_steps_shape(tiny_qwen3_path, specializations, pieces):
    """The whole CUDA model path (every Triton kernel: norms, RoPE with the KV store, SiLU-mul,
    attention), run by the engine under the interpreter through steps of odd and even token
    counts, mixed steps of 1 to 4 decodes, block tables of 1 to 4 blocks: for each kernel and
    each choice of its constexprs, every launch has the same specialization of its other
    arguments. A kernel that specialized on a value that changes with the step (the positions'
    offset into the step's buffer, a split count) would compile while serving. `pieces`: the
    prefill and mixed steps run as (uncaptured) piecewise graphs, padded to 8 or 16 tokens."""
    llm = LLM(str(tiny_qwen3_path), max_num_batched_tokens=13, max_num_seqs=4)
    runner = llm.engine.runner
    runner.attn_backend = TritonPagedAttention(static_max_seq_len=4096)
    runner.model.use_fused_kernels = True
    if pieces:
        runner.piecewise = PiecewiseGraphs(
            runner.model, runner.kv_cache, runner.attn_backend, [8, 16], use_graphs=False
        )
    prompts = [[3 + (7 * i + n) % 90 for i in range(n)] for n in (3, 9, 20, 41, 6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params)
    by_choice: dict[tuple[str, str], set[str]] = {}
    for name, declared, others in specializations:
        by_choice.setdefault((name, repr(declared)), set()).add(repr(others))
    assert {name for name, _ in by_choice} >= {
        "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
        "_paged_decode_kernel", "_prefill_attention_kernel",
    }  # fmt: skip
    varying = {name: len(found) for (name, _), found in by_choice.items() if len(found) > 1}
    assert not varying, f"specializations that follow the step (kernel: how many): {varying}"
