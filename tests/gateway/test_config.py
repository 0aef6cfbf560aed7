"""Flags and environment become one validated GatewaySettings."""

from __future__ import annotations

import pydantic
import pytest

from gateway.__main__ import parse_args, settings_from_args
from gateway.config import GatewaySettings


def test_flags():
    args = parse_args(
        [
            "--model",
            "m",
            "--port",
            "9000",
            "--decode",
            "a:1, b:2",
            "--prefill",
            "p:3",
            "--served-model-name",
            "x",
            "y",
            "--max-model-len",
            "128",
        ]
    )
    s = settings_from_args(args)
    assert (s.host, s.port, s.model, s.max_model_len) == ("127.0.0.1", 9000, "m", 128)
    assert s.decode == ["a:1", "b:2"] and s.prefill == ["p:3"]
    assert s.served_model_name == ["x", "y"]


def test_environment_and_defaults(monkeypatch):
    monkeypatch.setenv("TANDEM_GATEWAY_MODEL", "org/model")
    monkeypatch.setenv("TANDEM_GATEWAY_DECODE", "d:1,d:2")
    s = settings_from_args(parse_args(["--port", "1"]))
    assert s.model == "org/model" and s.decode == ["d:1", "d:2"] and s.prefill == []
    assert s.served_model_name == ["org/model"]  # vLLM: defaults to --model


def test_bad_address_is_rejected():
    with pytest.raises(pydantic.ValidationError, match="not host:port"):
        GatewaySettings(model="m", decode="localhost")
