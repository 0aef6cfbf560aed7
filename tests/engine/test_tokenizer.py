"""Tiny checkpoints load in transformers; tokenizer helpers encode, template and find EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tokenizer import apply_chat_template, encode_prompt, get_eos_token_ids, load_tokenizer
from tests.fixtures.tiny_models import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    VOCAB_SIZE,
    make_tiny_checkpoint,
)

# Fixtures `tiny_qwen3_path`, `tiny_llama_path`, `tiny_model_path` come from tests/conftest.py.


def test_checkpoint_loads_with_transformers(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = model.config
    assert model.dtype == torch.float32
    assert (tiny_model_path / "model.safetensors").is_file()
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert config.max_position_embeddings == 512
    assert config.rope_parameters["rope_theta"] == 10000.0
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if config.model_type == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["original_max_position_embeddings"] == 64
        assert config.tie_word_embeddings and tied
    else:
        assert config.model_type == "qwen3"
        assert not config.tie_word_embeddings and not tied
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID]
    assert set(tokenizer.all_special_ids) == {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}
    assert tokenizer.eos_token_id == IM_END_ID == config.eos_token_id


def test_generation_config(tiny_qwen3_path: Path, tiny_llama_path: Path) -> None:
    qwen3 = json.loads((tiny_qwen3_path / "generation_config.json").read_text())
    llama = json.loads((tiny_llama_path / "generation_config.json").read_text())
    assert qwen3["eos_token_id"] == llama["eos_token_id"] == IM_END_ID
    assert (qwen3["temperature"], qwen3["top_p"], qwen3["top_k"]) == (0.6, 0.95, 20)
    assert qwen3["do_sample"] is True
    assert not {"temperature", "top_p", "top_k", "do_sample"} & llama.keys()


def test_greedy_outputs_are_not_degenerate(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = load_tokenizer(tiny_model_path)
    for prompt in ["Hello, world!", "The capital of France is", "def main():"]:
        input_ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        with torch.no_grad():
            out = model.generate(input_ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        new_ids = out[0, input_ids.shape[1] :].tolist()
        assert len(new_ids) == 20
        assert len(set(new_ids)) > 3, new_ids


def test_checkpoint_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_checkpoint("llama", tmp_path / "a")
    b = make_tiny_checkpoint("llama", tmp_path / "b")
    c = make_tiny_checkpoint("llama", tmp_path / "c", seed=1)
    for name in ["model.safetensors", "tokenizer.json", "config.json", "generation_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # One tokenizer for every seed: tiny draft and target models must share it.
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_load_tokenizer_errors(tmp_path: Path, tiny_qwen3_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "config.json").write_text((tiny_qwen3_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(str(tiny_qwen3_path)).is_fast


def test_encode_prompt_round_trips(tiny_qwen3_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3_path)
    text = "Hello, world! Café 東京 😀"
    ids = encode_prompt(tokenizer, text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text  # no BOS in this tokenizer: nothing added
    assert encode_prompt(tokenizer, "<|im_start|>") == [IM_START_ID]


def test_chat_template_renders_chatml(tiny_model_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_path)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = apply_chat_template(tokenizer, messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2
    no_prompt = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert tokenizer.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_override_and_kwargs(tiny_qwen3_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3_path)
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    ids = apply_chat_template(
        tokenizer, [{"role": "user", "content": "x"}], chat_template=template, greeting="Hey"
    )
    assert tokenizer.decode(ids) == "Hey[x]"


def test_missing_chat_template_is_a_clear_error(tiny_qwen3_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3_path)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "x"}])


def test_get_eos_token_ids(tiny_qwen3_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3_path)
    assert get_eos_token_ids(tokenizer, None) == {IM_END_ID}
    assert get_eos_token_ids(tokenizer, {"eos_token_id": ENDOFTEXT_ID}) == {0, IM_END_ID}
    assert get_eos_token_ids(tokenizer, {"eos_token_id": [5, IM_END_ID]}) == {5, IM_END_ID}
    assert get_eos_token_ids(tokenizer, {"temperature": 0.6}) == {IM_END_ID}
