"""`tandem serve` passes the gateway's own flags to its gateway, and only there."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_args as gateway_parse_args
from gateway.__main__ import settings_from_args
from tandem.launcher import GATEWAY_SWITCHES, GATEWAY_VALUES, _without, build_parser, gateway_flags

ARGV = [
    "model",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser=qwen3",
    "--enable-tokenizer-endpoints",
    "--trust-request-chat-template",
    "--max-model-len",
    "512",
]


def test_gateway_flags_reach_the_gateway_as_it_reads_them():
    flags = gateway_flags(build_parser().parse_args(ARGV))
    assert flags == [
        *("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
        *("--enable-auto-tool-choice", "--enable-tokenizer-endpoints"),
        "--trust-request-chat-template",
    ]
    settings = settings_from_args(gateway_parse_args(["--model", "m", *flags]))
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    assert settings.reasoning_parser == "qwen3" and settings.enable_tokenizer_endpoints
    assert settings.trust_request_chat_template
    assert not settings.exclude_tools_when_tool_choice_none
    assert gateway_flags(build_parser().parse_args(["model"])) == []


def test_gateway_flags_are_not_passed_to_the_services():
    services = _without(ARGV, GATEWAY_VALUES, switches=GATEWAY_SWITCHES)
    assert services == ["model", "--max-model-len", "512"]


def test_unknown_parser_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["model", "--tool-call-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_help_shows_the_gateway_flags_with_defaults():
    text = build_parser().format_help()
    for flag in [*GATEWAY_SWITCHES, *GATEWAY_VALUES]:
        assert flag in text
    assert "(default: False)" in text and "{hermes,llama3_json}" in text


def test_auto_tool_choice_without_a_parser_is_refused_at_once(capsys):
    from tandem.launcher import serve_main

    with pytest.raises(SystemExit):
        serve_main(["model", "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


def test_api_server_count_reaches_the_gateway_as_workers():
    flags = gateway_flags(build_parser().parse_args(["model", "--api-server-count", "3"]))
    assert flags == ["--api-server-count", "3"]
    assert gateway_parse_args(["--model", "m", *flags]).workers == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-server-count", "2"], "--api-server-count 2 needs --redis-url"),
        (["--api-server-count", "0"], "--api-server-count 0: a whole number"),
        (["--api-server-count", "two"], "--api-server-count two: a whole number"),
    ],
)
def test_api_server_count_is_checked_before_anything_starts(argv, message, capsys, monkeypatch):
    from engine.registry import REDIS_URL_ENV
    from tandem.launcher import serve_main

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    monkeypatch.delenv(f"{REDIS_URL_ENV}_FILE", raising=False)
    with pytest.raises(SystemExit):
        serve_main(["model", *argv])
    assert message in capsys.readouterr().err
