"""The walls of the house (ARCHITECTURE, "floor by floor"; STYLE principle 16), checked by
reading every import statement, including those inside functions and under TYPE_CHECKING.

From the top: `tandem/` (CLI, launcher); the processes `prefill_svc/`, `decode_svc/`,
`gateway/`; `engine/`; at the ground `kernels/`, `kv_transfer/`, `protos/`. No arrow runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SERVICES = ("prefill_svc", "decode_svc", "gateway")
# package -> top-level packages it must not import
FORBIDDEN = {
    "kernels": ("engine", *SERVICES, "tandem"),
    "kv_transfer": ("engine", *SERVICES, "tandem"),
    "protos": ("engine", "kernels", "kv_transfer", *SERVICES, "tandem"),
    "engine": (*SERVICES, "tandem"),
    "prefill_svc": ("tandem",),
    "decode_svc": ("tandem",),
    "gateway": ("tandem",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative ones resolved."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from . import x` / `from .mod import x`
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(package: str) -> list[str]:
    forbidden = FORBIDDEN[package]
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, name in imported_modules(path):
            if name.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up(package):
    assert (REPO / package).is_dir(), package
    assert violations(package) == []


def test_the_scan_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The scanner itself: a lazy import in a function body counts like a top-level one."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "k.py").write_text("def f():\n    from engine.attention import AttentionBackend\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert violations("kernels") == ["kernels/k.py:2 imports engine.attention"]
