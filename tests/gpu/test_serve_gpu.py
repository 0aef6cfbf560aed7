"""`tandem serve --device cuda`: gateway + 1 prefill + 1 decode, both engines on one GPU.

Both services size their KV cache by profiling the GPU (the launcher gives them cumulative
shares of gpu_memory_utilization, so the second does not take what the first holds), the KV
goes from P to D over UCX in GPU memory, and a greedy completion through the gateway equals the
offline engine's (fp32 tiny model: GPU fp32 == CPU is proven in test_engine_gpu.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from engine import LLM, SamplingParams
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def test_tandem_serve_device_cuda(tiny_qwen3_path):
    port = 9000 + os.getpid() % 500
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", str(tiny_qwen3_path), "--device", "cuda",
         "--dtype", "float32", "--max-model-len", "256", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Tandem is serving"):
                break
            assert time.monotonic() < deadline, "tandem serve did not come up"
        else:
            pytest.fail(f"tandem serve exited with {proc.wait()}:\n{''.join(lines[-30:])}")
        # Each engine profiled the GPU for its KV budget (the CUDA sizing path), P then D.
        assert sum("Memory profiling" in ln for ln in lines) == 2, "".join(lines[-30:])
        body = {"model": str(tiny_qwen3_path), "prompt": PROMPT, "max_tokens": 12,
                "temperature": 0}  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer u"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = json.load(resp)["choices"][0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    offline = LLM(str(tiny_qwen3_path), device="cpu", max_model_len=256)
    expect = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert got["text"] == expect.text
    assert got["finish_reason"] == expect.finish_reason
