"""`tandem serve --metrics-port` gives every process a Prometheus endpoint on loopback and
prints where: the gateway's and each service's /metrics answer with their own metrics."""

from __future__ import annotations

import re
import sys

import httpx

from tests.integration.services import ENGINE_FLAGS
from tests.integration.test_supervision import START_S, LineProc, _kill_leftovers


def test_serve_prints_and_serves_every_metrics_endpoint(tiny_qwen3_path):
    model = str(tiny_qwen3_path)
    cmd = [sys.executable, "-m", "tandem.cli", "serve", model, *ENGINE_FLAGS, "--port", "0"]
    launcher = LineProc([*cmd, "--metrics-port", "0"])
    try:
        launcher.wait_for(r"^Tandem is serving ", START_S)
        _, m = launcher.wait_for(r"^Metrics: (.*)$", 5)
        endpoints = dict(re.findall(r"(gateway|prefill \d+|decode \d+) (http://\S+)", m.group(1)))
        assert set(endpoints) == {"gateway", "prefill 0", "decode 0"}, m.group(1)
        assert all(url.startswith("http://127.0.0.1:") for url in endpoints.values())
        bodies = {name: httpx.get(url, timeout=10).text for name, url in endpoints.items()}
        assert "tandem:" in bodies["gateway"]
        for name in ("prefill 0", "decode 0"):
            assert "vllm:num_requests_running" in bodies[name], name
        assert 'role="decode"' in bodies["decode 0"] and 'role="prefill"' in bodies["prefill 0"]
        assert "tandem:num_rejected_frame_connections" in bodies["decode 0"]  # its framed port
    finally:
        children = launcher.child_pids()
        rc = launcher.stop()
        leftovers = _kill_leftovers(children)
    assert rc == 0
    assert not leftovers
