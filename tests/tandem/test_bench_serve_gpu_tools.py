"""`bench/serve_gpu`'s bookkeeping: the metrics endpoints from `tandem serve`'s line, each
layer's mean TTFT over a point from two scrapes, and the one-line step summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench import serve_gpu
from engine.step_trace import KINDS

REPO = Path(__file__).resolve().parents[2]

LOG = [
    "Tandem is serving m at http://127.0.0.1:8100/v1 (1 prefill, 1 decode)\n",
    "Metrics: gateway http://127.0.0.1:40001/metrics, prefill 0 http://127.0.0.1:40002/metrics, "
    "decode 0 http://127.0.0.1:40003/metrics\n",
]


def test_metrics_urls_from_the_serve_line():
    assert serve_gpu.metrics_urls(LOG) == {
        "gateway": "http://127.0.0.1:40001/metrics",
        "prefill 0": "http://127.0.0.1:40002/metrics",
        "decode 0": "http://127.0.0.1:40003/metrics",
    }


def test_ttft_by_layer_is_the_points_own_mean():
    """Histogram sums and counts before and after a point: the point's requests only; a
    process without TTFT observations in the point (a prefill) is left out."""
    before = {"gateway": (10.0, 100.0), "decode 0": (4.0, 100.0), "prefill 0": (0.0, 0.0)}
    after = {"gateway": (30.0, 200.0), "decode 0": (9.0, 200.0), "prefill 0": (0.0, 0.0)}
    got = serve_gpu.mean_ms_by_layer(before, after, client_mean_ms=250.0)
    assert got == pytest.approx({"client": 250.0, "gateway": 200.0, "decode 0": 50.0})


def test_phase_counts_are_the_points_own():
    """How many requests a phase's mean is over: the point's observations per process, none
    for a process without any in the point."""
    before = {"decode 0": (4.0, 100.0), "prefill 0": (1.0, 7.0)}
    after = {"decode 0": (9.0, 130.0), "prefill 0": (1.0, 7.0), "decode 1": (0.5, 2.0)}
    assert serve_gpu.count_by_layer(before, after) == {"decode 0": 30, "decode 1": 2}


def test_histogram_totals_parse_one_scrape(monkeypatch):
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_count{model_name="m"} 9.0\n'
        'vllm:e2e_request_latency_seconds_sum{model_name="m"} 7.0\n'
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        "vllm:request_queue_time_seconds_count 2.0\n"
        "vllm:request_queue_time_seconds_sum 0.25\n"
        "# TYPE tandem:remote_prefill_rpc_seconds histogram\n"
        "tandem:remote_prefill_rpc_seconds_count 3.0\n"
        "tandem:remote_prefill_rpc_seconds_sum 0.75\n"
    )

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self) -> bytes:
            return text.encode()

    monkeypatch.setattr(serve_gpu.urllib.request, "urlopen", lambda url, timeout: Resp())
    assert serve_gpu.histogram_totals({"gateway": "http://x/metrics"}) == {
        serve_gpu.TTFT: {"gateway": (0.5, 4.0)},
        serve_gpu.E2E: {"gateway": (7.0, 9.0)},
        "vllm:request_queue_time_seconds": {"gateway": (0.25, 2.0)},
        "vllm:request_prefill_time_seconds": {},
        "tandem:request_prepare_seconds": {},
        "tandem:remote_prefill_setup_seconds": {},
        "tandem:remote_prefill_rpc_seconds": {"gateway": (0.75, 3.0)},
        "tandem:remote_prefill_transit_seconds": {},
    }
    assert serve_gpu.mean_ms_by_layer({}, {"decode 0": (0.25, 2.0)}, None) == {"decode 0": 125.0}


def test_steps_line_names_every_kind():
    st = {"engine_steps": 12, "step_s": 1.5, "gpu_idle_between_steps_s": 0.25}
    for i, kind in enumerate(KINDS):
        st[kind] = {"steps": i + 1, "mean_seqs": 8.0, "mean_tokens": 100.0, "gpu_span_s": 0.5}
    line = serve_gpu.steps_line(st)
    assert line.startswith("steps 12 step_s 1.5 gpu_idle 0.25s")
    assert all(f"{kind}={i + 1}x8seq/100tok/0.5s" in line for i, kind in enumerate(KINDS))


_COMPILE = """
import sys
from kernels import activation, rms_norm
from tests.kernels.test_compile_sm90 import _compile
bf = "*bf16"
if sys.argv[1] == "norm":
    types = dict(x_ptr=bf, residual_ptr=bf, weight_ptr=bf, out_ptr=bf, eps="fp32")
    _compile(rms_norm._rms_norm_kernel, types, dict(HAS_RESIDUAL=False, BLOCK=1024))
else:
    _compile(activation._silu_and_mul_kernel, dict(x_ptr=bf, out_ptr=bf), dict(BLOCK=1024))
"""


def _compile_into(cache, which: str) -> None:
    """Compile one kernel for sm_90 into `cache`, in a process without the interpreter (it
    replaces @triton.jit, as in tests/kernels/test_compile_sm90.py)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, which], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_kernels_built_since_names_what_triton_compiled(tmp_path):
    """Against Triton's own cache layout: two kernels compiled for sm_90 (no GPU needed) into
    an empty TRITON_CACHE_DIR, the second after a snapshot; only the second is named."""
    _compile_into(tmp_path, "norm")
    before = set(os.listdir(tmp_path))
    assert serve_gpu.kernels_built_since(tmp_path, before) == []
    _compile_into(tmp_path, "act")
    assert serve_gpu.kernels_built_since(tmp_path, before) == ["_silu_and_mul_kernel"]
    assert serve_gpu.kernels_built_since(tmp_path, set()) == [
        "_rms_norm_kernel", "_silu_and_mul_kernel"
    ]  # fmt: skip


def test_route_log_split_past_the_first_waves():
    """The medians skip the first lines (the closed loop's first waves); the transit is each
    request's gateway TTFT less the decode's own, then the median."""
    rows = [(9.0, 1.0)] * 4 + [(0.030, 0.020), (0.050, 0.045), (0.040, 0.025)]
    lines = [json.dumps({"measured_ttft_s": g, "decode_ttft_s": d}) for g, d in rows]
    got = serve_gpu.route_ttft_split_ms(lines, skip=4)
    assert got == pytest.approx(
        {"requests": 3, "gateway_call": 40.0, "decode": 25.0, "transit": 10.0}
    )
    assert serve_gpu.route_ttft_split_ms(lines[:4], skip=4) == {}


def test_route_lines_wait_for_the_batch_that_lands_late(tmp_path):
    """Lines written after the call starts (the gateway's batch) are waited for; with fewer
    than expected it returns what is there once its time is up."""
    log = tmp_path / "routes.jsonl"
    log.write_text("old\n")
    writer = threading.Timer(0.2, lambda: log.write_text("old\na\nb\n"))
    writer.start()
    try:
        assert serve_gpu.route_lines_after(log, 1, 2) == ["a", "b"]
    finally:
        writer.join()
    assert serve_gpu.route_lines_after(log, 1, 3, timeout_s=0.05) == ["a", "b"]
