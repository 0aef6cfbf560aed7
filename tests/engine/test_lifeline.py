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


# A second SIGTERM that lands while the first one's handler is setting the stop flag: `timeout`
# and pkill both signalling `tandem serve` did this, and threading.Event.set, re-entered with
# its lock held, waited for itself forever. The child below makes that moment deterministic:
# its handler, in the middle of setting the flag (for an Event: holding its lock, as Event.set
# does), sends the second signal, which Python delivers right there.
NESTED_SIGNAL = """
import os, signal, sys, threading
from engine.lifeline import StopFlag
flag = threading.Event() if sys.argv[1] == "event" else StopFlag()
lock = getattr(flag, "_cond", None) or threading.Lock()
nested = []

def on_signal(signum, frame):
    if not nested:
        nested.append(1)
        with lock:  # what Event.set holds; StopFlag's set holds nothing
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # bytecodes: the nested handler runs here
            flag._flag = True if sys.argv[1] == "event" else flag.set()
    else:
        flag.set()

signal.signal(signal.SIGTERM, on_signal)
os.kill(os.getpid(), signal.SIGTERM)
print("stopped" if flag.wait(5) else "not stopped", flush=True)
"""


def _nested_signal(kind: str, timeout_s: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [sys.executable, "-c", NESTED_SIGNAL, kind],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None  # hung


def test_a_signal_inside_the_stop_handler_does_not_hang_it():
    # The bug, reproduced: Event.set re-entered hangs (a deadlock: no wait is long enough).
    assert _nested_signal("event", timeout_s=3) is None
    done = _nested_signal("stopflag", timeout_s=30)
    assert done is not None and done.returncode == 0, done
    assert done.stdout.strip() == "stopped"
