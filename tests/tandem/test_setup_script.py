"""scripts/setup.sh: installs once, skips while pyproject.toml and itself are unchanged."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def _fake_repo(tmp_path: Path) -> Path:
    """A copy of the script next to a pyproject, with a `.venv/bin/python` that logs its args."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SETUP, tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.log"}\n')
    python.chmod(0o755)
    return tmp_path


def _run(repo: Path, **env: str) -> list[str]:
    """The pip calls one run of setup.sh made."""
    log = repo / "calls.log"
    log.unlink(missing_ok=True)
    subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh")],
        check=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    return log.read_text().splitlines() if log.exists() else []


def test_installs_once_then_skips_until_pyproject_changes(tmp_path):
    repo = _fake_repo(tmp_path)
    first = _run(repo)
    assert any("-e .[test]" in c for c in first), first
    assert (repo / ".venv" / ".tandem-setup-stamp").is_file()
    assert _run(repo) == []  # nothing changed: no pip at all
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["y"]\n')
    assert _run(repo) == first  # pyproject changed: everything again
    assert _run(repo) == []
    assert _run(repo, TANDEM_SETUP_FORCE="1") == first


def test_a_failed_install_leaves_no_stamp(tmp_path):
    repo = _fake_repo(tmp_path)
    python = repo / ".venv" / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    result = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True)
    assert result.returncode != 0
    assert not (repo / ".venv" / ".tandem-setup-stamp").exists()
