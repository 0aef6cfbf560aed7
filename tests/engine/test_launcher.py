"""`tandem serve` argument handling that needs no processes."""

from __future__ import annotations

import argparse

from engine.launcher import _without, gpu_memory_shares


def _args(device: str, util: float = 0.9) -> argparse.Namespace:
    return argparse.Namespace(device=device, gpu_memory_utilization=util)


def test_services_on_one_gpu_split_its_memory_cumulatively():
    shares = gpu_memory_shares(_args("cuda"), ["m", "--device", "cuda"], 3)
    assert shares == [["--gpu-memory-utilization", f"{0.9 * k / 3:.4f}"] for k in (1, 2, 3)]


def test_no_split_on_cpu_or_when_sized_explicitly():
    assert gpu_memory_shares(_args("cpu"), [], 2) == [[], []]
    argv = ["--device", "cuda", "--kv-cache-memory-bytes", "1000"]
    assert gpu_memory_shares(_args("cuda"), argv, 2) == [[], []]
    argv = ["--device", "cuda", "--gpu-memory-utilization=0.5"]
    assert gpu_memory_shares(_args("cuda", 0.5), argv, 2) == [[], []]


def test_serve_only_flags_are_not_passed_to_services():
    argv = ["model", "--port", "9000", "--num-decode=2", "--max-model-len", "512"]
    assert _without(argv, {"--port": 0, "--num-decode": 0}) == ["model", "--max-model-len", "512"]
