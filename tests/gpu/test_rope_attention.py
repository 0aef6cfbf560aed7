"""Decode steps with the RoPE work in the attention kernel (engine.attention_triton's
ROPE_IN_ATTENTION), with and without its programmatic dependent launch, give the tokens of the
RoPE kernel followed by attention (GPU, CUDA graphs; fp32 so greedy ties cannot flip)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(7, 90, 3))]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(path) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=4)  # fmt: skip
    assert llm.engine.runner.graphs is not None
    single = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]  # batch 1
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]  # batch 3
    del llm
    return single + batched


@pytest.mark.parametrize("pdl", [False, True])
def test_rope_in_attention_decodes_the_same_tokens(tiny_qwen3_path, monkeypatch, pdl):
    import engine.attention_triton
    import kernels.paged_decode_attention

    monkeypatch.setattr(engine.attention_triton, "ROPE_IN_ATTENTION", False)
    expect = _tokens(tiny_qwen3_path)
    monkeypatch.setattr(engine.attention_triton, "ROPE_IN_ATTENTION", True)
    monkeypatch.setattr(kernels.paged_decode_attention, "PDL", pdl)
    fused = []
    attend_rope = engine.attention_triton.TritonPagedAttention.attend_rope

    def recorded(self, *args, **kwargs):
        out = attend_rope(self, *args, **kwargs)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(engine.attention_triton.TritonPagedAttention, "attend_rope", recorded)
    assert _tokens(tiny_qwen3_path) == expect
    assert any(fused), "no decode step took the RoPE-in-attention kernel"
