"""Children that end with the process that started them, without code between fork and exec.

`tandem serve` and `tandem gateway --workers N` start their services as child processes and
want them gone if they die (SIGKILL included): Linux's PR_SET_PDEATHSIG. Setting it in a
`preexec_fn` runs Python between fork and exec in a parent whose gRPC threads may hold locks
at the fork: the child then crashed before exec now and then (CI: a prefill's exit -6; under
load, tests/integration/test_kv_routing.py lost a decode to exit -11 in 2 of 7 runs, none of 6
since; no output either time). Instead the
parent passes its pid in `PARENT_PID_ENV` (`child_env`) and the child, first thing in its entry
point, asks for the signal itself (`die_with_parent`) and checks that the parent has not died
already (between the fork and that call).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

PARENT_PID_ENV = "TANDEM_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) for a child that should die with us."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with `child_env`: SIGTERM when that parent goes away (or now, if it
    has already). The variable is removed, so this process's own children name it instead."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


class StopFlag:
    """A stop request that signal handlers set (`tandem serve`, `tandem gateway --workers`).

    Not a threading.Event: Python runs signal handlers in the main thread between bytecodes, so a
    second SIGTERM can arrive while the first handler is inside Event.set holding its lock; the
    second Event.set then waits for that lock forever. `tandem serve` hung so, signalled by both
    `timeout` and pkill. Setting this flag is one store; `wait` polls it."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self._is_set = False

    def set(self) -> None:
        self._is_set = True

    def set_on_signals(self) -> None:
        """Set on SIGTERM and SIGINT (Ctrl-C) from now on."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.set())

    def is_set(self) -> bool:
        return self._is_set

    def wait(self, timeout_s: float) -> bool:
        """True once set; False after `timeout_s` without."""
        deadline = time.monotonic() + timeout_s
        while not self._is_set:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, self.POLL_S))
        return True
