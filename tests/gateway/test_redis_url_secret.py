"""The Redis URL (it may carry a password) never travels on argv, where `ps` shows it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.registry import REDIS_URL_ENV, REDIS_URL_FILE_ENV, resolve_redis_url


def test_password_on_the_command_line_is_refused(monkeypatch):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(ValueError, match="TANDEM_REDIS_URL_FILE"):
        resolve_redis_url("redis://user:s3cret@10.0.0.5:6379/0")
    assert resolve_redis_url("redis://10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"


def test_url_from_a_mounted_file(monkeypatch, tmp_path):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    secret = tmp_path / "redis-url"
    secret.write_text("rediss://tandem:s3cret@redis:6380/0\n")
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(secret))
    assert resolve_redis_url(None) == "rediss://tandem:s3cret@redis:6380/0"
    secret.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_redis_url(None)
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read"):
        resolve_redis_url(None)


@pytest.mark.parametrize("role", ["decode", "gateway"])
def test_services_refuse_a_password_on_argv_before_loading_anything(role):
    url = "redis://user:s3cret@127.0.0.1:1/0"
    argv = [role, "--redis-url", url] + (["--model", "x"] if role == "gateway" else ["x"])
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "TANDEM_REDIS_URL_FILE" in proc.stderr and "s3cret" not in proc.stderr
