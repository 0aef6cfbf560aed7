"""README.md and docs/*.md: every relative link, and every path in the module map, exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Inline `[text](target "title")` and reference `[label]: target` links; images alike.
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def relative_links(doc: Path) -> list[str]:
    text = _without_code_blocks(doc.read_text())
    targets = _INLINE.findall(text) + _REFERENCE.findall(text)
    return [t for t in targets if not _EXTERNAL.match(t) and not t.startswith("#")]


def test_the_parser_finds_links():
    assert "docs/security.md" in relative_links(ROOT / "README.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in relative_links(doc):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (doc.parent / path).resolve()
        assert resolved.exists(), f"{doc.relative_to(ROOT)} links to missing {target}"
        assert ROOT in resolved.parents or resolved == ROOT, f"{target} leaves the repository"


def test_module_map_paths_exist():
    text = (ROOT / "README.md").read_text()
    table = text.split("## Module map", 1)[1]
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        first_cell = row.split("|")[1]
        for path in re.findall(r"`([^`]+)`", first_cell):
            if "/" in path:  # bare names (`allowlist.py`) are relative to the row's package
                assert (ROOT / path).exists(), f"README module map names missing {path}"
