"""logit_bias as vLLM applies it: added to the logits after the raw logprobs, before min_tokens
and the penalties; out-of-vocabulary ids refused with vLLM's message."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_logit_bias,
    is_argmax_only,
    is_plain_greedy,
)
from engine.sampling_params import StructuredOutputsParams

PROMPT = [11, 250, 7, 1200, 42]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_path):
    return LLM(str(tiny_qwen3_path), max_model_len=128)


@pytest.mark.parametrize("seed", [None, 3])
def test_plus_100_forces_the_token(llm, seed):
    params = SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        max_tokens=6,
        ignore_eos=True,
        logit_bias={777: 100.0},
    )
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == [777] * 6


def test_minus_100_forbids_the_argmax_and_logprobs_stay_raw(llm):
    free = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    lps = llm.generate([PROMPT], free)[0].outputs[0].logprobs[0]
    best, second = sorted(lps, key=lps.get, reverse=True)[:2]
    biased = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, logit_bias={best: -100.0})
    out = llm.generate([PROMPT], biased)[0].outputs[0]
    assert out.token_ids == [second]
    # Logprobs are the model's (raw), as in vLLM: the bias does not show in them.
    assert out.logprobs[0][second] == pytest.approx(lps[second], abs=1e-5)


def test_out_of_vocab_ids_are_refused(llm):
    params = SamplingParams(max_tokens=2, logit_bias={5: 1.0, 2048: 2.0, -1: 1.0})
    with pytest.raises(ValueError) as e:
        llm.generate([PROMPT], params)
    assert str(e.value) == (
        "token_id(s) [2048, -1] in logit_bias contain out-of-vocab token ids. Vocabulary size: 2048"
    )
    assert not llm.engine.has_unfinished_requests()


def test_bias_comes_before_min_tokens(llm):
    eos = next(iter(llm.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, logit_bias={eos: 100.0})
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and eos not in out.token_ids[:3]
    assert out.finish_reason == "stop"


def _batch(params: SamplingParams, prompt: list[int]) -> SamplingBatch:
    return SamplingBatch([params], [None], [prompt], [[]], [set()])


def test_bias_comes_before_the_penalties():
    """Token 1 was seen (repetition 2.0) and gets +1.0: vLLM order gives (1.0 + 1.0) / 2 = 1.0
    < 1.2, so token 0 wins; penalising first would give 1.0 / 2 + 1.0 = 1.5 and token 1."""
    logits = torch.tensor([[1.2, 1.0, -5.0, -5.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={1: 1.0})
    assert Sampler()(logits, _batch(params, prompt=[1])).token_ids == [0]
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_apply_logit_bias_rows_and_values():
    logits = torch.zeros(3, 5)
    params = [
        SamplingParams(logit_bias={0: 1.5, 4: -2.0}),
        SamplingParams(),
        SamplingParams(logit_bias={2: 100.0}),
    ]
    apply_logit_bias(logits, params)
    assert logits.tolist() == [
        [1.5, 0.0, 0.0, 0.0, -2.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 100.0, 0.0, 0.0],
    ]


def test_biased_or_constrained_requests_are_not_plain_greedy():
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={3: 1.0})
    so = StructuredOutputsParams(regex="[0-9]+")
    constrained = SamplingParams(temperature=0.0, structured_outputs=so)
    assert is_plain_greedy(greedy, 0)
    assert not is_plain_greedy(biased, 0) and not is_argmax_only(biased, 0)
    # A grammar's mask is applied before the sampler: its argmax is still the whole sampler,
    # but the decode graphs' on-device argmax (async scheduling) cannot take it.
    assert is_argmax_only(constrained, 0) and not is_plain_greedy(constrained, 0)
