"""A taken port is one line on stderr, before anything loads (`tandem serve`, `tandem gateway`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from engine.ports import bind_error
from gateway.__main__ import main as gateway_main
from tandem.launcher import serve_main


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_bind_error(taken_port):
    assert bind_error("127.0.0.1", 0) is None
    error = bind_error("127.0.0.1", taken_port)
    assert error is not None and f"port {taken_port}" in error and "in use" in error
    assert "\n" not in error


def test_serve_refuses_a_taken_port_before_starting_anything(taken_port, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    monkeypatch.delenv("TANDEM_REDIS_URL_FILE", raising=False)
    assert serve_main(["--port", str(taken_port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"port {taken_port}" in err, err


def test_gateway_refuses_a_taken_port_before_loading(taken_port):
    argv = ["--model", "not-loaded", "--decode", "h:1", "--insecure-internal"]
    with pytest.raises(SystemExit) as e:
        gateway_main([*argv, "--port", str(taken_port)])
    assert f"port {taken_port}" in str(e.value) and "\n" not in str(e.value)


def test_serve_process_exits_in_one_line(taken_port):
    start_s = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--port", str(taken_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed_s = time.monotonic() - start_s
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and f"port {taken_port}" in proc.stderr
    assert elapsed_s < 30, elapsed_s  # no model load (it took ~30 s before failing)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["/nonexistent/model"], "Model path '/nonexistent/model' does not exist."),
        (["--max-model-len", "100000"], "User-specified max_model_len (100000) is greater"),
        (["--dtype", "float7"], "Unknown dtype 'float7'"),
    ],
)
def test_serve_refuses_a_bad_engine_config_before_starting_anything(
    flags, said, tiny_qwen3_path, capsys, monkeypatch
):
    """What every service would die of at start-up is one line, before any service starts
    (it was a traceback from each service, then one from the launcher)."""
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    monkeypatch.delenv("TANDEM_REDIS_URL_FILE", raising=False)
    argv = flags if flags[0].startswith("/") else [str(tiny_qwen3_path), *flags]
    spawned = []
    monkeypatch.setattr("tandem.launcher.Cluster.spawn", lambda *a: spawned.append(a))
    assert serve_main([*argv, "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem serve: ") and said in err and "\n" not in err, err
    assert not spawned


def test_a_service_that_dies_starting_is_one_line(tiny_qwen3_path, capsys, monkeypatch):
    """A failure only the service meets (no room for a single KV block) ends `tandem serve`
    with one line pointing at the service's log, not the launcher's traceback."""
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    monkeypatch.delenv("TANDEM_REDIS_URL_FILE", raising=False)
    argv = [str(tiny_qwen3_path), "--port", "0", "--kv-cache-memory-bytes", "1"]
    assert serve_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tandem serve: prefill exited with code") and "log above" in err, err
