"""FP8 weights (`--quantization fp8`, engine/quantization.py): the quantizer's error bounds, the
independence its scales promise (per channel, per token), the layer against an unquantized
GEMM, the model rewrite, and SmolLM2's real weights against their unquantized selves."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.layers import Linear
from engine.quantization import FP8, Fp8Linear, quantize_linears_fp8, quantize_rows
from engine.serving import add_engine_args
from engine.weights import SMOLLM2_REPO_ID

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, and a
# value quantized against its row's maximum by at most 2^-4 of that maximum.
E4M3_REL = 2.0**-4


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rows_round_trip_within_e4m3_precision_of_their_own_maximum():
    w = torch.randn(64, 256, generator=_gen())
    w[3] *= 1e6  # an outlier channel, beyond e4m3's range (2^-9 .. 448) from the others
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    err = (q.float() * scale - w).abs()
    bound = E4M3_REL * w.abs().amax(dim=1, keepdim=True) + 1e-6
    assert (err <= bound).all()
    # Per channel: the outlier costs only its own channel; one scale for the whole tensor
    # would have flushed the other channels' small values to zero.
    others = torch.cat([w[:3], w[4:]])
    rel = (err[[i for i in range(64) if i != 3]].norm() / others.norm()).item()
    assert rel < 0.05
    tensor_scale = w.abs().max() / 448.0
    flat = ((w / tensor_scale).to(FP8).float() * tensor_scale - w)[[0, 1, 2]]
    assert (flat.norm() / w[[0, 1, 2]].norm()).item() > 0.5


def test_a_zero_row_stays_zero():
    q, scale = quantize_rows(torch.zeros(2, 32))
    assert torch.equal(q.float() * scale, torch.zeros(2, 32))


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_gemm_within_quantization_error(bias):
    lin = torch.nn.Linear(512, 384, bias=bias)
    x = torch.randn(7, 512, generator=_gen(1))
    ref = F.linear(x, lin.weight, lin.bias)
    out = Fp8Linear(lin.weight.detach(), lin.bias).forward(x)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert ((out - ref).norm() / ref.norm()).item() < 0.06


def test_each_tokens_result_is_independent_of_its_batch():
    """Per-token activation scales: a token with huge activations in the same batch leaves the
    others' quantized activations exactly as when each is quantized alone, and their results equal
    up to float32 summation order (a BLAS may sum a 1-row product and a 4-row one differently);
    one scale per tensor would flush the small rows to zero."""
    lin = Fp8Linear(torch.randn(96, 128, generator=_gen(2)), None)
    x = torch.randn(4, 128, generator=_gen(3))
    x[2] *= 1e4
    q_batch, scale_batch = quantize_rows(x)
    batched = lin(x)
    for i in range(4):
        q_alone, scale_alone = quantize_rows(x[i : i + 1])
        assert torch.equal(q_batch[i : i + 1].float(), q_alone.float())
        assert torch.equal(scale_batch[i : i + 1], scale_alone)
        alone = lin(x[i : i + 1])[0]
        torch.testing.assert_close(
            batched[i], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item()
        )


def test_the_decoder_projections_become_fp8_and_nothing_else(tiny_qwen3_path):
    llm = LLM(str(tiny_qwen3_path), max_model_len=64, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    num_layers = llm.config.model.num_layers
    assert quantize_linears_fp8(model) == 4 * num_layers  # qkv, o, gate_up, down
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * num_layers
    dtypes = {name: t.dtype for name, t in model.named_parameters()}
    assert all(d != FP8 for d in dtypes.values())  # embeddings, norms, LM head: unchanged


def test_quantization_flag_and_its_errors(tiny_qwen3_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["m", "--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["m", "-q", "fp8"]).quantization == "fp8"
    assert parser.parse_args(["m"]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--quantization", "awq"])
    with pytest.raises(ValueError, match="Unknown quantization method: awq"):
        EngineConfig.from_args(str(tiny_qwen3_path), quantization="awq")


def test_the_engine_loads_fp8_weights_and_counts_their_bytes(tiny_qwen3_path):
    kwargs = dict(max_model_len=64, skip_tokenizer_init=True, dtype="bfloat16")
    runner = LLM(str(tiny_qwen3_path), **kwargs).engine.runner
    runner8 = LLM(str(tiny_qwen3_path), quantization="fp8", **kwargs).engine.runner
    linear = sum(
        m.weight.numel() for m in runner.model.modules() if isinstance(m, Linear)
    )  # bf16: 2 bytes each; fp8: 1 byte plus 4 per output channel
    saved = runner.weights_bytes - runner8.weights_bytes
    assert linear * 0.9 < saved < linear
    out = LLM(str(tiny_qwen3_path), quantization="fp8", **kwargs).generate(
        [{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(out[0].outputs[0].token_ids) == 4


PASSAGE = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat "
    "from the sun evaporates water from the sea; the vapour rises, cools and condenses into "
    "clouds. When the droplets grow heavy they fall as rain or snow, which feeds rivers, lakes "
    "and groundwater, and the rivers carry the water back to the sea, where the cycle begins "
    "again. Plants return water to the air as well, through the pores of their leaves."
)


@pytest.mark.slow
def test_smollm2_fp8_agrees_with_its_unquantized_weights():
    """Real weights: next-token predictions over a passage (top-1 agreement, the passage's own
    tokens' log-probabilities) and a greedy answer, FP8 weights against the same checkpoint
    unquantized (fp32 on this CPU; the FP8 arithmetic is the GPU path's, dequantized)."""
    base, fp8 = LLM(SMOLLM2_REPO_ID, max_model_len=512), None
    fp8 = LLM(SMOLLM2_REPO_ID, max_model_len=512, quantization="fp8")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (a,) = base.generate([PASSAGE], params)
    (b,) = fp8.generate([PASSAGE], params)
    n = len(a.prompt_logprobs) - 1
    assert n > 60
    top = [
        (max(pa, key=lambda t: pa[t]), max(pb, key=lambda t: pb[t]))
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
    ]
    agreement = sum(x == y for x, y in top) / n
    ids = a.prompt_token_ids[1:]
    drift = [
        abs(pa[t] - pb[t]) for t, pa, pb in zip(ids, a.prompt_logprobs[1:], b.prompt_logprobs[1:])
    ]
    print(f"SmolLM2 FP8 weights: top-1 agreement {agreement:.3f}, mean |d logprob| "
          f"{sum(drift) / n:.3f} over {n} positions")  # fmt: skip
    assert agreement >= 0.85, agreement  # measured 0.900 (bf16 alone vs fp32: 0.956)
    assert sum(drift) / n < 0.3, sum(drift) / n  # measured 0.164 (bf16 alone: 0.036)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    answer = fp8.chat(question, greedy)[0].outputs[0].text
    assert "Paris" in answer and answer == base.chat(question, greedy)[0].outputs[0].text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 GEMMs need a CUDA GPU (sm89+)")
@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_the_scaled_mm_path_equals_the_reference(m):
    """On the GPU, Fp8Linear runs torch._scaled_mm; it must compute what the CPU path does."""
    w = torch.randn(512, 256, generator=_gen(4)).to(torch.bfloat16)
    bias = torch.randn(512, generator=_gen(5)).to(torch.bfloat16)
    x = torch.randn(m, 256, generator=_gen(6)).to(torch.bfloat16)
    cpu = Fp8Linear(w, bias)(x).float()
    gpu = Fp8Linear(w.cuda(), bias.cuda())(x.cuda()).float().cpu()
    assert ((gpu - cpu).norm() / cpu.norm()).item() < 0.01
