"""2 prefill + 2 decode under 32 concurrent streams; faults seen through the gateway;
`tandem serve` itself with SmolLM2 (real weights) and its clean shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.e2e.cluster import deploy

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]


@pytest.fixture(scope="module")
def dep(tiny_llama_path):
    # The P/D path under load is what these tests are about: with the default policy the cost
    # model rightly prefills some of a 32-request burst on the decodes (the prefills' queues
    # count in full since 4a1ada7), which is tested in tests/gateway/test_cost_model_pd.py.
    d = deploy(str(tiny_llama_path), 2, 2, FLAGS, gateway_flags=["--prefill-policy", "remote"])
    yield d
    d.stop()


def test_32_concurrent_streams_equal_offline(dep, tiny_llama_path):
    offline = LLM(str(tiny_llama_path), max_model_len=256, num_gpu_blocks_override=128)
    prompts = [f"Story number {i}: " + "once upon a time " * (i % 7) for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]

    async def one(client, prompt):
        stream = await client.completions.create(
            model=dep.model,
            prompt=prompt,
            temperature=0,
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        client = openai.AsyncOpenAI(base_url=dep.base_url, api_key="u", max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == expected
    loads = dep.loads("decode")
    assert all(ld.num_requests_total > 0 for ld in loads), "both decodes served"
    assert sum(ld.num_remote_prefills for ld in loads) == 32
    assert all(ld.num_requests_total > 0 for ld in dep.loads("prefill")), "both prefills served"
    dep.wait_idle()


def test_client_disconnect_mid_stream_aborts_decode(dep):
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST",
            f"{dep.base_url}/completions",
            json={
                "model": dep.model,
                "prompt": "Go on and on",
                "max_tokens": 230,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as resp:
            assert resp.status_code == 200
            for i, _ in enumerate(resp.iter_lines()):
                if i >= 3:
                    break  # leave mid-stream: closing the connection
    dep.wait_idle()
    assert all(ld.num_running == 0 for ld in dep.loads("decode"))


def test_kill_decode_mid_stream(tiny_llama_path):
    d = deploy(str(tiny_llama_path), 1, 2, FLAGS)
    try:
        client = openai.OpenAI(base_url=d.base_url, api_key="u", max_retries=0)
        stream = client.completions.create(
            model=d.model,
            prompt="Tell a long tale",
            max_tokens=230,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        victim = None
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(stream):
                if i == 2:
                    busy = [c for c, ld in zip(d.decodes, d.loads("decode")) if ld.num_running > 0]
                    victim = busy[0]
                    victim.proc.kill()
        assert victim is not None
        # The gateway routes around the dead decode: the next requests all succeed.
        for _ in range(4):
            r = client.completions.create(
                model=d.model, prompt="hello", max_tokens=4, temperature=0
            )
            assert r.choices[0].finish_reason in ("length", "stop")
        d.wait_idle()
    finally:
        d.stop()


@pytest.mark.slow
def test_tandem_serve_smollm2_paris_and_clean_shutdown(tmp_path):
    port = 8000 + os.getpid() % 1000
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            str(256 << 20),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("Tandem is serving"):
                break
            assert time.monotonic() < deadline, "tandem serve did not come up"
        else:
            pytest.fail(f"tandem serve exited with {proc.wait()}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="u", max_retries=0)
        r = client.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in r.choices[0].message.content
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 3  # gateway, prefill, decode
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    _wait(lambda: all(_is_gone(pid) for pid in children), 5)


def _wait(check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _is_gone(pid: str) -> bool:
    """Exited (reaped, or a zombie: it runs nothing and holds no port)."""
    return not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
