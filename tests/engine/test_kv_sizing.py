"""The KV cache is sized by memory, as vLLM sizes it: on a GPU every byte of the budget left
after weights and activations becomes blocks, not `max_num_seqs x max_model_len` (that cap
made a decode with a 56 GiB budget refuse remote prefills at 262,144 tokens). The CPU default
budget keeps the cap (a dev machine's RAM, pinned for UCX)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner

GiB = 1 << 30


def _runner(path, device: str, available_bytes: int, **kwargs) -> SimpleNamespace:
    config = EngineConfig.from_args(str(path), max_model_len=256, max_num_seqs=4, **kwargs)
    return SimpleNamespace(
        config=config,
        block_size=config.cache.block_size,
        device=torch.device(device),
        profile_available_kv_bytes=lambda: available_bytes,
    )


def _bytes_per_block(runner) -> int:
    return runner.config.kv_bytes_per_token() * runner.block_size


def test_gpu_budget_becomes_blocks_beyond_max_num_seqs(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path, "cuda", 1 * GiB)
    num_blocks = ModelRunner.determine_num_blocks(runner)
    assert num_blocks == 1 * GiB // _bytes_per_block(runner)
    max_num_seqs_cap = 4 * (256 // runner.block_size) + 1
    assert num_blocks > 100 * max_num_seqs_cap


def test_cpu_default_budget_keeps_the_cap(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path, "cpu", 0)
    assert ModelRunner.determine_num_blocks(runner) == 4 * (256 // runner.block_size) + 1


def test_explicit_bytes_are_all_used(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path, "cpu", 0, kv_cache_memory_bytes=64 << 20)
    assert ModelRunner.determine_num_blocks(runner) == (64 << 20) // _bytes_per_block(runner)


def test_too_small_a_budget_says_what_to_change(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path, "cuda", 1024)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ModelRunner.determine_num_blocks(runner)
