"""Batch-1 decode graphs on kernels/gemv.py's fused GEMVs give the tokens of cuBLAS (GPU; fp32
so greedy ties cannot flip)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
PROMPTS = [list(range(3, 40)), list(range(50, 61))]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(path, **kw) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=4, **kw)  # fmt: skip
    assert llm.engine.runner.graphs is not None
    out = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]  # batch 1
    del llm
    return out


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("pdl", [False, True])
def test_every_projection_on_the_gemv(tiny_qwen3_path, monkeypatch, quantization, pdl):
    """`pdl`: the GEMVs launched with programmatic dependent launch (kernels.gemv.PDL)."""
    import engine.models.layers as layers
    import kernels.gemv
    from kernels.gemv import GemvConfig

    q = {"quantization": quantization}
    expect = _tokens(tiny_qwen3_path, fused_decode=False, **q)  # cuBLAS / FP8 weight-only
    forced = []

    def every_projection(model, **_):
        for layer in model.layers:
            for name in layers.PROJECTIONS:
                layers.getattr_path(layer, name).gemv_config = GemvConfig(8, 256)
            layer.gemv = True
        forced.append(len(model.layers))
        return {}

    monkeypatch.setattr(layers, "tune_gemv", every_projection)
    monkeypatch.setattr(kernels.gemv, "PDL", pdl)
    assert _tokens(tiny_qwen3_path, fused_decode=True, **q) == expect
    assert forced, "the decode graphs were captured without the GEMVs"


def test_start_up_tuning_reports_each_projection(tiny_qwen3_path):
    from engine.models.layers import PROJECTIONS, tune_gemv

    llm = LLM(str(tiny_qwen3_path), device="cuda", dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=4)  # fmt: skip
    report = tune_gemv(llm.engine.runner.model)
    assert set(report) == set(PROJECTIONS)
    for row in report.values():
        assert row["today_us"] > 0 and row["gemv_us"] > 0
        assert row["fused"] == (row["gemv_us"] < 0.95 * row["today_us"])


@pytest.fixture(autouse=True)
def _free_cuda():
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
