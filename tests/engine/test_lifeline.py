"""engine/lifeline.py: a child started with `child_env` dies with its parent (SIGKILL included),
and one whose parent died before it armed the signal ends at once; no code runs between fork
and exec (a `preexec_fn` there crashed children of a threaded parent: exit -11 / -6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.lifeline import PARENT_PID_ENV

REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "from engine.lifeline import die_with_parent; die_with_parent(); "
    "print('armed', flush=True); import time; time.sleep(120)"
)
PARENT = (
    "import subprocess, sys, time; from engine.lifeline import child_env; "
    f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=child_env()); "
    "print(p.pid, flush=True); time.sleep(120)"
)


def _is_gone(pid: int) -> bool:
    """Exited (a zombie nobody reaps counts: it runs nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(PARENT_PID_ENV, None)
    return env


def test_a_child_dies_when_its_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=_env()
    )
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"  # the child's own line
        assert not _is_gone(child_pid)
        parent.kill()  # SIGKILL: no handler of the parent's can clean up
        parent.wait()
        deadline = time.monotonic() + 30
        while not _is_gone(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if child_pid is not None and not _is_gone(child_pid):  # a failed run leaves nothing
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    """The pid it was given is not its parent's (that parent died before the child armed the
    signal): it terminates itself instead of running on as an orphan."""
    env = {**_env(), PARENT_PID_ENV: str(os.getpid() + 10**6)}  # no such parent
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGTERM and "armed" not in out.stdout


def test_without_the_variable_nothing_is_armed():
    out = subprocess.run(
        [sys.executable, "-c", CHILD.replace("time.sleep(120)", "pass")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "armed"
