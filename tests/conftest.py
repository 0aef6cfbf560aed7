"""Session fixtures shared by every test package: tiny real checkpoints made on the fly."""

from __future__ import annotations

import os

import torch  # noqa: E402

# Without a GPU, kernels run in Triton's interpreter; set before any kernel module imports.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import secrets  # noqa: E402

from engine.internal_auth import ENV_TOKEN  # noqa: E402

# Services and gateways refuse to start without an internal token: every process a test starts
# inherits this one, and the test's own gRPC clients (`internal_channel`) send it.
os.environ.setdefault(ENV_TOKEN, secrets.token_hex(32))

import pytest  # noqa: E402

from tests.fixtures.tiny_models import (  # noqa: E402
    make_repetitive_checkpoint,
    make_tiny_checkpoint,
)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def tiny_repetitive_path(tmp_path_factory):
    return make_repetitive_checkpoint(tmp_path_factory.mktemp("repetitive"))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_model_path(request, tiny_qwen3_path, tiny_llama_path):
    return {"qwen3": tiny_qwen3_path, "llama": tiny_llama_path}[request.param]
