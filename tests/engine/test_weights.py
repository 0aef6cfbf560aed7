"""engine/weights: resolving a model name to a folder, and streaming safetensors out of it."""

from __future__ import annotations

import inspect
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.weights import (
    SMOLLM2_REPO_ID,
    find_safetensors_files,
    iter_safetensors_weights,
    resolve_model_path,
    smollm2,
)


@pytest.fixture(scope="module")
def tiny_llama_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The same random tiny Llama saved whole and in ~100 KB shards."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    root = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    return {"single": root / "single", "sharded": root / "sharded"}


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors_weights(folder))


# ---- resolve_model_path: local folders and bad paths ------------------------------------------


def test_local_folder_is_returned(tiny_llama_checkpoints):
    folder = tiny_llama_checkpoints["single"]
    assert resolve_model_path(str(folder)) == folder.resolve()


def test_local_folder_without_config_json_names_what_is_missing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json.*model\.safetensors"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("missing", ["/no/such/model", "./no-such-model", "~/no/such/model"])
def test_nonexistent_local_path_is_named(missing):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        resolve_model_path(missing)
    assert missing in str(info.value)


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(path))


def test_invalid_hub_id_is_a_clear_error():
    with pytest.raises(ValueError, match="neither an existing local folder"):
        resolve_model_path("bad id with spaces")


def test_offline_unknown_hub_id_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE") as info:
        resolve_model_path("tandem-tests/no-such-model")
    message = str(info.value)
    assert "tandem-tests/no-such-model" in message
    assert "pass DIR as the model path" in message


# ---- iter_safetensors_weights -------------------------------------------------------------------


def test_sharded_and_single_file_give_the_same_tensors(tiny_llama_checkpoints):
    single, sharded = tiny_llama_checkpoints["single"], tiny_llama_checkpoints["sharded"]
    assert len(find_safetensors_files(single)) == 1
    assert len(find_safetensors_files(sharded)) > 1
    assert (sharded / "model.safetensors.index.json").is_file()

    expected = _load_all(single)
    got = _load_all(sharded)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert "lm_head.weight" in got and len(got) == 2 + 2 * 9 + 1


def test_shards_without_index_give_the_same_tensors(tiny_llama_checkpoints, tmp_path):
    folder = tmp_path / "no_index"
    shutil.copytree(tiny_llama_checkpoints["sharded"], folder)
    (folder / "model.safetensors.index.json").unlink()
    expected = _load_all(tiny_llama_checkpoints["single"])
    got = _load_all(folder)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_iteration_is_lazy(tiny_llama_checkpoints):
    weights = iter_safetensors_weights(tiny_llama_checkpoints["single"])
    assert inspect.isgenerator(weights)
    name, tensor = next(weights)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


def test_index_naming_a_missing_shard_is_an_error(tiny_llama_checkpoints, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(tiny_llama_checkpoints["sharded"], folder)
    victim = find_safetensors_files(folder)[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        list(iter_safetensors_weights(folder))


def test_pytorch_bin_only_is_rejected_clearly(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        list(iter_safetensors_weights(tmp_path))


def test_no_weights_at_all(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors"):
        list(iter_safetensors_weights(tmp_path))


# ---- the SmolLM2 build: once, atomically --------------------------------------------------------


def _fake_build(calls: list[int]):
    def build(gguf_path: Path, out_dir: Path) -> None:
        calls.append(1)
        time.sleep(0.3)  # long enough for a second builder to arrive while we hold the lock
        (out_dir / "model.safetensors").write_bytes(b"x")
        marker = {"build_version": smollm2.BUILD_VERSION}
        (out_dir / smollm2.BUILD_MARKER_FILE).write_text(json.dumps(marker))

    return build


def test_concurrent_builders_build_once(monkeypatch, tmp_path):
    calls: list[int] = []
    monkeypatch.setattr(smollm2, "build_smollm2", _fake_build(calls))
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: Path("fake.gguf"))
    out_dir = tmp_path / "models" / "smol"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(smollm2.ensure_smollm2(out_dir)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and results == [out_dir] * 3
    assert sorted(p.name for p in out_dir.parent.iterdir()) == [".smol.lock", "smol"]


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken_build(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "build_smollm2", broken_build)
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: Path("fake.gguf"))
    out_dir = tmp_path / "smol"
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2.ensure_smollm2(out_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smol.lock"]


def test_outdated_build_is_replaced(monkeypatch, tmp_path):
    calls: list[int] = []
    monkeypatch.setattr(smollm2, "build_smollm2", _fake_build(calls))
    monkeypatch.setattr(smollm2, "find_smollm2_gguf", lambda: Path("fake.gguf"))
    out_dir = tmp_path / "smol"
    out_dir.mkdir()
    (out_dir / "model.safetensors").write_bytes(b"old")
    (out_dir / smollm2.BUILD_MARKER_FILE).write_text(json.dumps({"build_version": -1}))
    (tmp_path / ".smol.tmp-dead").mkdir()  # a builder that was killed mid-way
    assert smollm2.ensure_smollm2(out_dir) == out_dir
    assert calls == [1] and (out_dir / "model.safetensors").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".smol.lock", "smol"]


@pytest.mark.slow
def test_smollm2_builds_offline_and_answers_paris():
    """The real build, in the user's cache (~20-30 s the first time, then instant)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start_s = time.perf_counter()
    folder = resolve_model_path(SMOLLM2_REPO_ID)
    resolve_s = time.perf_counter() - start_s
    print(f"\nresolve_model_path({SMOLLM2_REPO_ID}) -> {folder} in {resolve_s:.1f} s")
    assert folder.name == "HuggingFaceTB--SmolLM2-135M-Instruct"

    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and "quantization_config" not in config
    generation_config = json.loads((folder / "generation_config.json").read_text())
    assert (generation_config["bos_token_id"], generation_config["eos_token_id"]) == (1, 2)
    assert generation_config["pad_token_id"] == 2 and "temperature" not in generation_config
    weights = dict(iter_safetensors_weights(folder))
    assert len(weights) == 272 and all(t.dtype == torch.bfloat16 for t in weights.values())
    del weights

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer("a 12  3")["input_ids"] == [81, 216, 33, 34, 256, 35]  # digits split apart
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    start_s = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=24,
        )
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(f"greedy answer {answer!r} in {time.perf_counter() - start_s:.1f} s")
    assert "The capital of France is Paris." in answer
    assert output[0, -1].item() == tokenizer.eos_token_id  # stopped at <|im_end|>
