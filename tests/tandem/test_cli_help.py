"""`tandem serve/prefill/decode --help`: every option has a description and shows its default."""

from __future__ import annotations

import re

import pytest

from decode_svc.server import build_parser as decode_parser
from prefill_svc.server import build_parser as prefill_parser
from tandem.launcher import build_parser as serve_parser

PARSERS = {"serve": serve_parser, "prefill": prefill_parser, "decode": decode_parser}


def help_entries(text: str) -> dict[str, str]:
    """Option (or positional) invocation → its description, from argparse's help layout:
    an entry starts at two spaces of indent; its description follows on the line (after two
    spaces) or on deeper-indented lines below."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            invocation, _, description = line.strip().partition("  ")
            current = invocation
            entries[current] = description.strip()
        elif current is not None and re.match(r"^ {3,}\S", line):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        elif not line.strip() or not line.startswith(" "):
            current = None  # a section heading or a blank line ends the entry
    return entries


@pytest.mark.parametrize("role", PARSERS)
def test_every_option_is_described_with_its_default(role):
    text = PARSERS[role]().format_help()
    entries = help_entries(text)
    options = [e for e in entries if e.startswith("-") and not e.startswith("-h")]
    assert len(options) >= 15, text  # the engine flags alone are more
    assert "model" in entries  # the positional
    for invocation, description in entries.items():
        if invocation.startswith("-h"):
            continue
        assert description, f"tandem {role} --help: {invocation} has no description"
        assert "default" in description, f"tandem {role} --help: {invocation} shows no default"


def test_serve_help_names_its_own_flags_defaults():
    entries = help_entries(serve_parser().format_help())
    port = next(d for e, d in entries.items() if e.startswith("--port"))
    assert "(default: 8000)" in port
    num_decode = next(d for e, d in entries.items() if e.startswith("--num-decode"))
    assert "(default: 1)" in num_decode


def test_generate_help_describes_every_option(capsys):
    from tandem.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    entries = help_entries(capsys.readouterr().out)
    assert {"model", "--prompt PROMPT", "--max-tokens MAX_TOKENS"} <= set(entries)
    for invocation, description in entries.items():
        assert description, f"tandem generate --help: {invocation} has no description"


def test_generate_with_a_bad_model_is_one_line(capsys):
    from tandem.cli import main

    assert main(["generate", "/nonexistent/model", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tandem generate: Model path '/nonexistent/model' does not exist.", err
