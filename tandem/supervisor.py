"""Restart the children of a `tandem serve` that exit.

A child that exits is restarted with the same flags on the port it had, so the gateway's static
`--decode/--prefill` lists (and its gRPC clients, which reconnect) reach it again; with Redis it
registers itself anew. Restarts back off exponentially, 1 s doubling to 30 s, and the backoff
starts over once a child has stayed up 60 s. A child that exits before printing READY (or does
not print it in time) has failed at start-up; 5 such failures in a row of one service mean it
cannot start (bad flags, a port taken, no memory), and retrying forever would hide that: the
launcher stops everything and exits 1. The first start of each service is not supervised: a
failure there is almost always the command line, and `tandem serve` fails at once.

`Supervisor.tick()` runs on the launcher's main thread every half second: it notices exits,
schedules each restart after its backoff, starts it with `Cluster.spawn` (which does not wait)
and notices when the replacement prints READY.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.launcher import Child, Cluster

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next exit starts the backoff over
    max_start_failures: int = 5  # exits before READY in a row: give up
    start_timeout_s: float = 600.0  # no READY by then: a failure at start-up

    def __post_init__(self):
        assert 0 < self.initial_backoff_s <= self.max_backoff_s
        assert self.max_start_failures >= 1


class GiveUpError(RuntimeError):
    """A service failed at start-up `max_start_failures` times in a row."""


@dataclass
class _Slot:
    """One supervised service. `child` is None while it waits to be restarted."""

    role: str
    restart_argv: list[str]
    child: Child | None
    last: Child  # the newest process (the one a restart replaces in `Cluster.children`)
    backoff_s: float
    up_since: float | None = None  # when `child` was seen READY
    spawned_at: float = 0.0
    restart_at: float = 0.0
    num_start_failures: int = 0
    num_restarts: int = 0


class Supervisor:
    """Restart the children of a `Cluster` that exit; `tick()` is called periodically by one
    thread and raises `GiveUpError`."""

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy = RestartPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cluster, self.policy, self.clock = cluster, policy, clock
        self.slots: list[_Slot] = []

    def watch(self, child: Child, restart_argv: list[str]) -> None:
        """Supervise a READY child; `restart_argv` starts its replacement."""
        assert child.address is not None, "watch children once they are READY"
        slot = _Slot(child.role, restart_argv, child, child, self.policy.initial_backoff_s)
        slot.up_since = slot.spawned_at = self.clock()
        self.slots.append(slot)

    def tick(self) -> None:
        for slot in self.slots:
            now = self.clock()
            child = slot.child
            if child is None:
                if now >= slot.restart_at:
                    self._restart(slot, now)
                continue
            code = child.proc.poll()
            if code is None and slot.up_since is None:
                if child.address is not None:
                    slot.up_since, slot.num_start_failures = now, 0
                    logger.info(
                        "%s is back: pid %d at %s", slot.role, child.proc.pid, child.address
                    )
                elif now - slot.spawned_at > self.policy.start_timeout_s:
                    logger.error(
                        "%s (pid %d) not READY after %.0f s; killing it",
                        slot.role,
                        child.proc.pid,
                        self.policy.start_timeout_s,
                    )
                    child.proc.kill()
                    code = child.proc.wait()
            if code is not None:
                self._on_exit(slot, child, code, now)

    def _on_exit(self, slot: _Slot, child: Child, code: int, now: float) -> None:
        child.ready.wait(1.0)  # the pipe's end: a READY line printed just before dying is read
        policy = self.policy
        if child.address is None:
            slot.num_start_failures += 1
            if slot.num_start_failures >= policy.max_start_failures:
                raise GiveUpError(
                    f"{slot.role} failed at start-up {slot.num_start_failures} times in a row "
                    f"(last exit code {_describe(code)})"
                )
        elif now - (slot.up_since if slot.up_since is not None else now) >= policy.stable_s:
            slot.backoff_s = policy.initial_backoff_s
        delay = slot.backoff_s
        slot.backoff_s = min(2 * delay, policy.max_backoff_s)
        slot.child, slot.up_since, slot.restart_at = None, None, now + delay
        logger.warning(
            "%s (pid %d) exited with code %s; restarting it in %.0f s (restart %d)",
            slot.role,
            child.proc.pid,
            _describe(code),
            delay,
            slot.num_restarts + 1,
        )

    def _restart(self, slot: _Slot, now: float) -> None:
        slot.num_restarts += 1
        slot.child = self.cluster.spawn(slot.role, slot.restart_argv, replaces=slot.last)
        slot.last, slot.spawned_at = slot.child, now
        logger.info("restarting %s: pid %d", slot.role, slot.child.proc.pid)


def _describe(code: int) -> str:
    """An exit code, with the signal's name when a signal ended the process (`-9 (SIGKILL)`)."""
    if code < 0 and -code in {s.value for s in signal.Signals}:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)
