"""Bad input raises a clear error naming the limit, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.scheduler import SchedulerFullError


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), max_model_len=64, num_gpu_blocks_override=32)


def _still_serves(llm: LLM) -> None:
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"length 70\).*maximum model length of 64"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=1))
    _still_serves(llm)


def test_batch_with_one_bad_prompt_leaves_engine_clean(llm):
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate([[5] * 10, [6] * 100], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    _still_serves(llm)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="cannot be empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    _still_serves(llm)


def test_out_of_vocab_token(llm):
    with pytest.raises(ValueError, match="vocab_size=2048"):
        llm.generate([[1, 2, 99999]], SamplingParams(max_tokens=1))
    _still_serves(llm)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"temperature": -1.0}, "temperature must be non-negative"),
        ({"n": 0}, "n must be at least 1"),
    ],
)
def test_bad_sampling_params(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_max_tokens_capped_at_max_model_len(llm):
    out = llm.generate([[7] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_unknown_model_path(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_malformed_config(tmp_path, tiny_llama_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_path, bad)
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config"):
        LLM(str(bad))
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    cfg["num_hidden_layers"] = -2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM(str(bad))
    cfg["num_hidden_layers"] = 2
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(bad))


def test_max_model_len_beyond_model(tiny_llama_path):
    with pytest.raises(ValueError, match=r"max_model_len \(100000\).*max_position_embeddings=512"):
        LLM(str(tiny_llama_path), max_model_len=100000)


def test_kv_cache_too_small_for_one_request(tiny_llama_path):
    with pytest.raises(ValueError, match="estimated maximum model length is 96"):
        LLM(str(tiny_llama_path), max_model_len=512, num_gpu_blocks_override=7)


def test_admission_limits_refuse_fast(tiny_llama_path):
    llm = LLM(
        str(tiny_llama_path), max_model_len=64, num_gpu_blocks_override=32, max_num_queued_reqs=2
    )
    with pytest.raises(SchedulerFullError, match="max_num_queued_reqs=2"):
        llm.generate([[5, 6]] * 3, SamplingParams(max_tokens=1))
    _still_serves(llm)
    llm2 = LLM(
        str(tiny_llama_path), max_model_len=64, num_gpu_blocks_override=32, max_num_queued_tokens=30
    )
    with pytest.raises(SchedulerFullError, match="max_num_queued_tokens=30"):
        llm2.generate([[5] * 20, [6] * 20], SamplingParams(max_tokens=1))
    _still_serves(llm2)
